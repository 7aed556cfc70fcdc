"""`jetrl make-hf-tiny DIR [--kind moe|dense]`: a tiny Hugging Face checkpoint made on the spot.

A byte-level BPE tokenizer trained with ``tokenizers`` on a small generated corpus (arithmetic
word problems, the calculator tool's syntax), wrapped with a Qwen-style Jinja chat template, and a
random Qwen3 / Qwen3-MoE model saved by transformers: a directory laid out as a real checkpoint,
for trying the Hugging Face path (configs/hf-tiny.toml) and for the tests. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any, Literal

import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen's template, reduced to what the tests need: one block per message, and the opening of
# the assistant's turn when asked for.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(n: int = 600, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    names = ["ann", "bob", "cara", "dev", "eli", "fay"]
    things = ["apples", "books", "coins", "pens", "stones"]
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        nm, th = rng.choice(names), rng.choice(things)
        out.append(f"{nm.title()} has {a} {th} and gets {b} more. How many {th} now? The answer is {a + b}.")
        out.append(f"{a} + {b} = {a + b}; {a} * {b} = {a * b}; <calc>{a}-{b}</calc> = {a - b}")
    return out


def make_tokenizer_dir(path: Path, vocab_size: int = 320) -> Path:
    """A byte-level BPE tokenizer with the chat template, saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path


def make_checkpoint(
    path: Path,
    kind: Literal["dense", "moe"] = "moe",
    *,
    seed: int = 0,
    layers: int = 2,
    tokenizer: bool = True,
    norm_topk_prob: bool = True,
    tie: bool = False,
    shard_bytes: int | None = None,
) -> Path:
    """A random Qwen3 (dense) or Qwen3-MoE checkpoint directory with the tokenizer beside it."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    path.mkdir(parents=True, exist_ok=True)
    tok_dir = make_tokenizer_dir(path) if tokenizer else None
    vocab = 320
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=10_000.0,
        tie_word_embeddings=tie,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.1,  # larger than HF's default so logits and routing are not flat
    )
    cfg: Qwen3Config | Qwen3MoeConfig
    if kind == "dense":
        cfg = Qwen3Config(intermediate_size=128, **common)
    else:
        cfg = Qwen3MoeConfig(
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            intermediate_size=128,
            **common,
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # type: ignore[no-untyped-call]
    kw = {} if shard_bytes is None else {"max_shard_size": shard_bytes}
    model.save_pretrained(str(path), **kw)
    assert tok_dir is None or tok_dir == path
    return path


def main(args: argparse.Namespace) -> int:
    out = make_checkpoint(Path(args.dir), args.kind, seed=args.seed, layers=args.layers)
    print(f"wrote a tiny {args.kind} checkpoint to {out}")
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("make-hf-tiny", help="write a tiny random Qwen3(-MoE) checkpoint with a BPE tokenizer")
    p.add_argument("dir")
    p.add_argument("--kind", choices=["moe", "dense"], default="moe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.set_defaults(func=main)
