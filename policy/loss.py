"""Group-relative advantages and the token-level RL loss. Pure functions on tensors.

Notation per token: ``lp`` trainer log-prob, ``lp_inf`` inference log-prob of the sampled token,
``r = exp(lp - lp_inf)`` the importance ratio (trainer over inference), ``A`` the advantage.

Loss (summed over kept tokens, divided by the number of loss tokens, masked ones included so
that masking never up-weights the rest)::

    per_token = -r * A + kl_coef * k3,    k3 = exp(lp_ref - lp) - (lp_ref - lp) - 1

The surrogate ``-r * A`` has gradient ``-r * A * grad(lp)``: the policy gradient corrected for
the trainer/inference mismatch. ``k3`` is Schulman's non-negative estimator of
KL(pi_train || pi_ref); the reference defaults to the inference policy, which makes it a small
pull towards what inference actually sampled from.

A token is kept only if ``low <= r <= high``, with ``(low, high)`` chosen by the sign of its
advantage: a token whose probability differs too much between the two engines gives an
unreliable correction and is dropped rather than clipped. :meth:`LossConfig.clipped` sets them
as PPO's clip does against the policy that sampled the rollout (``[0.125, 1 + eps]`` for
``A >= 0``, ``[1 - eps, 8]`` for ``A < 0``): the gradient of ``-min(r * A, clip(r) * A)``,
whose clipped side is constant. A rollout sampled a version or more ago then stops pushing a
token its own policy already moved past the bound, which is what keeps asynchronous training
as sample-efficient as on-policy training (docs/policy.md, "Off-policy steps"). ``dual_clip``
lowers the ``A < 0`` side's 8 (dual-clip PPO, Ye et al. 2020: a stale sample with a negative
advantage whose token the policy has since made far likelier pushes with weight ``r``, unbounded
in PPO's objective); ``eps_high`` sets the clip's upper side apart (DAPO's clip-higher).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# A token whose train/inference probability ratio lies outside these is dropped whatever its
# advantage: the two engines disagree too much for the correction to be trusted.
MISMATCH_BOUNDS = (0.125, 8.0)


@dataclass(frozen=True, slots=True)
class LossConfig:
    ratio_bounds_pos: tuple[float, float] = MISMATCH_BOUNDS  # for A >= 0
    ratio_bounds_neg: tuple[float, float] = MISMATCH_BOUNDS  # for A < 0
    kl_coef: float = 1e-3
    # Entropy bonus: keeps a small policy learning from scratch from collapsing onto a wrong
    # answer (a group of identical samples has zero advantage and teaches nothing).
    entropy_coef: float = 0.0
    gap_threshold: float = 0.1  # |p_train - p_inf| above this counts as a large gap (metric only)

    def __post_init__(self) -> None:
        for name in ("ratio_bounds_pos", "ratio_bounds_neg"):
            low, high = getattr(self, name)
            if not 0 <= low <= 1 <= high:
                raise ValueError(f"{name} must satisfy 0 <= low <= 1 <= high, got {(low, high)}")
        if self.kl_coef < 0:
            raise ValueError("kl_coef must be >= 0")
        if self.entropy_coef < 0:
            raise ValueError("entropy_coef must be >= 0")

    @classmethod
    def clipped(
        cls,
        eps: float,
        *,
        eps_high: float | None = None,
        dual_clip: float = MISMATCH_BOUNDS[1],
        kl_coef: float = 1e-3,
        entropy_coef: float = 0.0,
    ) -> LossConfig:
        """PPO's clip of the ratio to ``[1 - eps, 1 + eps_high]`` (``eps_high`` None: ``eps``)
        against the behaviour policy, on the side its advantage pushes (``eps`` 0: off, only the
        mismatch mask), and dual-clip PPO's bound ``dual_clip`` on how far above 1 the ratio of
        a token with a negative advantage may be and still push (within the mismatch mask's 8)."""
        low, high = MISMATCH_BOUNDS
        if not 0 <= eps < 1:
            raise ValueError(f"the ratio clip must lie in [0, 1), got {eps}")
        if eps_high is not None and (eps_high < 0 or eps == 0):
            raise ValueError(f"the clip's upper side must be >= 0 beside a clip: {eps_high} with {eps}")
        if not 1 <= dual_clip <= high:
            raise ValueError(f"the dual clip must lie in [1, {high:g}], got {dual_clip}")
        if eps == 0:
            return cls(ratio_bounds_neg=(low, dual_clip), kl_coef=kl_coef, entropy_coef=entropy_coef)
        return cls(
            ratio_bounds_pos=(low, 1.0 + (eps if eps_high is None else eps_high)),
            ratio_bounds_neg=(1.0 - eps, dual_clip),
            kl_coef=kl_coef,
            entropy_coef=entropy_coef,
        )


DEFAULT_LOSS = LossConfig()


def _log(x: float) -> float:
    return math.log(x) if x > 0 else float("-inf")


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    std_scale: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``reward - mean(reward of its group)``, optionally divided by the group's std (population
    std, plus ``eps``). ``rewards`` is ``[groups, group_size]`` with ``group_ids=None``, or flat
    ``[N]`` with integer ``group_ids`` ``[N]`` (groups may differ in size, e.g. after stale
    rollouts were withheld). A group of one gets advantage 0."""
    r = rewards.double()
    if group_ids is None:
        if r.ndim != 2:
            raise ValueError("without group_ids, rewards must be [groups, group_size]")
        adv = r - r.mean(dim=1, keepdim=True)
        if std_scale:
            adv = adv / (r.std(dim=1, correction=0, keepdim=True) + eps)
        return adv.to(rewards.dtype if rewards.dtype.is_floating_point else torch.float32)
    if r.ndim != 1 or group_ids.shape != r.shape:
        raise ValueError(f"rewards {tuple(r.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]")
    _, inv = torch.unique(group_ids, return_inverse=True)
    n = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n, dtype=r.dtype).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(n, dtype=r.dtype).index_add_(0, inv, r) / count
    adv = r - mean[inv]
    if std_scale:
        var = torch.zeros(n, dtype=r.dtype).index_add_(0, inv, adv**2) / count
        adv = adv / (var.sqrt()[inv] + eps)
    return adv.to(rewards.dtype if rewards.dtype.is_floating_point else torch.float32)


def mismatch_stats(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    gap_threshold: float = 0.1,
    *,
    segments: torch.Tensor | None = None,
) -> dict[str, float]:
    """Train/inference mismatch over the ``mask`` tokens (no gradient).

    ``mismatch_kl`` is the k3 estimate of KL(pi_inf || pi_train) from tokens sampled by
    inference, ``mean((r - 1) - log r)``; ``mismatch_kl_max`` the largest such mean of one
    rollout: of one row, or with integer ``segments`` (same shape as ``mask``; a packed batch's
    ``doc_ids``, rows holding several rollouts) of the tokens sharing a segment id;
    ``gap_frac`` the share of tokens whose probabilities differ by more than ``gap_threshold``."""
    mask = mask.bool()
    n = int(mask.sum())
    if n == 0:
        return {
            "mismatch_kl": 0.0,
            "mismatch_kl_max": 0.0,
            "gap_frac": 0.0,
            "ratio_mean": 1.0,
            "ratio_std": 0.0,
            "ratio_min": 1.0,
            "ratio_max": 1.0,
            "num_tokens": 0.0,
        }
    full = logprobs.detach().double() - inference_logprobs.detach().double()
    lr = full[mask]
    ratio = lr.exp()
    gap = (logprobs.detach().double().exp() - inference_logprobs.detach().double().exp())[mask].abs()
    if segments is None:
        k3_rows = torch.where(mask, full.exp() - 1 - full, torch.zeros_like(full)).sum(-1)
        per_row = mask.sum(-1)
        kl_max = float((k3_rows[per_row > 0] / per_row[per_row > 0]).max())
    else:
        if segments.shape != mask.shape:
            raise ValueError(
                f"segments {tuple(segments.shape)} must have the mask's shape {tuple(mask.shape)}"
            )
        _, seg = torch.unique(segments.to(mask.device)[mask], return_inverse=True)
        n_seg = int(seg.max()) + 1
        k3_seg = torch.zeros(n_seg, dtype=lr.dtype, device=lr.device).index_add_(0, seg, ratio - 1 - lr)
        per_seg = torch.zeros(n_seg, dtype=lr.dtype, device=lr.device).index_add_(0, seg, torch.ones_like(lr))
        kl_max = float((k3_seg / per_seg).max())
    return {
        "mismatch_kl": float((ratio - 1 - lr).mean()),
        "mismatch_kl_max": kl_max,
        "gap_frac": float((gap > gap_threshold).double().mean()),
        "ratio_mean": float(ratio.mean()),
        "ratio_std": float(ratio.std(correction=0)),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "num_tokens": float(n),
    }


def rl_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig = DEFAULT_LOSS,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_tokens: int | float | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The RL loss on ``[B, T]`` token tensors; ``advantages`` is ``[B]`` (one rollout per row)
    or ``[B, T]`` (per token: a packed batch, rows holding several rollouts). Only its values on
    ``mask`` tokens matter: elsewhere the ratio is 1 and the token's term is dropped.

    ``mask`` marks loss tokens (completion tokens). ``num_tokens`` overrides the normaliser when
    a batch is split into micro-batches (pass the whole batch's loss-token count). ``segments``:
    which rollout each token belongs to, when rows hold several (see :func:`mismatch_stats`).
    Returns the scalar loss and float metrics."""
    if logprobs.shape != inference_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, inference_logprobs {tuple(inference_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have the same shape"
        )
    mask = mask.bool()
    adv = advantages.to(logprobs.dtype)
    if adv.ndim == 1:
        adv = adv[:, None].expand_as(logprobs)
    if adv.shape != logprobs.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} fit neither [B] nor {tuple(logprobs.shape)}")

    inf_lp = inference_logprobs.to(logprobs.dtype)
    with torch.no_grad():
        # Compared in log space: a ratio given exactly at a bound stays kept (no exp round-off).
        log_ratio_det = logprobs - inf_lp
        pos = adv >= 0
        bounds = torch.tensor(
            [[_log(b) for b in cfg.ratio_bounds_pos], [_log(b) for b in cfg.ratio_bounds_neg]],
            dtype=logprobs.dtype,
            device=logprobs.device,
        )
        low = torch.where(pos, bounds[0, 0], bounds[1, 0])
        high = torch.where(pos, bounds[0, 1], bounds[1, 1])
        keep = mask & (log_ratio_det >= low) & (log_ratio_det <= high)

    # Masked and padded tokens get a zero log-ratio before exp(): their values may be extreme
    # (or -inf), and where() alone would still send 0 * inf = NaN back through exp().
    log_ratio = torch.where(keep, logprobs - inf_lp, torch.zeros_like(logprobs))
    ratio = log_ratio.exp()
    pg = -ratio * adv
    ref = inf_lp if ref_logprobs is None else ref_logprobs.to(logprobs.dtype)
    d = torch.where(keep, ref - logprobs, torch.zeros_like(logprobs))
    k3 = d.exp() - d - 1

    denom = float(num_tokens) if num_tokens is not None else float(max(int(mask.sum()), 1))
    keep_f = keep.to(logprobs.dtype)
    pg_loss = (pg * keep_f).sum() / denom
    kl_loss = (k3 * keep_f).sum() / denom
    loss = pg_loss + cfg.kl_coef * kl_loss
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        loss = loss - cfg.entropy_coef * (entropy.to(logprobs.dtype) * keep_f).sum() / denom

    n_mask = int(mask.sum())
    metrics = mismatch_stats(logprobs, inference_logprobs, mask, cfg.gap_threshold, segments=segments)
    metrics.update(
        loss=float(loss.detach()),
        pg_loss=float(pg_loss.detach()),
        kl=float(kl_loss.detach()),
        masked_frac=float((mask & ~keep).sum()) / n_mask if n_mask else 0.0,
    )
    if entropy is not None:
        metrics["entropy"] = float(entropy.detach()[mask].double().mean()) if n_mask else 0.0
    return loss, metrics
