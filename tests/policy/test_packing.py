"""Sequence packing (policy/packing.py): a packed batch gives the padded batch's per-rollout
logprobs, loss and updated weights.

Packed and padded agree only up to float rounding, not bit for bit: the matmuls run on other
shapes ([rows, width] differ) and SDPA on a boolean document mask instead of its causal kernel,
so float sums are taken in another order. fp32 round-off of these tiny models is ~1e-6; the
tolerances below leave room for that and are still orders of magnitude below what a leaking
mask or wrong positions give (~1e-1, see test_mask_and_positions_are_both_needed).
"""

import pytest
import torch

from jetrl.policy.loss import LossConfig, mismatch_stats, rl_loss
from jetrl.policy.models import CachedSDPA, PackedMask, build_model, get_config
from jetrl.policy.packing import PackedLayout, collate_for, collate_packed, pack_rows
from jetrl.policy.routing import replay_routing
from jetrl.policy.train import (
    Rollout,
    collate,
    compute_logprobs,
    make_optimizer,
    set_deterministic,
    train_step,
)

LOGPROB_ATOL = 1e-5  # measured max |packed - padded| over 10 seeds: 4.8e-7 (dense and MoE)


def _rollouts(cfg, n=9, seed=0, traces=None, with_env_tokens=True):
    """Mixed lengths (prompts 1..9, completions 1..13), random tokens and, for an MoE config,
    random (valid, distinct) routing traces; every third rollout has environment tokens."""
    g = torch.Generator().manual_seed(seed)
    traces = cfg.is_moe if traces is None else traces
    out = []
    for i in range(n):
        p = int(torch.randint(1, 10, (1,), generator=g))
        c = int(torch.randint(1, 14, (1,), generator=g))
        trace = None
        if traces:
            trace = torch.stack(
                [
                    torch.stack(
                        [
                            torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k]
                            for _ in range(cfg.n_layers)
                        ]
                    )
                    for _ in range(p + c - 1)
                ]
            ).to(torch.uint8)
        cmask = None
        if with_env_tokens and i % 3 == 2 and c > 1:
            cmask = [j % 2 == 0 for j in range(c)]
        out.append(
            Rollout(
                torch.randint(1, cfg.vocab_size, (p,), generator=g).tolist(),
                torch.randint(1, cfg.vocab_size, (c,), generator=g).tolist(),
                -3 * torch.rand(c, generator=g),
                float(i % 3) - 1.0,
                trace,
                cmask,
            )
        )
    return out


def _padded_slices(values, rollouts):
    """What LocalTrainEngine takes from an unpacked batch: rows[i, P-1 : P-1+C]."""
    return [
        values[i, len(r.prompt_ids) - 1 : len(r.prompt_ids) - 1 + len(r.completion_ids)]
        for i, r in enumerate(rollouts)
    ]


def test_pack_rows_is_first_fit_decreasing():
    # sorted: 8 (#2), 7 (#4), 5 (#0), 3 (#1) -> row of 7, 2 (#3) -> row of 8, 1 (#5) -> row of 5
    assert pack_rows([5, 3, 8, 2, 7, 1], 10) == [[2, 3], [4, 1], [0, 5]]
    # a rollout over row_len gets a row of its own and takes nothing else
    assert pack_rows([12, 3, 3], 10) == [[0], [1, 2]]
    assert pack_rows([10, 10], 10) == [[0], [1]]
    # equal lengths keep their order (ties broken by index)
    assert pack_rows([4, 4, 4], 8) == [[0, 1], [2]]


