import pytest
import torch

from jetrl.policy.loss import LossConfig
from jetrl.policy.models import build_model
from jetrl.policy.routing import TraceError
from jetrl.policy.sampling import SamplingConfig, generate, inference_copy
from jetrl.policy.train import (
    Rollout,
    StepAccumulator,
    collate,
    compute_logprobs,
    forward_backward,
    make_optimizer,
    set_deterministic,
    train_step,
)
from jetrl.policy.weights import checksum


def _rollout(p, c, trace=None, adv=1.0):
    return Rollout(list(range(3, 3 + p)), list(range(10, 10 + c)), torch.full((c,), -1.0), adv, trace)


def test_collate_layout(cfg):
    b = collate([_rollout(3, 2), _rollout(1, 4)], cfg)
    assert b.input_ids.shape == (2, 5)
    assert b.input_ids[0].tolist() == [3, 4, 5, 10, 11]
    assert b.loss_mask.tolist() == [[False, False, True, True], [True, True, True, True]]
    # position i predicts token i + 1: the completion's first token is predicted at P - 1
    assert b.input_ids[0, 1:][b.loss_mask[0]].tolist() == [10, 11]
    assert b.inference_logprobs[0].tolist() == [0.0, 0.0, -1.0, -1.0]
    assert b.num_tokens == 6 and b.routing is None


def _trace(rows, cfg):
    t = torch.zeros(rows, cfg.num_moe_layers, cfg.top_k, dtype=torch.uint8)
    t[..., 1] = 1
    return t


def test_collate_checks_traces(cfg):
    with pytest.raises(
        TraceError, match=r"rollout 1 \(2 prompt \+ 3 completion tokens\) trace: has 5 token rows"
    ):
        collate([_rollout(2, 2, _trace(3, cfg)), _rollout(2, 3, _trace(5, cfg))], cfg)
    with pytest.raises(TraceError, match="lack routing traces"):
        collate([_rollout(2, 2, _trace(3, cfg)), _rollout(2, 2)], cfg)
    with pytest.raises(ValueError, match="inference_logprobs"):
        collate([Rollout([1], [2, 3], torch.zeros(3), 0.0)], cfg)
    b = collate([_rollout(2, 2, _trace(3, cfg)), _rollout(3, 3, _trace(5, cfg))], cfg)
    assert b.routing is not None
    assert b.routing.shape == (2, 5, cfg.num_moe_layers, cfg.top_k)


def test_replay_needs_traces(model, cfg):
    with pytest.raises(TraceError, match="no routing traces"):
        compute_logprobs(model, collate([_rollout(2, 2)], cfg), replay=True)
    lp, _ = compute_logprobs(model, collate([_rollout(2, 2)], cfg), replay=False)
    assert lp.shape == (1, 3)


