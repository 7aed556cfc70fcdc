"""Generation benchmark: the embedded engine's sampler (policy/sampling.py, KV cache, routing
capture) against transformers' ``generate`` on the same Hugging Face checkpoint, prompts and
sampling, in one run.

A tiny random Qwen3-MoE (or dense) checkpoint with a BPE tokenizer is made on the spot
(``jetrl make-hf-tiny``); jetrl loads it through policy/hf.py, transformers through
``AutoModelForCausalLM``. Both run in fp32 on the same number of threads, sample at temperature
1 with top-p 1, and stop on the tokenizer's stop ids or after ``--max-tokens``. Rounds alternate
which goes first; the medians of generated tokens per second are compared.

    python bench/generate.py [--kind moe|dense] [--batch 16] [--max-tokens 128] [--rounds 5]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JETRL_LOG_LEVEL", "warning")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from jetrl.deploy.tiny_hf_cmd import make_checkpoint
from jetrl.policy.hf_tokenizer import HFTokenizer
from jetrl.policy.origin import initial_model
from jetrl.policy.sampling import SamplingConfig, generate, inference_copy
from jetrl.policy.settings import ModelSettings

QUESTIONS = [
    "Ann has 12 apples and gets 7 more. How many apples now?",
    "What is 31 + 45?",
    "Bob has 9 coins and gets 14 more. How many coins now?",
    "What is 8 * 7?",
]


def jetrl_side(path: Path, prompts: list[list[int]], cfg: SamplingConfig, seed: int) -> tuple[int, float]:
    model = inference_copy(initial_model(ModelSettings(hf_path=str(path))), "fp32")
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    out = generate(model, prompts, cfg, generator=gen)
    return sum(len(g.completion_ids) for g in out), time.perf_counter() - t0


def hf_side(
    path: Path, prompts: list[list[int]], cfg: SamplingConfig, pad: int, seed: int
) -> tuple[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as jetrl's sampler pads
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=0,
            max_new_tokens=cfg.max_tokens,
            eos_token_id=list(cfg.stop_token_ids),
            pad_token_id=pad,
        )
    took = time.perf_counter() - t0
    new = out[:, width:]
    n = 0
    for row in new.tolist():  # up to and including the first stop, as jetrl counts
        for t in row:
            n += 1
            if t in cfg.stop_token_ids:
                break
    return n, took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=["moe", "dense"], default="moe")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads for both sides")
    args = p.parse_args(argv)
    if min(args.batch, args.max_tokens, args.rounds, args.threads, args.layers) < 1:
        p.error("--batch, --max-tokens, --rounds, --threads and --layers must be positive")
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    with tempfile.TemporaryDirectory(prefix="jetrl-bench-generate-") as tmp:
        path = make_checkpoint(Path(tmp) / "ckpt", args.kind, seed=0, layers=args.layers)
        tok = HFTokenizer(path)
        prompts = [
            tok.encode(
                tok.render_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]), bos=False
            )
            for i in range(args.batch)
        ]
        cfg = SamplingConfig(
            max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, stop_token_ids=tok.stop_ids
        )
        print(
            f"tiny {args.kind} checkpoint ({args.layers} layers, dim 64, vocab {tok.vocab_size}), "
            f"{args.batch} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
            f"up to {args.max_tokens} new tokens, fp32, {args.threads} thread(s)"
        )
        ours: list[float] = []
        theirs: list[float] = []
        # One untimed pass each first: first calls pay for lazy initialisation on both sides.
        jetrl_side(path, prompts[:2], cfg, seed=0)
        hf_side(path, prompts[:2], cfg, tok.pad_id, seed=0)
        for r in range(args.rounds):
            sides = [("jetrl", ours), ("transformers", theirs)]
            for name, rates in sides if r % 2 == 0 else sides[::-1]:
                if name == "jetrl":
                    n, took = jetrl_side(path, prompts, cfg, seed=r)
                else:
                    n, took = hf_side(path, prompts, cfg, tok.pad_id, seed=r)
                rates.append(n / took if took > 0 else 0.0)
                print(f"  round {r}  {name:<12} {n:>6} tokens in {took:6.2f} s = {rates[-1]:8.0f} tokens/s")
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"\njetrl {a:,.0f} tokens/s, transformers {b:,.0f} tokens/s (medians of {args.rounds} rounds)")
    ratio = f"{a / b:.2f}" if b > 0 else "n/a (transformers generated nothing)"
    print(f"generate ratio jetrl/transformers {ratio} (target >= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
