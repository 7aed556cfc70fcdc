"""Batched generation for the embedded inference engine.

Prompts of different lengths are left-padded for the prefill and decoded with a KV cache
(:class:`~jetrl.policy.models.KVCache`), so every position goes through the model exactly once
and its routing is recorded once. Sampling draws from a caller-supplied ``torch.Generator``:
the same seed, weights and prompts give the same completions.

The inference precision (bf16 or fp32) is a property of the engine's own copy of the model
(:func:`inference_copy`), independent of the trainer's; ``auto`` is bf16 on a GPU that has it
and fp32 on a CPU (:func:`resolve_precision`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from jetrl.policy.models import KVCache, model_config
from jetrl.policy.routing import capture_routing

Precision = Literal["auto", "bf16", "fp32"]
PRECISIONS: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
FinishReason = Literal["stop", "length"]
# Below this a temperature samples the argmax anyway, and float32 logits divided by it can
# overflow to inf (NaN probabilities): it is greedy.
GREEDY_BELOW = 1e-6


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    max_tokens: int = 32
    temperature: float = 1.0  # 0 = greedy (its logprobs are then 0: a point mass)
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


@dataclass(slots=True)
class Generation:
    """One completion. ``logprobs[i]`` is the log-probability of ``completion_ids[i]`` under the
    distribution it was drawn from (after temperature and top-p). ``routing`` is the R3 trace
    ``[len(prompt_ids) + len(completion_ids) - 1, moe_layers, top_k]`` (None for dense models or
    when capture is off)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: FinishReason
    routing: torch.Tensor | None = field(default=None, repr=False)


def resolve_precision(precision: Precision, device: torch.device | None = None) -> Literal["bf16", "fp32"]:
    """The precision ``precision`` stands for on ``device`` (default: the GPU if there is one,
    else the CPU): ``auto`` is bf16 on a GPU that has it, fp32 on a CPU. On a CPU bf16 buys no
    speed at the sizes it samples (the demo's batch: 51 ms in bf16 against 50 in fp32 with AMX,
    98 against 35 on an AVX2 CPU that emulates it) and costs fidelity: sampled in bf16 and
    trained in fp32, the demo's seed 1 collapsed at 0.77 where fp32 reached 0.92 (docs/running.md)."""
    if precision == "auto":
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        on_gpu = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return "bf16" if on_gpu else "fp32"
    if precision not in PRECISIONS:
        choices = sorted([*PRECISIONS, "auto"])
        raise ValueError(f"precision must be one of {choices}, got {precision!r}")
    return precision


