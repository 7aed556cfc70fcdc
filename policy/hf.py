"""Hugging Face checkpoints in and out: config.json and safetensors, through torchtitan's
state-dict adapter of the model's family (Qwen3's, Llama 3's).

* :func:`read_config` turns a checkpoint's ``config.json`` into a jetrl :class:`ModelConfig`
  through the family of its architecture (policy/models/: Qwen3 dense, Qwen3-MoE and Llama:
  Llama 3.x, SmolLM2, other ``LlamaForCausalLM``; anything else, and what a family has that jetrl
  does not compute, is refused with what is served).
* :func:`check_checkpoint` checks a directory before any process starts: the config, every shard
  the index names, every tensor's name and shape against what the model expects (read from the
  safetensors headers, nothing loaded), and the tokenizer files.
* :func:`load_state` reads the tensors into jetrl's (torchtitan's) canonical names: the per-expert
  HF tensors are stacked into the grouped experts by the adapter.
* :func:`save_checkpoint` writes a directory transformers and vLLM load as it is: HF names and
  per-expert tensors, a config.json (the source checkpoint's, or one made from the config), and the
  tokenizer files of the source checkpoint.

Checksums (policy/weights.py) stay defined over the canonical tensors, whatever the layout: a
round trip through HF layout leaves them unchanged (tested).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jetrl.policy.models import CheckpointError, ModelConfig, config_from_hf, hf_config_of

__all__ = ["CheckpointError", "check_checkpoint", "load_state", "read_config", "save_checkpoint"]
# Files of a tokenizer that transformers' AutoTokenizer reads; tokenizer_config.json is required.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# HF tensors the adapter drops on purpose (recomputed buffers of older checkpoints).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- config


def read_hf_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    where = Path(path)
    f = where / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{where}: no config.json (is it a Hugging Face checkpoint directory?)")
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{f}: not a JSON object")
    return data


def read_config(path: str | os.PathLike[str], **overrides: Any) -> ModelConfig:
    """The model of checkpoint directory ``path``, with jetrl-side ``overrides`` (attention
    kernel, ...) applied."""
    where = Path(path)
    try:
        cfg = config_from_hf(read_hf_json(where), where)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{where}/config.json: {type(e).__name__}: {e}") from None
    return cfg.replace(**overrides) if overrides else cfg


# ----------------------------------------------------------------------------- tensors


def shard_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the file that holds it (single file, or sharded with an index)."""
    if (path / INDEX).is_file():
        try:
            weight_map: dict[str, str] = json.loads((path / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path / INDEX}: not a safetensors index ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(f"{path}: shard(s) named by {INDEX} are missing: {', '.join(missing)}")
        return {name: path / f for name, f in weight_map.items()}
    if (path / SINGLE).is_file():
        with safe_open(str(path / SINGLE), framework="pt") as f:
            return dict.fromkeys(f.keys(), path / SINGLE)
    raise CheckpointError(f"{path}: no {SINGLE} and no {INDEX}")


def _shapes(files: Mapping[str, Path]) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as h:
            present = set(h.keys())
            for n in names:
                if n not in present:
                    raise CheckpointError(f"{f}: the index names {n!r} but the shard does not hold it")
                out[n] = tuple(h.get_slice(n).get_shape())
    return out


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor a model of ``cfg`` has, with its shape (from a model built on the meta
    device through the same adapter that loads and saves)."""
    from jetrl.policy.models import build_model, state_dict_adapter

    model = build_model(cfg, seed=None, device="meta")
    hf = state_dict_adapter(cfg).to_hf(model.state_dict())
    return {k: tuple(v.shape) for k, v in hf.items()}


def check_tensors(cfg: ModelConfig, files: Mapping[str, Path], where: Path) -> None:
    got = {k: v for k, v in _shapes(files).items() if not k.endswith(_IGNORED_SUFFIXES)}
    want = expected_hf_shapes(cfg)
    if cfg.tie_embeddings:
        got.pop("lm_head.weight", None)  # some tied checkpoints store the copy too
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    wrong = sorted(
        f"{k}: {got[k]} (config says {want[k]})" for k in set(got) & set(want) if got[k] != want[k]
    )
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if items:
            more = f" and {len(items) - 5} more" if len(items) > 5 else ""
            problems.append(f"{len(items)} {label}: {'; '.join(items[:5])}{more}")
    if problems:
        raise CheckpointError(f"{where}: tensors do not match config.json: " + " | ".join(problems))


def check_tokenizer(path: Path) -> None:
    if not (path / "tokenizer_config.json").is_file() or not (
        (path / "tokenizer.json").is_file() or (path / "vocab.json").is_file()
    ):
        raise CheckpointError(
            f"{path}: no tokenizer (tokenizer_config.json with tokenizer.json or vocab.json); "
            "copy the checkpoint's tokenizer files next to its weights"
        )


def check_checkpoint(
    path: str | os.PathLike[str], *, tokenizer: bool = True, **overrides: Any
) -> ModelConfig:
    """Everything a run needs from ``path``, checked without loading a tensor."""
    where = Path(path)
    if not where.is_dir():
        raise CheckpointError(f"{where}: not a directory (hf_path takes a local checkpoint directory)")
    cfg = read_config(where, **overrides)
    check_tensors(cfg, shard_files(where), where)
    if tokenizer:
        check_tokenizer(where)
    return cfg


def load_state(path: str | os.PathLike[str], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in canonical (torchtitan) names, checked first."""
    from jetrl.policy.weights import from_hf

    where = Path(path)
    files = shard_files(where)
    check_tensors(cfg, files, where)
    hf: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        if not name.endswith(_IGNORED_SUFFIXES):
            by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as h:
            for n in names:
                hf[n] = h.get_tensor(n)
    if cfg.tie_embeddings:
        hf.pop("lm_head.weight", None)
    return from_hf(hf, cfg)


# ----------------------------------------------------------------------------- saving


def save_checkpoint(
    directory: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    *,
    source: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 4 * 1024**3,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write canonical ``tensors`` as an HF checkpoint directory (sharded with an index past
    ``max_shard_bytes``). ``source``: the checkpoint the run started from, whose config.json
    and tokenizer files are carried over; ``dtype``: the saved precision (default: the
    tensors')."""
    from jetrl.policy.weights import to_hf

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    hf = to_hf(tensors, cfg)
    if dtype is not None:
        hf = {k: v.to(dtype) for k, v in hf.items()}
    save_dtype = next(iter(hf.values())).dtype
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(hf):
        nbytes = hf[name].numel() * hf[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = hf[name].contiguous()
        size += nbytes
    meta = {"format": "pt", **(metadata or {})}
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata=meta)
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata=meta)
            weight_map |= dict.fromkeys(shard, fname)
        total = sum(v.numel() * v.element_size() for v in hf.values())
        (out / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    if source is not None:
        config = read_hf_json(source)
        config["torch_dtype"] = config["dtype"] = str(save_dtype).removeprefix("torch.")
        for f in TOKENIZER_FILES:
            if (Path(source) / f).is_file():
                shutil.copyfile(Path(source) / f, out / f)
    else:
        config = hf_config_of(cfg, save_dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out
