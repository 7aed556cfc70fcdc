import math

import pytest
import torch

from jetrl.policy.models import build_model
from jetrl.policy.routing import trace_length
from jetrl.policy.sampling import (
    SamplingConfig,
    _left_padded,
    generate,
    inference_copy,
    resolve_precision,
    sample_tokens,
    sampling_logprobs,
)
from jetrl.policy.train import Rollout, collate, compute_logprobs


def _prompts(tok):
    return [tok.encode("abc|"), tok.encode("hello world|"), tok.encode("x")]


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = sampling_logprobs(logits, 1.0, 0.8)
    # 0.5 + 0.3 reaches 0.8: the last two tokens are dropped and the rest renormalised.
    assert torch.isinf(lp[0, 2:]).all()
    torch.testing.assert_close(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))
    lp = sampling_logprobs(logits, 1.0, 0.81)
    assert torch.isfinite(lp[0, :3]).all() and torch.isinf(lp[0, 3])
    g = torch.Generator().manual_seed(0)
    toks, lps = sample_tokens(logits.expand(2000, 4), 1.0, 0.8, g)
    assert set(toks.tolist()) == {0, 1}
    assert abs((toks == 0).float().mean().item() - 0.625) < 0.05
    torch.testing.assert_close(lps, torch.where(toks == 0, math.log(0.625), math.log(0.375)))


def test_temperature_and_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    torch.testing.assert_close(sampling_logprobs(logits, 0.5, 1.0), torch.log_softmax(logits / 0.5, -1))
    tok, lp = sample_tokens(logits, 0.0, 1.0, None)
    assert tok.tolist() == [0] and lp.tolist() == [0.0]


def test_a_vanishing_temperature_is_greedy_not_nan():
    # 4e-283 divides float32 logits to inf: it must sample the argmax, with a finite log-prob.
    logits = torch.tensor([[0.5, 2.0, -1.0], [3.0, 0.0, 1.0]])
    for t in (4e-283, 1e-9):
        tokens, lps = sample_tokens(logits, t, 1.0, torch.Generator().manual_seed(0))
        assert tokens.tolist() == [1, 0] and lps.tolist() == [0.0, 0.0]
        assert torch.isfinite(sampling_logprobs(logits, t, 0.9).exp()).all()


def test_max_tokens_and_alignment(model, tok, cfg):
    gens = generate(
        model, _prompts(tok), SamplingConfig(max_tokens=5), generator=torch.Generator().manual_seed(0)
    )
    for g, p in zip(gens, _prompts(tok), strict=True):
        assert g.prompt_ids == p
        assert len(g.completion_ids) == 5 and g.finish_reason == "length"
        assert g.logprobs.shape == (5,) and g.logprobs.dtype == torch.float32 and (g.logprobs <= 0).all()
        assert g.routing is not None
        assert g.routing.shape == (trace_length(len(p), 5), cfg.num_moe_layers, cfg.top_k)
        assert g.routing.dtype == torch.uint8


def test_prompts_are_right_aligned_after_their_padding():
    tokens, valid = _left_padded([[5], [7, 8, 9], [3, 4]], [1, 3, 2], pad_id=0)
    assert tokens.tolist() == [[0, 0, 5], [7, 8, 9], [0, 3, 4]]
    assert valid.tolist() == [[False, False, True], [True, True, True], [False, True, True]]
    assert tokens.dtype == torch.long and valid.dtype == torch.bool


def test_stop_tokens_end_each_row_independently(model, tok):
    # Every token except the ones listed stops generation, so each row stops at its first
    # token outside that set; rows stop at different steps.
    g = torch.Generator().manual_seed(3)
    stop = tuple(range(30, 64))
    gens = generate(model, _prompts(tok) * 4, SamplingConfig(max_tokens=12, stop_token_ids=stop), generator=g)
    lengths = set()
    for out in gens:
        ids = out.completion_ids
        assert all(t not in stop for t in ids[:-1])
        if out.finish_reason == "stop":
            assert ids[-1] in stop
        else:
            assert len(ids) == 12
        assert out.routing is not None
        assert out.routing.shape[0] == len(out.prompt_ids) + len(ids) - 1
        lengths.add(len(ids))
    assert len(lengths) > 1