def test_collate_packed_layout_by_hand(cfg):
    rolls = [
        Rollout([3, 4], [10, 11], torch.tensor([-1.0, -2.0]), 0.5),
        Rollout([5], [12, 13, 14], torch.tensor([-3.0, -4.0, -5.0]), -1.0),
        Rollout([6, 7, 8], [15], torch.tensor([-6.0]), 2.0),
    ]
    b, lay = collate_packed(rolls, cfg, row_len=8)
    assert lay.rows == ((0, 1), (2,)) and lay.width == 8
    assert b.input_ids.tolist() == [[3, 4, 10, 11, 5, 12, 13, 14], [6, 7, 8, 15, 0, 0, 0, 0]]
    # position i predicts token i + 1; rollout 1 starts at offset 4, its completion at 4 + 1 - 1
    assert b.loss_mask.tolist() == [
        [False, True, True, False, True, True, True],
        [False, False, True, False, False, False, False],
    ]
    # position 3 holds rollout 0's last token and predicts rollout 1's first: never trained
    assert b.input_ids[0, 1:][3] == 5 and not b.loss_mask[0, 3]
    assert b.positions is not None and b.doc_ids is not None
    assert b.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 0, 0, 0]]
    assert b.doc_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1], [2, 2, 2, 2, -1, -1, -1]]
    assert b.inference_logprobs.tolist() == [
        [0.0, -1.0, -2.0, 0.0, -3.0, -4.0, -5.0],
        [0.0, 0.0, -6.0, 0.0, 0.0, 0.0, 0.0],
    ]
    assert b.advantages.tolist() == [[0.5] * 4 + [-1.0] * 3, [2.0] * 4 + [0.0] * 3]
    assert b.num_tokens == 6 and b.routing is None and b.packed
    assert [(p.row, p.start, p.length) for p in lay.placements] == [(0, 0, 4), (0, 4, 4), (1, 0, 4)]
    assert lay.padding_tokens == 4
    assert [t.tolist() for t in lay.per_rollout(b.input_ids[:, 1:])] == [[10, 11], [12, 13, 14], [15]]


def test_traces_are_placed_at_each_rollouts_positions():
    cfg = get_config("tiny-moe")
    rolls = _rollouts(cfg, n=6, seed=3)
    b, lay = collate_packed(rolls, cfg, row_len=20)
    assert b.routing is not None and b.routing.shape == (*b.loss_mask.shape, cfg.n_layers, cfg.top_k)
    covered = torch.zeros(b.loss_mask.shape, dtype=torch.bool)
    for r, p in zip(rolls, lay.placements, strict=True):
        assert r.routing is not None
        assert torch.equal(b.routing[p.row, p.start : p.start + p.length - 1], r.routing.long())
        covered[p.row, p.start : p.start + p.length - 1] = True
    # every other position (a rollout's last token, padding) routes to 0..top_k-1
    pad = b.routing[~covered]
    assert pad.numel() and torch.equal(pad, torch.arange(cfg.top_k).expand_as(pad))


