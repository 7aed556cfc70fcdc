"""`jetrl make-hf-tiny DIR [--kind moe|dense|llama]`: a tiny Hugging Face checkpoint made on the spot.

A byte-level BPE tokenizer trained with ``tokenizers`` on a small generated corpus (arithmetic
word problems, the calculator tool's syntax), wrapped with a Qwen-style Jinja chat template, and a
random Qwen3 / Qwen3-MoE / Llama model saved by transformers: a directory laid out as a real checkpoint,
for trying the Hugging Face path (configs/hf-tiny.toml) and for the tests. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any, Literal

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB = 512
# Qwen's template, reduced to what the tests need: one block per message, and the opening of
# the assistant's turn when asked for.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(n: int = 800, seed: int = 0) -> list[str]:
    """Texts like the arithmetic and calculator environments' (their instructions, questions,
    tool calls and answers), so that their prompts take few tokens."""
    from jetrl.producers.arithmetic import INSTRUCTION, ProblemGenerator
    from jetrl.producers.tool_env import TOOL_INSTRUCTIONS

    rng = random.Random(seed)
    gen = ProblemGenerator("words", "+-*", 999, 99)
    out = [TOOL_INSTRUCTIONS["words"], INSTRUCTION["words"]] * 20
    for _ in range(n):
        p = gen.draw(rng)
        call = f"<calc>{p.a} {p.op} {p.b}</calc>"
        out.append(f"{p.question} {INSTRUCTION['words']} {call} {p.answer} Answer: {p.answer}")
    return out


def make_tokenizer_dir(path: Path, vocab_size: int = VOCAB) -> Path:
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
    kind: Literal["dense", "moe", "llama"] = "moe",
    *,
    seed: int = 0,
    layers: int = 2,
    tokenizer: bool = True,
    norm_topk_prob: bool = True,
    tie: bool = False,
    shard_bytes: int | None = None,
) -> Path:
    """A random Qwen3 (dense), Qwen3-MoE or Llama checkpoint directory with the tokenizer beside
    it."""
    import torch  # here: every jetrl command imports this module to list its options
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    path.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        make_tokenizer_dir(path)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention has kernels for head sizes 32 and up
        max_position_embeddings=1024,
        rope_theta=10_000.0,
        tie_word_embeddings=tie,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.1,  # larger than HF's default so logits and routing are not flat
    )
    cfg: Qwen3Config | Qwen3MoeConfig | LlamaConfig
    if kind == "dense":
        cfg = Qwen3Config(intermediate_size=128, **common)
    elif kind == "llama":
        cfg = LlamaConfig(intermediate_size=128, **common)
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
    return path


def tool_use_examples(n: int, seed: int) -> list[list[dict[str, str]]]:
    """Conversations of the calculator environment solved with one tool call each."""
    from jetrl.producers.arithmetic import INSTRUCTION, ProblemGenerator
    from jetrl.producers.tool_env import TOOL_INSTRUCTIONS

    rng = random.Random(seed)
    gen = ProblemGenerator("words", "+-*", 999, 99)
    out = []
    for _ in range(n):
        p = gen.draw(rng)
        out.append(
            [
                {"role": "system", "content": TOOL_INSTRUCTIONS["words"]},
                {"role": "user", "content": f"{p.question} {INSTRUCTION['words']}"},
                {"role": "assistant", "content": f"<calc>{p.a} {p.op} {p.b}</calc>"},
                {"role": "tool", "content": str(p.answer)},
                {"role": "assistant", "content": f"Answer: {p.answer}"},
            ]
        )
    return out


def warm_start(path: Path, steps: int, *, seed: int = 0, batch: int = 16, lr: float = 3e-3) -> float:
    """A few supervised steps on :func:`tool_use_examples`, as an instruction-tuned model would
    have had: the model then calls the tool and answers in the expected form (its arithmetic is
    another matter). Trains on everything after the system and user turns; saves in place and
    returns the last loss."""
    import torch
    from transformers import AutoModelForCausalLM

    from jetrl.policy.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.train()
    convos = tool_use_examples(batch * 16, seed)
    rows = []
    for c in convos:
        prompt = tok.encode(tok.render_chat(c[:2]), bos=False)
        full = tok.encode(tok.render_chat(c)[: -len("<|im_start|>assistant\n")], bos=False)
        rows.append((full, len(prompt)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = random.Random(seed)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        picked = g.sample(rows, batch)
        width = max(len(r) for r, _ in picked)
        ids = torch.full((batch, width), tok.pad_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, (r, start) in enumerate(picked):
            ids[i, : len(r)] = torch.tensor(r)
            labels[i, start : len(r)] = torch.tensor(r[start:])
            mask[i, : len(r)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(path))
    return float(loss.detach())


def main(args: argparse.Namespace) -> int:
    out = make_checkpoint(Path(args.dir), args.kind, seed=args.seed, layers=args.layers)
    print(f"wrote a tiny {args.kind} checkpoint to {out}")
    if args.warm_steps:
        loss = warm_start(out, args.warm_steps, seed=args.seed)
        print(
            f"warm start: {args.warm_steps} supervised steps on tool-use conversations, last loss {loss:.3f}"
        )
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "make-hf-tiny", help="write a tiny random Qwen3(-MoE) or Llama checkpoint with a BPE tokenizer"
    )
    p.add_argument("dir")
    p.add_argument("--kind", choices=["moe", "dense", "llama"], default="moe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--warm-steps", type=int, default=150, help="supervised steps on tool-use conversations (0: none)"
    )
    p.set_defaults(func=main)
