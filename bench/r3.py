"""Router Replay benchmark: how much of the train/inference mismatch does R3 remove?

A tiny Qwen3-MoE (torchtitan model code) learns to reverse short strings: a short supervised
warm-up, then RL steps through ``jetrl.policy.train.train_step`` so the routers are well away
from their initialisation. Then inference samples in bf16 (its own copy of the weights) and the
trainer recomputes the same tokens' log-probs in fp32, without and with replaying the routing
inference recorded. Printed: mean mismatch KL (k3 estimate of KL(pi_inf || pi_train) per token),
the share of tokens whose probability differs by more than 0.02, the share of (token, layer) router
decisions that differ between the engines, and the headline cuts.

    python bench/r3.py            # ~1-2 minutes on 2 CPU cores
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
from jetrl.policy.sampling import Generation, SamplingConfig, generate, inference_copy
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
) -> tuple[list[Generation], torch.Tensor, nn.Module]:
    inf = inference_copy(model, "bf16")
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


def routing_flip_rate(model: nn.Module, batch: TrainBatch) -> float:
    """Share of (token, MoE layer) decisions where the fp32 trainer's own top-k set differs from
    the recorded bf16 one."""
    with torch.no_grad(), capture_routing(model) as cap:
        model(batch.input_ids[:, :-1])
        own = cap.take().long().sort(-1).values
    assert batch.routing is not None  # an MoE model's rollouts carry their traces
    rec = batch.routing.sort(-1).values
    valid = torch.zeros(batch.routing.shape[:2], dtype=torch.bool)
    for i in range(valid.shape[0]):
        # every position that was fed forward: prompt + completion - 1 rows
        valid[i, : int(batch.loss_mask[i].nonzero().max()) + 1] = True
    diff = (own != rec).any(-1)  # [B, L, layers]
    return float(diff[valid].float().mean())


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
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.sft_steps, args.rl_steps, args.eval_prompts = 20, 1, 128

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

    # Measurement: bf16 inference samples, fp32 trainer recomputes, with and without replay.
    model.eval()
    gens, rewards, _ = rollouts(model, tok, rng, gen, n_prompts=args.eval_prompts, group=1, max_tokens=10)
    batch = collate([Rollout(g.prompt_ids, g.completion_ids, g.logprobs, 0.0, g.routing) for g in gens], cfg)
    with torch.no_grad():
        lp_plain, _ = compute_logprobs(model, batch, replay=False)
        lp_replay, _ = compute_logprobs(model, batch, replay=True)
    plain = mismatch_stats(lp_plain, batch.inference_logprobs, batch.loss_mask, args.gap)
    replay = mismatch_stats(lp_replay, batch.inference_logprobs, batch.loss_mask, args.gap)
    flips = routing_flip_rate(model, batch)

    print(
        f"eval: {len(gens)} sequences, {int(plain['num_tokens'])} completion tokens, "
        f"reward {float(rewards.mean()):.3f}; router decisions differing bf16 vs fp32: {flips:.2%}"
    )
    print(f"{'':14}{'mismatch-KL':>14}{f'gap>{args.gap}':>10}{'ratio min':>11}{'ratio max':>11}")
    for name, s in (("no replay", plain), ("router replay", replay)):
        print(
            f"{name:14}{s['mismatch_kl']:>14.3e}{s['gap_frac']:>10.4f}{s['ratio_min']:>11.4f}{s['ratio_max']:>11.4f}"
        )
    kl_cut = plain["mismatch_kl"] / max(replay["mismatch_kl"], 1e-30)
    if replay["gap_frac"] > 0:
        gap_cut = f"{plain['gap_frac'] / replay['gap_frac']:.1f}x"
    else:
        gap_cut = "n/a (no large-gap tokens left)" if plain["gap_frac"] == 0 else "inf"
    print(f"elapsed {time.perf_counter() - t0:.1f}s")
    print(f"mismatch-KL cut {kl_cut:.1f}x (target >= 10x)")
    shares = f"{plain['gap_frac']:.2%} -> {replay['gap_frac']:.2%}"
    print(f"large-gap (>{args.gap}) token share cut {gap_cut} ({shares})")


if __name__ == "__main__":
    main()
