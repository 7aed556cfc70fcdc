"""A GGUF file (llama.cpp's format, quantized or not) as a plain Hugging Face checkpoint that
every part of jetrl reads: fp32 safetensors, config.json, the tokenizer and its chat template.

transformers de-quantizes GGUF tensors on load (it needs ``gguf`` and ``accelerate``, the
``gguf`` extra) but refuses to save a model loaded that way, so the weights move into a model
built from the same config without its ``quantization_config`` and that one is saved. The result
is checked as a run checks its ``[model] hf_path`` before it is moved into place, and a marker
(``jetrl-import.json``: the source's name, size and SHA-256) makes a second import of the same
file a no-op: the conversion is done once and cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from jetrl.policy.hf import CheckpointError, check_checkpoint

MARKER = "jetrl-import.json"


class GGUFImportError(CheckpointError):
    """A GGUF file that cannot become a checkpoint; the message says why."""


def source_identity(gguf: Path) -> dict[str, Any]:
    data = gguf.read_bytes()
    return {"source": gguf.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def imported_from(directory: Path) -> dict[str, Any] | None:
    """The marker of a finished import in ``directory`` (None: there is none)."""
    try:
        data = json.loads((directory / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def import_gguf(gguf: str | os.PathLike[str], out: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write the checkpoint of ``gguf`` to ``out`` once; return ``out``. An ``out`` that holds
    the import of the same file is left as it is (unless ``force``); one that holds anything
    else is refused."""
    src, dst = Path(gguf).resolve(), Path(out)
    if not src.is_file():
        raise GGUFImportError(f"{src}: no such file")
    ident = source_identity(src)
    done = imported_from(dst)
    if done is not None and not force:
        if {k: done.get(k) for k in ident} == ident:
            return dst
        raise GGUFImportError(
            f"{dst} holds the import of another file ({done.get('source')}, sha256 "
            f"{str(done.get('sha256'))[:12]}); choose another directory or pass --force"
        )
    if dst.exists() and done is None and any(dst.iterdir()):
        raise GGUFImportError(f"{dst}: not empty and not a jetrl import; choose an empty or new directory")
    try:
        import accelerate  # type: ignore[import-untyped]  # noqa: F401  # transformers needs it for GGUF
        import gguf as _gguf  # noqa: F401
    except ModuleNotFoundError as e:
        raise GGUFImportError(f"importing GGUF needs {e.name}: pip install 'jetrl[gguf]'") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
            loaded = AutoModelForCausalLM.from_pretrained(
                str(src.parent), gguf_file=src.name, dtype=torch.float32
            )
        except (ValueError, KeyError, OSError, RuntimeError) as e:
            raise GGUFImportError(f"{src}: transformers cannot read it: {type(e).__name__}: {e}") from None
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are de-quantized: a plain checkpoint
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        plain.load_state_dict(loaded.state_dict())
        del loaded
        plain.save_pretrained(str(staging))
        tok.save_pretrained(str(staging))
        check_checkpoint(staging)  # what a run checks before it starts
        (staging / MARKER).write_text(json.dumps(ident, indent=1))
        if dst.exists():
            shutil.rmtree(dst)
        staging.rename(dst)
        # mkdtemp made the directory private; a checkpoint is read by every part, on any host.
        dst.chmod(0o755)
        for f in dst.iterdir():
            f.chmod(0o644)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dst
