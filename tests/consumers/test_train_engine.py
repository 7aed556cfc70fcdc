"""The single-process train engine through its seam: logprobs under replay, a step, weights out
and in, and a checkpoint's state that resumes bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jetrl.consumers.trainer.core import TrainCore
from jetrl.consumers.trainer.engine import make_train_engine
from jetrl.consumers.trainer.local_engine import LocalTrainEngine
from jetrl.consumers.trainer.settings import TrainerPart, TrainerSettings
from jetrl.policy.sampling import SamplingConfig, generate, inference_copy
from jetrl.policy.settings import ModelSettings
from jetrl.policy.train import Rollout
from jetrl.policy.weights import transfer_digest, weights_from_bytes

PART = TrainerPart(trainer=TrainerSettings(lr=1e-2), model=ModelSettings(name="tiny-moe"), seed=3)


def rollouts_from(engine_model: torch.nn.Module) -> list[Rollout]:
    """Samples of an fp32 copy of the engine's weights, with their routing and logprobs."""
    sampler = inference_copy(engine_model, "fp32")
    gens = generate(
        sampler,
        [[1, 5, 6, 7], [1, 8, 9]] * 2,
        SamplingConfig(max_tokens=5),
        generator=torch.Generator().manual_seed(0),
    )
    return [
        Rollout(g.prompt_ids, g.completion_ids, g.logprobs, advantage=(-1.0) ** i, routing=g.routing)
        for i, g in enumerate(gens)
    ]


def test_engine_logprobs_replay_what_inference_sampled_and_a_step_moves_the_weights() -> None:
    engine = make_train_engine(PART)
    assert isinstance(engine, LocalTrainEngine)  # the default engine
    rollouts = rollouts_from(engine.model)
    # Same weights and precision, the recorded experts replayed: the logprobs inference sampled.
    for lp, r in zip(engine.logprobs(rollouts), rollouts, strict=True):
        assert torch.allclose(lp, r.inference_logprobs, atol=1e-4)
    before = engine.checksum()
    want = engine.logprobs(rollouts)
    metrics = engine.step(rollouts)
    # The step's token records: the log-probs it trained from, and no routing differences
    # (the replayed experts are those the same weights chose).
    stats = engine.step_token_stats()
    assert stats is not None and len(stats) == sum(len(r.completion_ids) for r in rollouts)
    pieces = stats.split([len(r.completion_ids) for r in rollouts])
    for s, lp, r in zip(pieces, want, rollouts, strict=True):
        assert s.shape == (len(r.completion_ids), 2)
        assert torch.equal(s[:, 0], lp) and not bool(s[:, 1].any())
    assert metrics["num_tokens"] > 0 and engine.checksum() != before
    # Published weights carry the engine's checksum, and load back as they were.
    data, digest, blake3 = engine.export_weights({"version": "1"})
    tensors, stored = weights_from_bytes(data, expected_checksum=engine.checksum())
    assert digest == stored == engine.checksum() and blake3 == transfer_digest(data)
    other = make_train_engine(PART)
    other.load_weights(tensors)
    assert other.checksum() == engine.checksum()


def test_engine_state_resumes_bit_for_bit(tmp_path: Path) -> None:
    a = make_train_engine(PART)
    assert isinstance(a, LocalTrainEngine)
    rollouts = rollouts_from(a.model)
    a.step(rollouts)
    a.save_state(tmp_path)  # weights and optimizer moments, through the seam
    b = make_train_engine(PART)
    b.load_state(tmp_path)
    assert b.checksum() == a.checksum()
    a.step(rollouts)
    b.step(rollouts)
    assert b.checksum() == a.checksum()