def test_per_rollout_gives_the_padded_batchs_slices():
    cfg = get_config("tiny-moe")
    rolls = _rollouts(cfg, seed=1)
    padded = collate(rolls, cfg)
    packed, lay = collate_packed(rolls, cfg, row_len=24)
    for field in ("inference_logprobs", "loss_mask"):
        got = lay.per_rollout(getattr(packed, field))
        want = _padded_slices(getattr(padded, field), rolls)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), field
    targets = lay.per_rollout(packed.input_ids[:, 1:])
    assert [t.tolist() for t in targets] == [list(r.completion_ids) for r in rolls]
    # with the mask: the masked tokens only, as LocalTrainEngine.logprobs takes lp[i][loss_mask[i]]
    got = lay.per_rollout(packed.inference_logprobs, packed.loss_mask)
    want = [padded.inference_logprobs[i][padded.loss_mask[i]] for i in range(len(rolls))]
    assert any(len(a) < r.inference_logprobs.numel() for a, r in zip(got, rolls, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # trailing dims (token stats [B, L-1, 2]) come along
    stats = torch.stack([packed.inference_logprobs, packed.loss_mask.float()], -1)
    assert lay.per_rollout(stats)[0].shape == (len(rolls[0].completion_ids), 2)


@pytest.mark.parametrize("row_len", [0, 24])
def test_completions_join_the_per_rollout_slices_in_order(row_len):
    cfg = get_config("tiny-moe")
    rolls = _rollouts(cfg, seed=2)
    batch, lay = collate_for(rolls, cfg, row_len)
    stats = torch.stack([batch.inference_logprobs, torch.rand(batch.inference_logprobs.shape)], -1)
    for values in (batch.inference_logprobs, stats):
        assert torch.equal(lay.completions(values), torch.cat(lay.per_rollout(values)))
    with pytest.raises(ValueError, match="do not match"):
        lay.completions(stats[:, 1:])


@pytest.mark.parametrize(("name", "replay"), [("tiny-dense", False), ("tiny-moe", True), ("tiny-moe", False)])
def test_packed_logprobs_match_padded(name, replay):
    cfg = get_config(name)
    model = build_model(cfg, seed=0)
    rolls = _rollouts(cfg, seed=0, traces=replay)
    packed, lay = collate_packed(rolls, cfg, row_len=24)
    assert packed.input_ids.shape[0] < len(rolls)  # rows really hold several rollouts
    with torch.no_grad():
        lp_pad, ent_pad = compute_logprobs(model, collate(rolls, cfg), replay=replay, with_entropy=True)
        lp_pack, ent_pack = compute_logprobs(model, packed, replay=replay, with_entropy=True)
    assert ent_pad is not None and ent_pack is not None
    for a, b in zip(lay.per_rollout(lp_pack), _padded_slices(lp_pad, rolls), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGPROB_ATOL)
    for a, b in zip(lay.per_rollout(ent_pack), _padded_slices(ent_pad, rolls), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGPROB_ATOL)


def test_mask_and_positions_reach_the_model():
    """The comparison above can fail: without the document mask every rollout not first in its
    row gets other logprobs. RoPE is relative, so within a masked document shifted positions
    change nothing but round-off; positions are checked by what RoPE receives instead (and
    zeroed ones, which break the relative offsets, change the result)."""
    cfg = get_config("tiny-dense")
    model = build_model(cfg, seed=0)
    rolls = _rollouts(cfg, seed=0)
    packed, lay = collate_packed(rolls, cfg, row_len=24)
    assert packed.positions is not None and packed.doc_ids is not None
    inputs, targets = packed.input_ids[:, :-1], packed.input_ids[:, 1:]
    seen = []
    rope = model.layers["0"].attention.rope
    handle = rope.register_forward_pre_hook(lambda _m, args: seen.append(args[2]))
    try:
        with torch.no_grad():
            lp_pad, _ = compute_logprobs(model, collate(rolls, cfg))
            assert seen == [None]  # unpacked: no positions, as before
            compute_logprobs(model, packed)
    finally:
        handle.remove()
    assert len(seen) == 2 and torch.equal(seen[1], packed.positions)
    with torch.no_grad():
        variants = {
            "no mask": model(inputs, packed.positions),
            "zero positions": model(
                inputs, torch.zeros_like(packed.positions), attention_masks=PackedMask(packed.doc_ids)
            ),
        }
    later = [p.start > 0 for p in lay.placements]
    assert any(later)
    want = _padded_slices(lp_pad, rolls)
    for what, logits in variants.items():
        lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        err = [float((a - b).abs().max()) for a, b in zip(lay.per_rollout(lp), want, strict=True)]
        bad = err if what == "zero positions" else [e for e, x in zip(err, later, strict=True) if x]
        assert min(bad) > 1e-3, (what, err)


def test_rollouts_in_a_row_do_not_see_each_other():
    cfg = get_config("tiny-dense")
    model = build_model(cfg, seed=0)
    a = Rollout([3, 4, 5], [6, 7], torch.zeros(2), 1.0)
    b = Rollout([8, 9], [10, 11, 12], torch.zeros(3), 1.0)
    a2 = Rollout([30, 40, 50], [60, 7], torch.zeros(2), 1.0)
    outs = []
    for first in (a, a2):
        batch, lay = collate_packed([first, b], cfg, row_len=16)
        assert lay.num_rows == 1
        with torch.no_grad():
            lp, _ = compute_logprobs(model, batch)
        outs.append(lay.per_rollout(lp))
    assert float((outs[0][0] - outs[1][0]).abs().max()) > 1e-3  # the changed rollout changed
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=1e-6)  # its row-mate did not


def test_boundary_positions_get_no_gradient():
    """Only completion positions P-1 .. P-1+C-1 of each rollout carry loss: in particular the
    position of a rollout's last token, which predicts the next rollout's first token."""
    cfg = get_config("tiny-dense")
    model = build_model(cfg, seed=0)
    rolls = _rollouts(cfg, seed=2)
    packed, lay = collate_packed(rolls, cfg, row_len=24)
    lp, _ = compute_logprobs(model, packed)
    loss, _ = rl_loss(lp, packed.inference_logprobs, packed.advantages, packed.loss_mask, LossConfig())
    (grad,) = torch.autograd.grad(loss, lp)
    allowed = torch.zeros_like(packed.loss_mask)
    for p in lay.placements:
        allowed[p.row, p.completion_pos : p.completion_pos + p.completion_len] = True
        end = p.start + p.length - 1
        if end < packed.loss_mask.shape[1]:
            assert not packed.loss_mask[p.row, end] and grad[p.row, end] == 0
    assert bool((grad != 0).any())
    assert not bool(grad[~allowed].any()) and not bool(packed.loss_mask[~allowed].any())


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_train_step_packed_matches_padded(name):
    cfg = get_config(name)
    rolls = _rollouts(cfg, seed=4)
    results = {}
    for kind in ("padded", "packed"):
        set_deterministic(0)
        model = build_model(cfg, seed=0)
        opt = make_optimizer(model, lr=1e-3)
        batch = collate(rolls, cfg) if kind == "padded" else collate_packed(rolls, cfg, row_len=24)[0]
        before = [p.detach().clone() for p in model.parameters()]
        m = train_step(
            model, opt, batch, LossConfig(entropy_coef=1e-2), replay=cfg.is_moe, max_grad_norm=None
        )
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        delta = torch.cat(
            [(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)]
        )
        results[kind] = (m, grads, delta)
    (m1, g1, d1), (m2, g2, d2) = results["padded"], results["packed"]
    for key in (
        "loss",
        "pg_loss",
        "kl",
        "entropy",
        "mismatch_kl",
        "mismatch_kl_max",
        "ratio_max",
        "grad_norm",
    ):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    assert m1["num_tokens"] == m2["num_tokens"]
    assert float(g1.abs().max()) > 0
    torch.testing.assert_close(g2, g1, rtol=0, atol=1e-5 * float(g1.abs().max()))
    # Adam's first step is ~lr * sign(grad): a gradient entry within round-off of 0 may move by a
    # fraction of lr; every other weight moves the same.
    assert float(d1.abs().max()) > 5e-4
    torch.testing.assert_close(d2, d1, rtol=0, atol=0.05 * 1e-3)


def test_packed_micro_batches_combine():
    cfg = get_config("tiny-dense")
    rolls = _rollouts(cfg, seed=5)
    metrics = []
    for parts in ([rolls], [rolls[:4], rolls[4:]]):
        model = build_model(cfg, seed=0)
        batches = [collate_packed(p, cfg, row_len=20)[0] for p in parts]
        metrics.append(train_step(model, make_optimizer(model), batches, replay=False))
    for key in ("loss", "mismatch_kl_max", "ratio_min", "num_tokens"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5), key


def test_packing_is_deterministic_and_never_splits_a_rollout():
    cfg = get_config("tiny-moe")
    long = Rollout(list(range(1, 21)), [5, 6, 7], torch.zeros(3), 1.0)
    rolls = [*_rollouts(cfg, n=12, seed=6, traces=False), long]
    row_len = 16
    (b1, l1), (b2, l2) = collate_packed(rolls, cfg, row_len), collate_packed(rolls, cfg, row_len)
    assert l1 == l2
    for f in ("input_ids", "loss_mask", "inference_logprobs", "advantages", "positions", "doc_ids"):
        assert torch.equal(getattr(b1, f), getattr(b2, f)), f
    seen = sorted(k for row in l1.rows for k in row)
    assert seen == list(range(len(rolls)))
    for k, (r, p) in enumerate(zip(rolls, l1.placements, strict=True)):
        assert b1.input_ids[p.row, p.start : p.start + p.length].tolist() == [
            *r.prompt_ids,
            *r.completion_ids,
        ]
        assert k in l1.rows[p.row]
    for r, members in enumerate(l1.rows):
        fill = sum(l1.placements[k].length for k in members)
        assert fill <= row_len or len(members) == 1, r
        starts = [l1.placements[k].start for k in members]
        assert starts == sorted(starts) and starts[0] == 0
    assert l1.rows[l1.placements[len(rolls) - 1].row] == (len(rolls) - 1,)  # the long one alone
    assert l1.width == _length(long) and any(len(m) > 1 for m in l1.rows)


def _length(r):
    return len(r.prompt_ids) + len(r.completion_ids)


def test_packing_cuts_padding():
    cfg = get_config("tiny-dense")
    rolls = _rollouts(cfg, n=16, seed=7)
    real = sum(_length(r) for r in rolls)
    padded = collate(rolls, cfg)
    packed, lay = collate_packed(rolls, cfg, row_len=padded.input_ids.shape[1])
    pad_padded = padded.input_ids.numel() - real
    pad_packed = packed.input_ids.numel() - real
    assert pad_packed == lay.padding_tokens
    assert pad_packed < pad_padded / 2, (pad_packed, pad_padded)


def test_rejects_bad_input(cfg):
    rolls = _rollouts(cfg, n=3, seed=8, traces=False)
    for bad in (1, 0, -4):
        with pytest.raises(ValueError, match="row_len must be >= 2"):
            collate_packed(rolls, cfg, bad)
    for wrong in (2.5, True, "8"):
        with pytest.raises(ValueError, match="row_len must be an int"):
            collate_packed(rolls, cfg, wrong)  # type: ignore[arg-type]  # on purpose
    with pytest.raises(ValueError, match="no rollouts"):
        collate_packed([], cfg, 8)
    with pytest.raises(ValueError, match="inference_logprobs"):
        collate_packed([Rollout([1], [2, 3], torch.zeros(3), 0.0)], cfg, 8)
    with pytest.raises(ValueError, match="needs >= 1 prompt"):
        collate_packed([Rollout([], [2, 3], torch.zeros(2), 0.0)], cfg, 8)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 64\)"):
        collate_packed([Rollout([1], [64], torch.zeros(1), 0.0)], cfg, 8)
    with pytest.raises(ValueError, match="beyond tiny-moe's max_seq_len 256"):
        collate_packed([Rollout([1] * 300, [2, 3], torch.zeros(2), 0.0), *rolls], cfg, 8)
    with pytest.raises(ValueError, match="length 1 must be a positive int"):
        pack_rows([3, 0], 8)
    _, lay = collate_packed(rolls, cfg, 16)
    with pytest.raises(ValueError, match="do not match the packed layout"):
        lay.per_rollout(torch.zeros(lay.num_rows, lay.width))
    with pytest.raises(ValueError, match="mask"):
        lay.per_rollout(torch.zeros(lay.num_rows, lay.width - 1), torch.zeros(1, 1, dtype=torch.bool))
    assert isinstance(lay, PackedLayout)


