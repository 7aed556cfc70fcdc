import pytest
import torch

from jetrl.policy.models import build_model, get_config
from jetrl.policy.routing import (
    TraceError,
    capture_routing,
    check_trace,
    pad_traces,
    replay_routing,
    trace_dtype,
    trace_length,
)


def test_trace_dtype():
    assert trace_dtype(8) == torch.uint8
    assert trace_dtype(256) == torch.uint8
    assert trace_dtype(257) == torch.uint16
    with pytest.raises(ValueError):
        trace_dtype(0)


def test_capture_then_replay_is_bit_exact(trained_model, cfg):
    x = torch.randint(0, cfg.vocab_size, (4, 11), generator=torch.Generator().manual_seed(1))
    with capture_routing(trained_model) as cap:
        ref = trained_model(x)
        trace = cap.take()
    assert trace.shape == (4, 11, cfg.num_moe_layers, cfg.top_k) and trace.dtype == torch.uint8
    with replay_routing(trained_model, trace):
        again = trained_model(x)
    assert torch.equal(ref, again)


def test_replay_changes_the_forward_when_routes_differ(trained_model, cfg):
    x = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    with capture_routing(trained_model) as cap:
        ref = trained_model(x)
        trace = cap.take().long()
    shifted = (trace + 1) % cfg.num_experts  # still distinct ids per row
    with replay_routing(trained_model, shifted):
        other = trained_model(x)
    assert not torch.allclose(ref, other)


def test_replay_reports_where_the_model_would_have_routed_elsewhere(trained_model, cfg):
    x = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with capture_routing(trained_model) as cap:
        trained_model(x)
        trace = cap.take().long()
    same: list[torch.Tensor] = []
    with replay_routing(trained_model, trace, same):
        trained_model(x)
    assert len(same) == cfg.num_moe_layers and not any(bool(d.any()) for d in same)
    # The same experts in another order are the same routing; another expert set is not.
    changed = trace.flip(-1).clone()
    changed[1, 4, 0] = (changed[1, 4, 0] + 1) % cfg.num_experts
    while bool((changed[1, 4, 0, :1] == changed[1, 4, 0, 1:]).any()):
        changed[1, 4, 0, 0] = (changed[1, 4, 0, 0] + 1) % cfg.num_experts
    differs: list[torch.Tensor] = []
    with replay_routing(trained_model, changed, differs):
        trained_model(x)
    assert differs[0].shape == (2, 7)
    assert differs[0].nonzero().tolist() == [[1, 4]]


def test_router_gets_gradients_under_replay(trained_model, cfg):
    x = torch.randint(0, cfg.vocab_size, (2, 7))
    trace = torch.stack([torch.randperm(cfg.num_experts)[: cfg.top_k] for _ in range(2 * 7 * cfg.n_layers)])
    trace = trace.view(2, 7, cfg.n_layers, cfg.top_k)
    with replay_routing(trained_model, trace):
        trained_model(x).logsumexp(-1).sum().backward()
    for layer in trained_model.layers.values():
        g = layer.moe.router.gate.weight.grad
        assert g is not None and g.abs().sum() > 0


def test_replay_uses_the_given_experts(trained_model, cfg):
    """Replayed ids reach the dispatcher: expert usage counters see exactly the trace."""
    trained_model.train()
    for layer in trained_model.layers.values():
        layer.moe.tokens_per_expert_E.zero_()
    trace = torch.zeros(1, 5, cfg.n_layers, cfg.top_k, dtype=torch.long)
    trace[..., 0], trace[..., 1] = 3, 6
    with replay_routing(trained_model, trace):
        trained_model(torch.zeros(1, 5, dtype=torch.long))
    for layer in trained_model.layers.values():
        counts = layer.moe.tokens_per_expert_E
        assert counts[3] == 5 and counts[6] == 5 and counts.sum() == 10


def test_replay_shape_errors_are_clear(model, cfg):
    bad = torch.zeros(1, 4, cfg.n_layers, cfg.top_k, dtype=torch.long)
    bad[..., 1] = 1
    with (
        pytest.raises(
            TraceError, match=r"covers \[batch, positions, top_k\] = \(1, 4, 2\).*sees \(1, 5, 2\)"
        ),
        replay_routing(model, bad),
    ):
        model(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(TraceError, match="must be"), replay_routing(model, torch.zeros(1, 4, 3, 2)):
        pass


def _good(rows=5, layers=2, k=2):
    t = torch.zeros(rows, layers, k, dtype=torch.uint8)
    t[..., 1] = 1
    return t


@pytest.mark.parametrize(
    ("trace", "match"),
    [
        (_good(rows=6), r"has 6 token rows but 5 are needed \(prompt \+ completion - 1"),
        (_good(layers=3), "covers 3 MoE layers, the model has 2"),
        (_good(k=3), "has top_k=3"),
        (_good().float(), "must be integers"),
        (_good()[0], "expected shape"),
        (_good() + 8, r"span \[8, 9\].*0\.\.7"),
        (torch.zeros(5, 2, 2, dtype=torch.uint8), "twice"),
    ],
)
def test_check_trace_errors(trace, match):
    with pytest.raises(TraceError, match=match):
        check_trace(trace, num_tokens=trace_length(3, 3), num_moe_layers=2, top_k=2, num_experts=8)


def test_check_trace_accepts_good_trace():
    check_trace(_good(), num_tokens=5, num_moe_layers=2, top_k=2, num_experts=8)
    with pytest.raises(TraceError):
        trace_length(3, 0)


def test_pad_traces_fills_distinct_ids():
    out = pad_traces([_good(rows=2), _good(rows=4)], 4)
    assert out.shape == (2, 4, 2, 2) and out.dtype == torch.long
    assert out[0, 2:].tolist() == [[[0, 1], [0, 1]]] * 2
    with pytest.raises(TraceError, match="do not fit"):
        pad_traces([_good(rows=5)], 4)


def test_uint16_trace_replays():
    cfg = get_config(
        "tiny-moe", num_experts=260, top_k=2, n_layers=1, dim=32, n_heads=2, n_kv_heads=1, moe_hidden_dim=8
    )
    m = build_model(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (1, 4))
    with capture_routing(m) as cap:
        ref = m(x)
        trace = cap.take()
    assert trace.dtype == torch.uint16
    with replay_routing(m, trace):
        assert torch.equal(m(x), ref)
