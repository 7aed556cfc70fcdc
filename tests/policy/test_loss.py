import math

import pytest
import torch

from jetrl.policy.loss import LossConfig, group_advantages, mismatch_stats, rl_loss


def test_group_advantages_2d_and_ragged():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    torch.testing.assert_close(group_advantages(r), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4]))
    scaled = group_advantages(r, std_scale=True)
    torch.testing.assert_close(scaled[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    assert torch.equal(scaled[1], torch.zeros(4))
    flat = torch.tensor([3.0, 1.0, 10.0, 2.0, 7.0])
    ids = torch.tensor([5, 5, 9, 5, 2])
    torch.testing.assert_close(group_advantages(flat, ids), torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError):
        group_advantages(flat)


def _hand_loss(lp, ilp, adv, keep, n, kl_coef):
    total = 0.0
    for a, b, c, k in zip(lp, ilp, adv, keep, strict=True):
        if k:
            r = math.exp(a - b)
            d = b - a
            total += -r * c + kl_coef * (math.exp(d) - d - 1)
    return total / n


def test_loss_matches_hand_computation():
    lp = torch.tensor([[-1.0, -0.5, -2.0, 0.0]], requires_grad=True)
    ilp = torch.tensor([[-1.2, -0.5, -1.0, 0.0]])
    adv = torch.tensor([2.0])
    mask = torch.tensor([[True, True, True, False]])
    cfg = LossConfig(kl_coef=0.1)
    loss, m = rl_loss(lp, ilp, adv, mask, cfg)
    expected = _hand_loss([-1.0, -0.5, -2.0], [-1.2, -0.5, -1.0], [2.0] * 3, [True] * 3, 3, 0.1)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert lp.grad is not None
    # d/d lp of (-r*A + c*k3) = -r*A + c*(1 - exp(ilp - lp)), divided by the token count
    r0 = math.exp(0.2)
    assert lp.grad[0, 0].item() == pytest.approx((-r0 * 2 + 0.1 * (1 - math.exp(-0.2))) / 3, rel=1e-5)
    assert lp.grad[0, 3].item() == 0.0
    assert m["masked_frac"] == 0.0 and m["num_tokens"] == 3
    ratios = [math.exp(0.2), 1.0, math.exp(-1.0)]
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / 3)
    assert m["ratio_min"] == pytest.approx(math.exp(-1.0)) and m["ratio_max"] == pytest.approx(math.exp(0.2))
    assert m["mismatch_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 3)


def test_masking_at_the_bounds_depends_on_advantage_sign():
    cfg = LossConfig(ratio_bounds_pos=(0.5, 2.0), ratio_bounds_neg=(0.8, 1.25), kl_coef=0.0)
    ilp = torch.zeros(2, 4, dtype=torch.float64)
    # ratios exactly at and just beyond each bound
    r = torch.tensor(
        [[0.5, 2.0, 0.5 * 0.999, 2.0 * 1.001], [0.8, 1.25, 0.8 * 0.999, 1.25 * 1.001]], dtype=torch.float64
    )
    lp = r.log().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    loss, m = rl_loss(lp, ilp, adv, mask, cfg)
    assert m["masked_frac"] == 0.5
    loss.backward()
    assert lp.grad is not None
    kept = lp.grad != 0
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False]]
    # The same ratios under a positive advantage are all inside (0.5, 2.0)
    _, m2 = rl_loss(lp.detach(), ilp, torch.ones(2, dtype=torch.float64), mask, cfg)
    assert m2["masked_frac"] == pytest.approx(2 / 8)
    # Masked tokens still count in the normaliser.
    assert loss.item() == pytest.approx((-(0.5 + 2.0) * 1 + (0.8 + 1.25)) / 8)


def test_extreme_and_padded_tokens_give_finite_gradients():
    lp = torch.tensor([[-1.0, -80.0, 0.0]], requires_grad=True)
    ilp = torch.tensor([[-1.0, -1.0, float("-inf")]])
    mask = torch.tensor([[True, True, False]])
    loss, m = rl_loss(lp, ilp, torch.tensor([1.0]), mask, LossConfig(kl_coef=1.0))
    loss.backward()
    assert lp.grad is not None
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert m["masked_frac"] == 0.5


def test_kl_term_zero_at_match_and_positive_otherwise():
    ilp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    zero_adv = torch.zeros(1)
    _, m = rl_loss(ilp.clone(), ilp, zero_adv, mask, LossConfig(kl_coef=1.0))
    assert m["kl"] == 0.0 and m["mismatch_kl"] == 0.0 and m["loss"] == 0.0
    loss, m = rl_loss(ilp + 0.1, ilp, zero_adv, mask, LossConfig(kl_coef=1.0))
    assert m["kl"] == pytest.approx(math.exp(-0.1) + 0.1 - 1, rel=1e-5) and loss.item() > 0
    ref = torch.tensor([[-1.0, -1.5]])
    _, m = rl_loss(ilp, ilp, zero_adv, mask, LossConfig(kl_coef=1.0), ref_logprobs=ref)
    assert m["kl"] == pytest.approx((math.exp(0.5) - 0.5 - 1) / 2, rel=1e-5)