def test_a_packed_step_trains_what_the_padded_step_trains() -> None:
    padded = LocalTrainEngine(PART)
    packed = LocalTrainEngine(PART.model_copy(update={"trainer": TrainerSettings(lr=1e-2, pack_tokens=16)}))
    rollouts = rollouts_from(padded.model)
    # Rows of 16 tokens take two of these 8- and 9-token rollouts each: half the rows.
    from jetrl.policy.packing import collate_for

    batch, layout = collate_for(rollouts, padded.mcfg, 16)
    assert batch.positions is not None and layout.num_rows < len(rollouts)
    for a, b in zip(packed.logprobs(rollouts), padded.logprobs(rollouts), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)  # other matmul shapes: float rounding only
    m_packed, m_padded = packed.step(rollouts), padded.step(rollouts)
    for k in ("loss", "grad_norm", "entropy", "num_tokens"):
        assert m_packed[k] == pytest.approx(m_padded[k], rel=1e-4, abs=1e-6), k
    assert m_padded["grad_norm"] > 0
    sa, sb = packed.step_token_stats(), padded.step_token_stats()
    assert sa is not None and sb is not None
    assert sa.shape == sb.shape and torch.allclose(sa, sb, atol=1e-5, rtol=0)
    wa, wb = packed.model.state_dict(), padded.model.state_dict()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4


def test_a_streaming_step_is_taken_again_the_same_way_from_its_micro_batches() -> None:
    """What replay does with a logged streaming step: the same micro-batches, one forward and
    backward each, then the optimizer step: bit for bit what the live trainer took, with every
    rollout's token records in training order."""
    part = PART.model_copy(update={"trainer": PART.trainer.model_copy(update={"stream_groups": True})})
    live, again = TrainCore(part), TrainCore(part)
    assert isinstance(live.engine, LocalTrainEngine)
    rollouts = rollouts_from(live.engine.model)
    before = live.checksum()
    live.accumulate(rollouts[:1])  # the live trainer: the first group as it came...
    live.finish_step(rollouts[1:])  # ...the rest when the step was whole
    stats = live.engine.step_token_stats()
    assert stats is not None and len(stats) == sum(len(r.completion_ids) for r in rollouts)
    metrics = again.train(rollouts, [1, 3])
    assert live.checksum() == again.checksum() != before
    again_stats = again.engine.step_token_stats()
    assert again_stats is not None and torch.equal(again_stats, stats)
    assert metrics["num_tokens"] == sum(len(r.completion_ids) for r in rollouts)
    with pytest.raises(ValueError, match="do not split"):
        again.train(rollouts, [1, 2])


def test_an_engine_that_cannot_accumulate_refuses_a_streaming_trainer() -> None:
    settings = TrainerSettings(engine="tests.support.plugins.tally_engine:TallyEngine", stream_groups=True)
    with pytest.raises(ValueError, match="cannot take a step's groups as they come"):
        TrainCore(PART.model_copy(update={"trainer": settings}))
    # "auto" takes whole batches with it instead.
    auto = settings.model_copy(update={"stream_groups": "auto"})
    assert not TrainCore(PART.model_copy(update={"trainer": auto})).can_stream
    assert TrainCore(PART).can_stream


def test_a_scheduled_engine_steps_at_its_schedule_s_rate_and_resumes_on_it(tmp_path: Path) -> None:
    settings = TrainerSettings(
        lr=1e-2, lr_warmup_steps=2, lr_decay="cosine", lr_decay_steps=3, lr_min_ratio=0.1
    )
    part = PART.model_copy(update={"trainer": settings})
    schedule = settings.lr_schedule()
    a = make_train_engine(part)
    assert isinstance(a, LocalTrainEngine)
    rollouts = rollouts_from(a.model)
    assert [a.step(rollouts)["lr"] for _ in range(3)] == [schedule.at(n) for n in range(3)]
    a.save_state(tmp_path)
    b = make_train_engine(part)
    b.load_state(tmp_path)
    # The resumed engine is where the run was on its schedule, and steps as it would have.
    assert b.step(rollouts)["lr"] == a.step(rollouts)["lr"] == schedule.at(3) < 1e-2
    assert b.checksum() == a.checksum()
    # A streaming step takes the same rate; past the decay, the floor.
    a.accumulate(rollouts[:2])
    a.accumulate(rollouts[2:])
    assert a.finish_step()["lr"] == schedule.at(4) > 1e-3
    assert a.step(rollouts)["lr"] == a.step(rollouts)["lr"] == pytest.approx(1e-3)
