import copy

import pytest
import torch

from jetrl.policy.models import (
    CONFIGS,
    CachedSDPA,
    ExpertsInWeightDtype,
    build_model,
    get_config,
    moe_routers,
    to_titan_config,
)
from jetrl.policy.titan import GroupedExperts, TokenChoiceTopKRouter, qwen3_configs
from tests.support.forwards import cached_logits


def test_tiny_moe_is_torchtitan_qwen3(model, cfg):
    from jetrl.policy.titan import Qwen3Model

    assert isinstance(model, Qwen3Model)
    routers = moe_routers(model)
    assert len(routers) == cfg.n_layers
    assert all(isinstance(r, TokenChoiceTopKRouter) for r in routers)
    assert all(r.top_k == cfg.top_k and r.num_experts == cfg.num_experts for r in routers)
    assert all(isinstance(layer.attention.inner_attention, CachedSDPA) for layer in model.layers.values())


def test_build_is_seeded_and_leaves_global_rng_alone(cfg):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_model(cfg, seed=3), build_model(cfg, seed=3), build_model(cfg, seed=4)
    assert torch.equal(torch.rand(1), before)
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    assert any(not torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters(), strict=True))


def test_forward_backward_shapes(model, cfg):
    x = torch.randint(0, cfg.vocab_size, (3, 9))
    out = model(x)
    assert out.shape == (3, 9, cfg.vocab_size) and out.dtype == torch.float32
    out.logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_kv_cache_matches_full_forward(model, cfg):
    x = torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        full = model(x)
    torch.testing.assert_close(cached_logits(model, x, 6), full, rtol=1e-5, atol=1e-5)


def test_cached_sdpa_rejects_foreign_masks(model, cfg):
    with pytest.raises(TypeError, match="KVCache"):
        model(torch.zeros(1, 3, dtype=torch.long), None, object())


def test_dense_config_builds():
    m = build_model("tiny-dense")
    assert moe_routers(m) == []
    assert m(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 64)


@pytest.mark.parametrize(("ours", "theirs"), [("qwen3-30b-a3b", "30B-A3B"), ("qwen3-235b-a22b", "235B-A22B")])
def test_published_configs_match_torchtitan(ours, theirs):
    mine = to_titan_config(CONFIGS[ours])
    ref = qwen3_configs[theirs]("flex")
    assert (mine.vocab_size, mine.dim, len(mine.layers)) == (ref.vocab_size, ref.dim, len(ref.layers))
    a, b = mine.layers[0], ref.layers[0]
    assert (a.attention.n_heads, a.attention.n_kv_heads, a.attention.head_dim) == (
        b.attention.n_heads,
        b.attention.n_kv_heads,
        b.attention.head_dim,
    )
    assert a.attention.rope.theta == b.attention.rope.theta
    assert (a.moe.num_experts, a.moe.router.top_k, a.moe.router.score_func, a.moe.router.route_norm) == (
        b.moe.num_experts,
        b.moe.router.top_k,
        b.moe.router.score_func,
        b.moe.router.route_norm,
    )
    assert a.moe.routed_experts.inner_experts.hidden_dim == b.moe.routed_experts.inner_experts.hidden_dim


def test_config_validation():
    with pytest.raises(ValueError, match="top_k"):
        get_config("tiny-moe", top_k=9)
    with pytest.raises(KeyError, match="unknown model config"):
        get_config("nope")


def test_experts_compute_in_the_dtype_of_their_weights() -> None:
    """torchtitan's grouped experts cast to bf16 whatever the model's dtype; jetrl's compute in
    the weights' dtype: fp32 for the trainer (to fp32 rounding), bf16 in a bf16 copy."""
    model = build_model(get_config("tiny-moe"), seed=0)
    experts = next(m for m in model.modules() if isinstance(m, ExpertsInWeightDtype))
    counts = torch.tensor([3, 0, 5, 1, 2, 0, 4, 1])
    x = torch.randn(int(counts.sum()), experts.w1_EFD.shape[-1], generator=torch.Generator().manual_seed(0))

    def reference(x: torch.Tensor) -> torch.Tensor:
        rows, start = [], 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start : start + n].double()
            w1, w2, w3 = (w[e].double() for w in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD))
            rows.append((torch.nn.functional.silu(xe @ w1.T) * (xe @ w3.T)) @ w2.T)
            start += n
        return torch.cat(rows)

    with torch.no_grad():
        ref = reference(x)
        out = experts(x, counts)
        assert out.dtype == torch.float32
        assert (out.double() - ref).abs().max() < 1e-5 * ref.abs().max()
        in_bf16 = GroupedExperts.forward(experts, x, counts)  # torchtitan's own cast
        assert (in_bf16.double() - ref).abs().max() > 1e-4 * ref.abs().max()
        half = copy.deepcopy(experts).to(torch.bfloat16)
        assert half(x.bfloat16(), counts).dtype == torch.bfloat16
    # Gradients flow in fp32 too, also from a loss whose gradient is expanded (a plain sum).
    experts(x, counts).sum().backward()
    w1 = experts.w1_EFD.detach().double().requires_grad_()
    ref_out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start : start + n].double()
        w2, w3 = experts.w2_EDF[e].detach().double(), experts.w3_EFD[e].detach().double()
        ref_out.append((torch.nn.functional.silu(xe @ w1[e].T) * (xe @ w3.T)) @ w2.T)
        start += n
    torch.cat(ref_out).sum().backward()
    assert w1.grad is not None and experts.w1_EFD.grad is not None
    assert (experts.w1_EFD.grad.double() - w1.grad).abs().max() < 1e-5 * w1.grad.abs().max()