def test_packed_mask_and_sdpa_checks():
    with pytest.raises(ValueError, match="integer"):
        PackedMask(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="integer"):
        PackedMask(torch.zeros(3, dtype=torch.long))
    m = PackedMask(torch.tensor([[0, 0, 1, -1]]))
    # causal and same-document; padding (-1) sees itself only here
    assert m.mask[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    sdpa = CachedSDPA(CachedSDPA.Config())
    q = torch.zeros(1, 5, 2, 4)
    with pytest.raises(ValueError, match="PackedMask covers"):
        sdpa(q, q, q, attention_masks=m)
    with pytest.raises(TypeError, match="PackedMask"):
        sdpa(q, q, q, attention_masks=object())


def test_per_token_advantages_and_segments_in_the_loss():
    g = torch.Generator().manual_seed(0)
    lp, ilp = -torch.rand(2, 6, generator=g), -torch.rand(2, 6, generator=g)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    adv_rows = torch.tensor([0.7, -0.3])
    l_rows, m_rows = rl_loss(lp, ilp, adv_rows, mask)
    l_tok, m_tok = rl_loss(lp, ilp, adv_rows[:, None].expand(2, 6).clone(), mask)
    assert l_rows.item() == l_tok.item() and m_rows == m_tok
    # one row holding two rollouts: per-token advantages and a segment per rollout
    seg = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 2, 2, -1, -1]])
    adv = torch.tensor([[1.0, 1.0, 1.0, -2.0, -2.0, -2.0], [0.5] * 4 + [0.0] * 2])
    lr = (lp - ilp).double()
    k3 = lr.exp() - 1 - lr
    per_rollout = [float(k3[0, 1:3].mean()), float(k3[0, 4:6].mean()), float(k3[1, :4].mean())]
    s = mismatch_stats(lp, ilp, mask, segments=seg)
    assert s["mismatch_kl_max"] == pytest.approx(max(per_rollout), rel=1e-12)
    assert mismatch_stats(lp, ilp, mask)["mismatch_kl_max"] != pytest.approx(max(per_rollout), rel=1e-6)
    loss, m = rl_loss(lp, ilp, adv, mask, LossConfig(kl_coef=0.0), segments=seg)
    r = lr.exp().float()
    want = -(r[0, 1:3].sum() * 1.0 + r[0, 4:6].sum() * -2.0 + r[1, :4].sum() * 0.5) / 8
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert m["mismatch_kl_max"] == s["mismatch_kl_max"]
    with pytest.raises(ValueError, match="segments"):
        mismatch_stats(lp, ilp, mask, segments=seg[:, :3])