def test_sampling_is_reproducible(model, tok):
    cfg = SamplingConfig(max_tokens=6, temperature=0.9, top_p=0.95)
    a = generate(model, _prompts(tok), cfg, generator=torch.Generator().manual_seed(7))
    b = generate(model, _prompts(tok), cfg, generator=torch.Generator().manual_seed(7))
    c = generate(model, _prompts(tok), cfg, generator=torch.Generator().manual_seed(8))
    assert [x.completion_ids for x in a] == [x.completion_ids for x in b]
    for x, y in zip(a, b, strict=True):
        assert x.routing is not None and y.routing is not None
        assert torch.equal(x.logprobs, y.logprobs) and torch.equal(x.routing, y.routing)
    assert [x.completion_ids for x in a] != [x.completion_ids for x in c]


def test_generation_logprobs_and_trace_match_trainer(trained_model, tok, cfg):
    """fp32 inference with KV cache vs the trainer's full forward with replay: the same numbers up
    to round-off (torchtitan's experts run their GEMMs in bf16 even in an fp32 model)."""
    gens = generate(
        trained_model, _prompts(tok), SamplingConfig(max_tokens=6), generator=torch.Generator().manual_seed(0)
    )
    batch = collate([Rollout(g.prompt_ids, g.completion_ids, g.logprobs, 1.0, g.routing) for g in gens], cfg)
    with torch.no_grad():
        lp, _ = compute_logprobs(trained_model, batch, replay=True)
    torch.testing.assert_close(
        lp[batch.loss_mask], batch.inference_logprobs[batch.loss_mask], rtol=0, atol=2e-3
    )


def test_bf16_inference_path(trained_model, tok, cfg):
    inf = inference_copy(trained_model, "bf16")
    assert next(inf.parameters()).dtype == torch.bfloat16
    assert next(trained_model.parameters()).dtype == torch.float32
    gens = generate(
        inf, _prompts(tok), SamplingConfig(max_tokens=6), generator=torch.Generator().manual_seed(0)
    )
    batch = collate([Rollout(g.prompt_ids, g.completion_ids, g.logprobs, 1.0, g.routing) for g in gens], cfg)
    with torch.no_grad():
        lp, _ = compute_logprobs(trained_model, batch, replay=True)
    diff = (lp - batch.inference_logprobs)[batch.loss_mask].abs()
    assert torch.isfinite(diff).all() and diff.max() < 0.1  # close, but bf16 is not fp32
    with pytest.raises(ValueError, match="precision"):
        inference_copy(trained_model, "fp8")  # type: ignore[arg-type]  # a precision it does not have


def test_auto_precision_is_fp32_on_a_cpu_and_named_ones_are_kept(trained_model, monkeypatch):
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert next(inference_copy(trained_model, "auto").parameters()).dtype == torch.float32
    # A GPU is asked whether it has bf16; none here, so its answer is set.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_precision("auto", torch.device("cuda")) == "bf16"
    assert resolve_precision("auto") == "bf16"  # the GPU, where there is one
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_precision("auto", torch.device("cuda")) == "fp32"
    # A precision named is kept whatever the machine has.
    assert resolve_precision("fp32", torch.device("cpu")) == "fp32"
    assert next(inference_copy(trained_model, "bf16").parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="auto"):
        resolve_precision("fp8")  # type: ignore[arg-type]  # a precision it does not have


def test_prompt_validation(model):
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], SamplingConfig())
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1] * 300], SamplingConfig())
    assert generate(model, [], SamplingConfig()) == []


def test_generation_keeps_training_mode(model, tok):
    model.train()
    dense = build_model("tiny-dense")
    dense.train()
    gens = generate(dense, _prompts(tok), SamplingConfig(max_tokens=2))
    assert dense.training and all(g.routing is None for g in gens)  # a dense model has no trace
    generate(model, _prompts(tok), SamplingConfig(max_tokens=2))
    assert model.training