def test_num_tokens_override_and_entropy_metric():
    lp = torch.tensor([[-1.0, -1.0]])
    mask = torch.tensor([[True, True]])
    loss_a, _ = rl_loss(lp, lp, torch.tensor([1.0]), mask, LossConfig(kl_coef=0.0))
    loss_b, m = rl_loss(
        lp,
        lp,
        torch.tensor([1.0]),
        mask,
        LossConfig(kl_coef=0.0),
        num_tokens=4,
        entropy=torch.tensor([[0.5, 1.5]]),
    )
    assert loss_a.item() == -1.0 and loss_b.item() == -0.5 and m["entropy"] == 1.0


def test_mismatch_kl_max_is_the_largest_rollouts_mean():
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.9]]))
    ilp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.6, 0.1]]))
    mask = torch.tensor([[True, True, False], [True, True, False]])  # the 0.9/0.1 token is masked
    s = mismatch_stats(lp, ilp, mask)
    lr = (lp - ilp)[1, :2].double()
    assert s["mismatch_kl_max"] == pytest.approx(float((lr.exp() - 1 - lr).mean()))
    assert s["mismatch_kl_max"] >= s["mismatch_kl"] > 0
    empty = mismatch_stats(lp, ilp, torch.zeros(2, 3, dtype=torch.bool))
    assert empty["mismatch_kl_max"] == 0.0


def test_gap_metric_and_shape_errors():
    lp = torch.log(torch.tensor([[0.5, 0.5]]))
    ilp = torch.log(torch.tensor([[0.5, 0.3]]))
    s = mismatch_stats(lp, ilp, torch.ones(1, 2, dtype=torch.bool), gap_threshold=0.1)
    assert s["gap_frac"] == 0.5
    with pytest.raises(ValueError, match="same shape"):
        rl_loss(lp, ilp[:, :1], torch.ones(1), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError):
        LossConfig(ratio_bounds_pos=(1.5, 2.0))


def test_clipped_sets_the_clip_the_clip_higher_and_the_dual_clip():
    low, high = 0.125, 8.0  # the mismatch mask's bounds
    plain = LossConfig.clipped(0.2)
    assert (plain.ratio_bounds_pos, plain.ratio_bounds_neg) == ((low, 1.2), (0.8, high))
    both = LossConfig.clipped(0.2, eps_high=0.28, dual_clip=3.0)
    assert (both.ratio_bounds_pos, both.ratio_bounds_neg) == ((low, 1.28), (0.8, 3.0))
    # Without the clip only the mismatch mask stays, and the dual clip still bounds A < 0.
    off = LossConfig.clipped(0.0, dual_clip=3.0)
    assert (off.ratio_bounds_pos, off.ratio_bounds_neg) == ((low, high), (low, 3.0))
    for bad in ({"dual_clip": 0.9}, {"dual_clip": 9.0}, {"eps_high": -0.1}):
        with pytest.raises(ValueError):
            LossConfig.clipped(0.2, **bad)
    with pytest.raises(ValueError):  # an upper side of no clip
        LossConfig.clipped(0.0, eps_high=0.28)


def test_the_dual_clip_stops_a_stale_negative_token_the_policy_made_likelier():
    # Ratios of 2 and 5 on tokens with a negative advantage: PPO pushes both down with weight r;
    # the dual clip at 3 keeps the first and drops the second.
    ilp = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    grads = {}
    for dual in (8.0, 3.0):
        lp = torch.tensor([[2.0, 5.0]], dtype=torch.float64).log().requires_grad_(True)
        loss, m = rl_loss(lp, ilp, adv, mask, LossConfig.clipped(0.2, dual_clip=dual, kl_coef=0.0))
        loss.backward()
        assert lp.grad is not None
        grads[dual] = lp.grad[0].tolist()
        assert m["masked_frac"] == (0.5 if dual == 3.0 else 0.0)
    # d(-r * A)/d lp = -r * A, over the two loss tokens.
    assert grads[8.0] == pytest.approx([2.0 / 2, 5.0 / 2])
    assert grads[3.0] == pytest.approx([2.0 / 2, 0.0])


def test_the_trainers_settings_make_its_loss():
    from pydantic import ValidationError

    from jetrl.consumers.trainer.settings import TrainerSettings

    default = TrainerSettings().loss_config()  # PPO's clip at 0.2, no dual clip below the mask's 8
    assert (default.ratio_bounds_pos, default.ratio_bounds_neg) == ((0.125, 1.2), (0.8, 8.0))
    tuned = TrainerSettings(ratio_clip_high=0.28, dual_clip=3.0, kl_coef=0.0).loss_config()
    assert (tuned.ratio_bounds_pos, tuned.ratio_bounds_neg, tuned.kl_coef) == ((0.125, 1.28), (0.8, 3.0), 0.0)
    for bad in (
        {"dual_clip": 9.0},
        {"dual_clip": 0.5},
        {"ratio_clip_high": -0.1},
        {"ratio_clip": 0.0, "ratio_clip_high": 0.28},
    ):
        with pytest.raises(ValidationError):
            TrainerSettings.model_validate(bad)