def test_a_packed_batch_needs_positions_and_doc_ids(cfg):
    model = build_model(cfg, seed=0)
    packed, _ = collate_packed(_rollouts(cfg, n=3, seed=9, traces=False), cfg, 16)
    packed.doc_ids = None
    with pytest.raises(ValueError, match="both positions and doc_ids"):
        compute_logprobs(model, packed, replay=False)


def test_unpacked_forward_is_the_plain_model_call(cfg):
    """An unpacked batch still calls the model with the tokens alone: bit-identical."""
    model = build_model(cfg, seed=0)
    rolls = _rollouts(cfg, n=4, seed=10)
    batch = collate(rolls, cfg)
    assert not batch.packed
    with torch.no_grad():
        lp, _ = compute_logprobs(model, batch)
        assert batch.routing is not None
        with replay_routing(model, batch.routing):
            logits = model(batch.input_ids[:, :-1])
    want = torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    assert torch.equal(lp, want)


@pytest.mark.slow  # flex attention compiles its kernel
def test_flex_attention_takes_its_document_mask_from_the_positions():
    """torchtitan's flex attention (the GPU configs) builds its packed-document mask from
    ``positions`` (a document starts at position 0): forward only, flex has no CPU backward."""
    cfg = get_config("tiny-dense")
    sdpa, flex = build_model(cfg, seed=0), build_model(cfg.replace(attention="flex"), seed=0)
    flex.load_state_dict(sdpa.state_dict())
    rolls = _rollouts(cfg, seed=0)
    packed, lay = collate_packed(rolls, cfg, row_len=24)
    with torch.no_grad():
        lp_pad, _ = compute_logprobs(sdpa, collate(rolls, cfg))
        lp_flex, _ = compute_logprobs(flex, packed)
    for a, b in zip(lay.per_rollout(lp_flex), _padded_slices(lp_pad, rolls), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGPROB_ATOL)
