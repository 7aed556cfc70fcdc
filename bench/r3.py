"""Router Replay benchmark: how much of the train/inference mismatch does R3 remove?

A tiny Qwen3-MoE (torchtitan model code) learns to reverse short strings: a short supervised
warm-up, then RL steps through ``jetrl.policy.train.train_step`` so the routers are well away
from their initialisation. Then inference samples in bf16 (its own copy of the weights) and the
trainer recomputes the same tokens' log-probs in fp32, without and with replaying the routing
inference recorded. Printed: mean mismatch KL (k3 estimate of KL(pi_inf || pi_train) per token),
the share of tokens whose probability differs by more than 0.02, the share of (token, layer) router
decisions that differ between the engines, and the headline cuts: on every completion token, and on
the routing-changed ones alone, where the trainer's own forward (no replay) picks, in some MoE
layer, another top-k expert set than inference recorded (captured in that same forward).

    python bench/r3.py            # ~3 minutes on 2 (shared) CPU cores
    python bench/r3.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch import nn

from jetrl.policy.loss import LossConfig, group_advantages, mismatch_stats
from jetrl.policy.models import build_model, get_config
from jetrl.policy.routing import capture_routing
from jetrl.policy.sampling import PRECISIONS, Generation, Precision, SamplingConfig, generate, inference_copy
from jetrl.policy.tokenizer import CharTokenizer
from jetrl.policy.train import (
    Rollout,
    TrainBatch,
    collate,
    compute_logprobs,
    make_optimizer,
    set_deterministic,
    train_step,
)

LETTERS = "abcdefgh"


def make_prompt(tok: CharTokenizer, rng: random.Random) -> tuple[list[int], str]:
    s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
    return tok.encode(s + "|"), s[::-1]


def reward(tok: CharTokenizer, completion: list[int], target: str) -> float:
    text = tok.decode(completion)
    hits = sum(a == b for a, b in zip(text, target, strict=False))
    return hits / max(len(target), len(text), 1)


def sft_warmup(model: nn.Module, tok: CharTokenizer, rng: random.Random, steps: int, batch: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            p, target = make_prompt(tok, rng)
            rows.append((p, tok.encode(target, bos=False, eos=True)))
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width - 1, dtype=torch.bool)
        for i, (p, c) in enumerate(rows):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            mask[i, len(p) - 1 : len(p) + len(c) - 1] = True
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits[mask], ids[:, 1:][mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def rollouts(
    model: nn.Module,
    tok: CharTokenizer,
    rng: random.Random,
    gen: torch.Generator,
    n_prompts: int,
    group: int,
    max_tokens: int,
    precision: Precision = "bf16",
) -> tuple[list[Generation], torch.Tensor, nn.Module]:
    inf = inference_copy(model, precision)
    prompts, targets = [], []
    for _ in range(n_prompts):
        p, t = make_prompt(tok, rng)
        prompts += [p] * group
        targets += [t] * group
    gens = generate(
        inf, prompts, SamplingConfig(max_tokens=max_tokens, stop_token_ids=(tok.eos_id,)), generator=gen
    )
    rewards = torch.tensor([reward(tok, g.completion_ids, t) for g, t in zip(gens, targets, strict=True)])
    return gens, rewards, inf


# Fewer routing-changed tokens than this and the KL on them is not reported: a handful of
# tokens make no mean.
MIN_CHANGED_TOKENS = 20


def fed_positions(batch: TrainBatch) -> torch.Tensor:
    """``[B, L-1]``: every position fed forward (prompt + completion - 1 rows per sequence)."""
    valid = torch.zeros(batch.loss_mask.shape, dtype=torch.bool)
    for i in range(valid.shape[0]):
        last = batch.loss_mask[i].nonzero()
        if last.numel():
            valid[i, : int(last.max()) + 1] = True
    return valid


def routing_differs(own: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """``[B, L, moe_layers]``: whether the trainer's own top-k set (``own``, ``[B, L, layers, k]``)
    differs from the recorded one, whatever the order the router listed the experts in."""
    return (own.long().sort(-1).values != recorded.long().sort(-1).values).any(-1)


def top_share(logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor) -> float | None:
    """Share of the mismatch-KL sum over ``mask`` carried by its largest 1% of tokens (at least
    one); None without tokens or without any mismatch."""
    lr = (logprobs.double() - inference_logprobs.double())[mask.bool()]
    k3 = (lr.exp() - 1 - lr).sort(descending=True).values
    total = float(k3.sum())
    if k3.numel() == 0 or total <= 0:
        return None
    return float(k3[: max(1, k3.numel() // 100)].sum()) / total


def kl_cut(plain: dict[str, float], replay: dict[str, float], what: str, min_tokens: int) -> str:
    """The headline cut line for one set of tokens, or why it cannot be measured."""
    n = int(plain["num_tokens"])
    head = f"mismatch-KL cut{what}"
    if n < min_tokens:
        return f"{head}: too few tokens to measure ({n}; {min_tokens} needed) (target >= 10x)"
    if replay["mismatch_kl"] <= 0:
        return f"{head}: replay leaves no mismatch on these {n} tokens (KL 0; target >= 10x)"
    return f"{head} {plain['mismatch_kl'] / replay['mismatch_kl']:.1f}x (target >= 10x)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny-moe-4l")
    # More, smaller experts than tiny-moe-4l: near-ties between the k-th and (k+1)-th expert, the
    # cause of routing flips, are as common as in the published 128-expert top-8 models.
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-hidden", type=int, default=32)
    ap.add_argument("--gap", type=float, default=0.02, help="|p_train - p_inf| counted as a large gap")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--rl-steps", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=1024)
    ap.add_argument(
        "--inference-precision",
        default="bf16",
        choices=sorted(PRECISIONS),
        help="of the measured samples (the RL steps sample in bf16); fp32 is the control: no mismatch",
    )
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.sft_steps, args.rl_steps, args.eval_prompts = 20, 1, 128
    if args.eval_prompts < 1:
        ap.error("--eval-prompts must be at least 1")

    t0 = time.perf_counter()
    set_deterministic(args.seed)
    tok = CharTokenizer()
    cfg = get_config(
        args.config, num_experts=args.experts, top_k=args.top_k, moe_hidden_dim=args.expert_hidden
    )
    model = build_model(cfg, seed=args.seed)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    sft_loss = sft_warmup(model, tok, rng, args.sft_steps, batch=64)
    print(
        f"model {cfg.name}: {cfg.n_layers} layers, {cfg.num_experts} experts top-{cfg.top_k}, dim {cfg.dim}"
    )
    print(f"sft warm-up: {args.sft_steps} steps, final CE {sft_loss:.3f}")

    opt = make_optimizer(model, lr=1e-3)
    loss_cfg = LossConfig()
    for step in range(args.rl_steps):
        gens, rewards, _ = rollouts(model, tok, rng, gen, n_prompts=32, group=4, max_tokens=10)
        adv = group_advantages(rewards.view(-1, 4)).view(-1)
        batch = collate(
            [
                Rollout(g.prompt_ids, g.completion_ids, g.logprobs, float(a), g.routing)
                for g, a in zip(gens, adv, strict=True)
            ],
            cfg,
        )
        m = train_step(model, opt, batch, loss_cfg, replay=True)
        print(
            f"rl step {step}: reward {float(rewards.mean()):.3f}  mismatch-KL {m['mismatch_kl']:.2e}  "
            f"masked {m['masked_frac']:.3f}  entropy {m['entropy']:.3f}"
        )

    # Measurement: inference samples (bf16 by default), the fp32 trainer recomputes, with and
    # without replay. The unreplayed forward records the trainer's own routing, to find the tokens
    # it routes otherwise.
    model.eval()
    gens, rewards, _ = rollouts(
        model, tok, rng, gen, args.eval_prompts, group=1, max_tokens=10, precision=args.inference_precision
    )
    batch = collate([Rollout(g.prompt_ids, g.completion_ids, g.logprobs, 0.0, g.routing) for g in gens], cfg)
    assert batch.routing is not None  # an MoE model's rollouts carry their traces
    with torch.no_grad():
        with capture_routing(model) as cap:
            lp_plain, _ = compute_logprobs(model, batch, replay=False)
            own = cap.take()
        lp_replay, _ = compute_logprobs(model, batch, replay=True)
    differs = routing_differs(own, batch.routing)  # [B, L-1, layers]
    fed = fed_positions(batch)
    decisions = float(differs[fed].float().mean()) if bool(fed.any()) else 0.0
    # Completion token j is predicted at position P - 1 + j: a token is routing-changed when that
    # position was routed otherwise in any MoE layer.
    completion = batch.loss_mask.bool()
    at = differs.any(-1)  # [B, L-1]: routed otherwise in some layer at this position
    changed = completion & at
    # Routed alike here and at every earlier position: nothing routed otherwise reaches the token
    # through attention either, so replay changes nothing there (the precision floor).
    clean = completion & ~(at & fed).cumsum(-1).bool()
    sets = {"all": completion, "changed": changed, "same": completion & ~changed, "clean": clean}
    arms = (("no replay", lp_plain), ("router replay", lp_replay))
    stats = {
        name: {arm: mismatch_stats(lp, batch.inference_logprobs, mask, args.gap) for arm, lp in arms}
        for name, mask in sets.items()
    }
    tops = {
        name: {arm: top_share(lp, batch.inference_logprobs, mask) for arm, lp in arms}
        for name, mask in sets.items()
    }
    n_all, n_changed = int(completion.sum()), int(changed.sum())
    share = n_changed / n_all if n_all else 0.0

    print(
        f"eval: {len(gens)} sequences, {n_all} completion tokens, reward {float(rewards.mean()):.3f}; "
        f"router decisions differing {args.inference_precision} vs fp32: {decisions:.2%}"
    )
    print(
        f"completion tokens routed otherwise by the fp32 trainer (any MoE layer): {n_changed} of "
        f"{n_all} ({share:.2%})"
    )
    gap_col = f"gap>{args.gap}"
    print(
        f"{'tokens':9}{'n':>6}  {'':14}{'mismatch-KL':>12}{'top 1%':>8}{gap_col:>10}"
        f"{'ratio min':>11}{'ratio max':>11}"
    )
    for name, by_arm in stats.items():
        for arm, st in by_arm.items():
            n = int(st["num_tokens"])
            if n == 0:
                print(f"{name:9}{n:>6}  {arm:14}{'no tokens':>12}")
                continue
            top = tops[name][arm]
            shown = f"{top:.0%}" if top is not None else "-"
            print(
                f"{name:9}{n:>6}  {arm:14}{st['mismatch_kl']:>12.3e}{shown:>8}{st['gap_frac']:>10.4f}"
                f"{st['ratio_min']:>11.4f}{st['ratio_max']:>11.4f}"
            )
    print(
        "(changed: routed otherwise at the token's position in the trainer's own forward; same: "
        "routed alike there; clean: routed alike there and at every earlier position; "
        "top 1%: share of the KL carried by the largest 1% of the tokens)"
    )
    plain, replay = stats["all"]["no replay"], stats["all"]["router replay"]
    if replay["gap_frac"] > 0:
        gap_cut = f"{plain['gap_frac'] / replay['gap_frac']:.1f}x"
    elif plain["gap_frac"] > 0:
        gap_cut = "all removed"
    else:
        gap_cut = "n/a (no large-gap tokens in either)"
    print(f"elapsed {time.perf_counter() - t0:.1f}s")
    print(kl_cut(plain, replay, "", 1))
    changed_stats = stats["changed"]
    print(
        kl_cut(
            changed_stats["no replay"],
            changed_stats["router replay"],
            " on routing-changed tokens",
            MIN_CHANGED_TOKENS,
        )
    )
    print(f"routing-changed token share {share:.2%} ({n_changed} of {n_all} completion tokens)")
    shares = f"{plain['gap_frac']:.2%} -> {replay['gap_frac']:.2%}"
    print(f"large-gap (>{args.gap}) token share cut {gap_cut} ({shares})")


if __name__ == "__main__":
    main()