def _run(cfg, tok, steps=3, seed=0):
    set_deterministic(seed)
    model = build_model(cfg, seed=seed)
    opt = make_optimizer(model, lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    prompts = [tok.encode(s) for s in ("abc|", "ba|", "hello|", "q|")]
    history = []
    for _ in range(steps):
        gens = generate(inference_copy(model, "bf16"), prompts, SamplingConfig(max_tokens=6), generator=gen)
        rolls = [
            Rollout(g.prompt_ids, g.completion_ids, g.logprobs, float(i % 2) - 0.5, g.routing)
            for i, g in enumerate(gens)
        ]
        m = train_step(model, opt, collate(rolls, cfg), LossConfig())
        history.append(m)
    return model, history


def test_training_is_bit_reproducible(cfg, tok):
    a, ha = _run(cfg, tok)
    b, hb = _run(cfg, tok)
    c, _ = _run(cfg, tok, seed=1)
    assert checksum(a) == checksum(b)
    assert ha == hb
    assert checksum(a) != checksum(c)
    assert checksum(a) != checksum(build_model(cfg, seed=0))  # the steps changed the weights
    m = ha[-1]
    for key in (
        "loss",
        "mismatch_kl",
        "masked_frac",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "entropy",
        "grad_norm",
        "gap_frac",
        "kl",
        "num_tokens",
    ):
        assert key in m


def test_micro_batches_match_one_batch(cfg, tok):
    """Splitting a step into micro-batches normalised by the step's token count gives the same
    loss and (up to bf16 expert round-off) the same gradients."""
    rolls = [
        Rollout(tok.encode("ab|"), [5, 6, 7], torch.tensor([-3.0, -3.5, -4.0]), 1.0),
        Rollout(tok.encode("abcd|"), [8], torch.tensor([-4.0]), -1.0),
    ]
    results = []
    for parts in ([rolls], [rolls[:1], rolls[1:]]):
        model = build_model(cfg, seed=0)
        total = sum(collate(p, cfg).num_tokens for p in parts)
        loss = sum(
            forward_backward(model, collate(p, cfg), replay=False, num_tokens=total)["loss"] for p in parts
        )
        results.append((loss, torch.cat([p.grad.flatten() for p in model.parameters()])))
    (l1, g1), (l2, g2) = results
    assert l1 == pytest.approx(l2, rel=1e-5)
    assert g1.abs().max() > 0
    torch.testing.assert_close(g1, g2, rtol=0, atol=2e-2 * float(g1.abs().max()))


def test_train_step_accepts_micro_batches(cfg, tok):
    rolls = [
        Rollout(tok.encode("ab|"), [5, 6, 7], torch.tensor([-3.0, -3.5, -4.0]), 1.0),
        Rollout(tok.encode("abcd|"), [8], torch.tensor([-4.0]), -1.0),
    ]
    model = build_model(cfg, seed=0)
    before = checksum(model)
    m = train_step(
        model, make_optimizer(model), [collate(rolls[:1], cfg), collate(rolls[1:], cfg)], replay=False
    )
    assert m["num_tokens"] == 4 and checksum(model) != before
    # The micro-batches' metrics combine to the whole batch's (min and max of the ratios too).
    fresh = build_model(cfg, seed=0)
    whole = train_step(fresh, make_optimizer(fresh), collate(rolls, cfg), replay=False)
    for key in ("loss", "ratio_min", "ratio_max"):
        assert m[key] == pytest.approx(whole[key], rel=1e-3), key


def test_a_step_accumulated_as_micro_batches_come_matches_one_taken_at_once(cfg, tok):
    """A streaming trainer's step: each micro-batch's backward before the step's token count is
    known, the division after. The same step as train_step over the same micro-batches (up to
    round-off), and bit for bit the same again given the same micro-batches."""
    rolls = [
        Rollout(tok.encode("ab|"), [5, 6, 7], torch.tensor([-3.0, -3.5, -4.0]), 1.0),
        Rollout(tok.encode("abcd|"), [8], torch.tensor([-4.0]), -1.0),
        Rollout(tok.encode("a|"), [9, 5], torch.tensor([-2.0, -5.0]), 0.5),
    ]
    parts = [rolls[:1], rolls[1:]]

    def accumulated() -> tuple[torch.nn.Module, dict[str, float]]:
        model = build_model(cfg, seed=0)
        acc = StepAccumulator(model, make_optimizer(model), replay=False)
        for p in parts:
            acc.add(collate(p, cfg))
        return model, acc.finish()

    ref = build_model(cfg, seed=0)
    before = checksum(ref)
    whole = train_step(ref, make_optimizer(ref), [collate(p, cfg) for p in parts], replay=False)
    model, m = accumulated()
    assert checksum(model) != before
    assert m["num_tokens"] == whole["num_tokens"] == 6
    for key in ("loss", "pg_loss", "kl", "ratio_min", "ratio_max", "grad_norm", "entropy"):
        assert m[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), key
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    again, _ = accumulated()
    assert checksum(again) == checksum(model)
    with pytest.raises(RuntimeError, match="no micro-batch"):
        StepAccumulator(model, make_optimizer(model)).finish()