def inference_copy(model: nn.Module, precision: Precision = "bf16") -> nn.Module:
    """A frozen copy of ``model`` in the inference precision (``auto`` resolved for the device
    the model is on); load new weights into it with ``load_state_dict`` (values are cast to its
    dtype)."""
    resolved = resolve_precision(precision, next(model.parameters()).device)
    out = copy.deepcopy(model).to(dtype=PRECISIONS[resolved]).eval()
    out.requires_grad_(False)
    return out


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities of the distribution tokens are drawn from (float32, ``-inf`` outside
    the top-p nucleus)."""
    logits = logits.float()
    if temperature < GREEDY_BELOW:
        greedy = torch.full_like(logits, float("-inf"))
        return greedy.scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_lp.exp()
        # Drop a token when the mass of strictly more likely tokens already reaches top_p; the
        # most likely token is always kept.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns ``(tokens [B], logprobs [B])``."""
    logp = sampling_logprobs(logits, temperature, top_p)
    if temperature < GREEDY_BELOW:
        tokens = logp.argmax(-1)
    else:
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    cfg: SamplingConfig,
    *,
    generator: torch.Generator | None = None,
    pad_id: int = 0,
) -> list[Generation]:
    """Sample one completion per prompt. The model runs in its own dtype and eval mode."""
    mcfg = model_config(model)
    if not prompts:
        return []
    lens = [len(p) for p in prompts]
    if min(lens) < 1:
        raise ValueError("every prompt needs at least one token")
    if max(lens) >= mcfg.max_seq_len:
        raise ValueError(
            f"a prompt of {max(lens)} tokens leaves no room below max_seq_len={mcfg.max_seq_len}"
        )
    device = next(model.parameters()).device
    batch = len(prompts)
    budget = torch.tensor([min(cfg.max_tokens, mcfg.max_seq_len - n) for n in lens], device=device)
    tokens, valid = _left_padded(prompts, lens, pad_id)
    tokens, valid = tokens.to(device), valid.to(device)
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    stop = torch.as_tensor(cfg.stop_token_ids, dtype=torch.long, device=device)
    capture = mcfg.is_moe

    was_training = model.training
    model.eval()
    try:
        cache = KVCache()
        with capture_routing(model) if capture else nullcontext() as cap:
            cache.begin(valid)
            logits = model(tokens, positions, cache)[:, -1]
            prompt_routes = cap.take() if cap is not None else None
            next_pos = torch.as_tensor(lens, device=device)
            done = torch.zeros(batch, dtype=torch.bool, device=device)
            stopped = torch.zeros_like(done)
            out_tok: list[torch.Tensor] = []
            out_lp: list[torch.Tensor] = []
            out_live: list[torch.Tensor] = []
            decode_routes: list[tuple[torch.Tensor, torch.Tensor]] = []
            for step in range(cfg.max_tokens):
                tok, lp = sample_tokens(logits, cfg.temperature, cfg.top_p, generator)
                live = ~done
                out_tok.append(tok)
                out_lp.append(lp)
                out_live.append(live)
                hit_stop = live & torch.isin(tok, stop)
                stopped |= hit_stop
                done = done | hit_stop | (step + 1 >= budget)
                if bool(done.all()):
                    break
                feed = ~done
                cache.begin(feed[:, None])
                step_logits = model(torch.where(feed, tok, pad_id)[:, None], next_pos[:, None], cache)
                logits = step_logits[:, -1]
                next_pos = next_pos + feed.long()
                if cap is not None:
                    decode_routes.append((cap.take()[:, 0].cpu(), feed.cpu()))
    finally:
        model.train(was_training)

    # A row's tokens are those drawn while it was live, and its routes those of its prompt's
    # real tokens and of the tokens fed back: each row's share of one selection by mask, split
    # into views (one copy for the batch, not one a row).
    live = torch.stack(out_live, 1).cpu()
    lengths = live.sum(1).tolist()
    tokens_of = torch.stack(out_tok, 1).cpu()[live].split(lengths)
    logprobs_of = torch.stack(out_lp, 1).float().cpu()[live].split(lengths)
    routes_of: Sequence[torch.Tensor | None] = [None] * batch
    if prompt_routes is not None:
        routes, kept = prompt_routes.cpu(), valid.cpu()
        if decode_routes:
            routes = torch.cat((routes, torch.stack([r for r, _ in decode_routes], 1)), 1)
            kept = torch.cat((kept, torch.stack([f for _, f in decode_routes], 1)), 1)
        routes_of = routes[kept].split(kept.sum(1).tolist())
    finished = stopped.tolist()
    return [
        Generation(
            prompt_ids=list(prompt),
            completion_ids=tokens_of[i].tolist(),
            logprobs=logprobs_of[i],
            finish_reason="stop" if finished[i] else "length",
            routing=routes_of[i],
        )
        for i, prompt in enumerate(prompts)
    ]


def _left_padded(
    prompts: Sequence[Sequence[int]], lens: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as rows of one ``[batch, width]`` tensor, each right-aligned after ``pad_id``
    padding, and the mask of their real tokens: filled by one scatter rather than a slice
    assignment a row (256 rows: 0.6 ms against 9.8 on an AMD EPYC; on a GPU, one copy, not 512)."""
    width = max(lens)
    n = torch.tensor(lens)
    flat = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(lens)), n)
    # A token's column: its place in its prompt, shifted right by its row's padding.
    starts = torch.cumsum(n, 0) - n
    cols = torch.arange(flat.numel()) - starts[rows] + (width - n)[rows]
    tokens = torch.full((len(lens), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(lens), width), dtype=torch.bool)
    tokens[rows, cols] = flat
    valid[rows, cols] = True
    return tokens, valid
