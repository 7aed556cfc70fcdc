"""Weights I/O: safetensors files and bytes, with a content checksum.

Checksum (scheme ``jetrl-sha256-v1``): SHA-256 over the tensors in canonical order, sorted by
the UTF-8 bytes of their names. It starts with the scheme tag ``b"jetrl-sha256-v1\\0"``, then,
per tensor, every field length-prefixed so no two layouts can collide::

    u32 len(name) | name (UTF-8) | u8 len(dtype) | dtype (safetensors code: F32, BF16, ...)
    | u8 ndim | u64 dim * ndim | u64 nbytes | raw bytes (C order, little-endian)

Integers are little-endian. The digest depends only on names, dtypes, shapes and values: not on
file layout, header order, metadata, storage sharing or the order tensors were inserted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file as st_save_file
from torch import nn

CHECKSUM_SCHEME = "jetrl-sha256-v1"
META_CHECKSUM = "jetrl.checksum"
META_SCHEME = "jetrl.checksum_scheme"

_DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

Tensors = Mapping[str, torch.Tensor]


class ChecksumMismatch(ValueError):
    """Stored or expected checksum differs from the weights' content."""


def state_dict_of(model_or_tensors: nn.Module | Tensors) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors with no shared storage (safetensors refuses aliases,
    e.g. tied embeddings), from a model's ``state_dict()`` or a mapping."""
    sd = model_or_tensors.state_dict() if isinstance(model_or_tensors, nn.Module) else model_or_tensors
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in sd.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


class Hasher:
    """The checksum built tensor by tensor, for weights that never sit whole in one place (a
    sharded trainer gathers one full tensor at a time). Tensors must come in canonical order."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(CHECKSUM_SCHEME.encode() + b"\0")
        self._last: bytes | None = None

    def add(self, name: str, t: torch.Tensor) -> None:
        nb = name.encode()
        if self._last is not None and nb <= self._last:
            raise ValueError(f"{name}: tensors must be added in canonical (sorted, distinct) order")
        self._last = nb
        code = _DTYPE_CODES.get(t.dtype)
        if code is None:
            raise TypeError(f"{name}: dtype {t.dtype} has no checksum code")
        raw = _raw_bytes(t)
        h = self._h
        h.update(struct.pack("<I", len(nb)) + nb)
        h.update(struct.pack("<B", len(code)) + code.encode())
        h.update(struct.pack("<B", t.ndim) + b"".join(struct.pack("<Q", d) for d in t.shape))
        h.update(struct.pack("<Q", raw.nbytes))
        h.update(raw)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def canonical_order(names: Iterable[str]) -> list[str]:
    return sorted(names, key=lambda n: n.encode())


def checksum(tensors: nn.Module | Tensors) -> str:
    """Hex SHA-256 of the weights' content (see the module docstring for the definition)."""
    sd = tensors.state_dict() if isinstance(tensors, nn.Module) else tensors
    h = Hasher()
    for name in canonical_order(sd):
        h.add(name, sd[name])
    return h.hexdigest()


def _metadata(digest: str, metadata: Mapping[str, str] | None) -> dict[str, str]:
    meta = dict(metadata or {})
    meta[META_CHECKSUM] = digest
    meta[META_SCHEME] = CHECKSUM_SCHEME
    return meta


def _verify(tensors: Tensors, stored: str | None, expected: str | None, where: str) -> str:
    digest = checksum(tensors)
    for label, want in (("stored", stored), ("expected", expected)):
        if want is not None and want != digest:
            raise ChecksumMismatch(f"{where}: {label} checksum {want} but the content hashes to {digest}")
    return digest


def save_weights(
    path: str | os.PathLike[str], weights: nn.Module | Tensors, metadata: Mapping[str, str] | None = None
) -> str:
    """Write a safetensors file (atomically: temp file, then rename); returns the checksum,
    which is also stored in the file's metadata."""
    sd = state_dict_of(weights)
    digest = checksum(sd)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    st_save_file(sd, str(tmp), metadata=_metadata(digest, metadata))
    os.replace(tmp, path)
    return digest


def load_weights(
    path: str | os.PathLike[str], *, expected_checksum: str | None = None, verify: bool = True
) -> tuple[dict[str, torch.Tensor], str]:
    """Read a safetensors file; with ``verify`` the content must match the stored checksum
    (and ``expected_checksum`` if given). Returns ``(tensors, checksum)``."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    if not verify:
        return tensors, meta.get(META_CHECKSUM) or checksum(tensors)
    return tensors, _verify(tensors, meta.get(META_CHECKSUM), expected_checksum, str(path))


META_LAYOUT = "jetrl.layout"  # "hf" when the bytes hold Hugging Face names and per-expert tensors


def weights_to_bytes(
    weights: nn.Module | Tensors, metadata: Mapping[str, str] | None = None, *, hf_config: Any = None
) -> tuple[bytes, str]:
    """Serialise to safetensors bytes (for an object store); returns ``(data, checksum)``.
    With ``hf_config`` (the model's :class:`~jetrl.policy.models.ModelConfig`) the bytes are in
    Hugging Face layout, for engines that load that (vLLM); the checksum is still the canonical
    tensors'."""
    sd = state_dict_of(weights)
    digest = checksum(sd)
    meta = _metadata(digest, metadata)
    if hf_config is not None:
        sd = to_hf(sd, hf_config)
        meta[META_LAYOUT] = "hf"
    return st_save(sd, metadata=meta), digest


def weights_from_bytes(
    data: bytes | bytearray, *, expected_checksum: str | None = None, model_cfg: Any = None
) -> tuple[dict[str, torch.Tensor], str]:
    """Canonical tensors of safetensors bytes, checksum verified. Bytes in Hugging Face layout
    are converted first, which needs ``model_cfg``."""
    tensors = st_load(data if isinstance(data, bytes) else bytes(data))  # safetensors takes bytes only
    meta = read_metadata(data)
    if meta.get(META_LAYOUT) == "hf":
        if model_cfg is None:
            raise ValueError(
                "these weights are in Hugging Face layout: reading them needs the model's config"
            )
        tensors = from_hf(tensors, model_cfg)
    return tensors, _verify(tensors, meta.get(META_CHECKSUM), expected_checksum, "weights bytes")


def read_metadata(data: bytes | bytearray) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes, without loading the tensors."""
    if len(data) < 8:
        raise ValueError("not safetensors data: shorter than its header length")
    (n,) = struct.unpack("<Q", data[:8])
    header: dict[str, Any] = json.loads(data[8 : 8 + n])
    return dict(header.get("__metadata__") or {})


def load_into(model: nn.Module, tensors: Tensors, *, strict: bool = True) -> None:
    """Copy weights into ``model`` (cast to its dtype), e.g. an inference copy in bf16."""
    with torch.no_grad():
        model.load_state_dict(dict(tensors), strict=strict)


def to_hf(weights: nn.Module | Tensors, model_cfg: Any) -> dict[str, torch.Tensor]:
    """Hugging Face names (per-expert tensors for an MoE), via the family's torchtitan state-dict
    adapter. ``model_cfg`` is a :class:`~jetrl.policy.models.ModelConfig`."""
    from jetrl.policy.models import state_dict_adapter

    hf: dict[str, torch.Tensor] = state_dict_adapter(model_cfg).to_hf(state_dict_of(weights))
    return hf


def from_hf(hf_tensors: Tensors, model_cfg: Any) -> dict[str, torch.Tensor]:
    from jetrl.policy.models import state_dict_adapter

    titan: dict[str, torch.Tensor] = state_dict_adapter(model_cfg).from_hf(dict(hf_tensors))
    return titan


class SafetensorsBuffer:
    """safetensors bytes laid out before their tensors exist, then filled one tensor at a time:
    a sharded trainer gathers each full tensor into place, so the whole weights are held once
    (here) rather than as gathered tensors and again as their serialisation. The checksum goes
    into the metadata last; a placeholder of its length keeps the header's size fixed."""

    def __init__(
        self, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
    ):
        self._meta = dict(metadata)
        header: dict[str, Any] = {}
        self._spans: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, dtype, shape in specs:
            code = _DTYPE_CODES.get(dtype)
            if code is None:
                raise TypeError(f"{name}: dtype {dtype} has no safetensors code")
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._spans[name] = (offset, n, dtype, tuple(shape))
            offset += n
        self._header = header
        self._head_len = len(self._header_bytes("0" * 64))
        self.buf = bytearray(8 + self._head_len + offset)
        self._filled: set[str] = set()

    def _header_bytes(self, digest: str) -> bytes:
        raw = json.dumps({**self._header, "__metadata__": _metadata(digest, self._meta)}).encode()
        return raw + b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes with spaces

    def put(self, name: str, t: torch.Tensor) -> None:
        start, n, dtype, shape = self._spans[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name}: planned {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        base = 8 + self._head_len + start
        self.buf[base : base + n] = _raw_bytes(t)
        self._filled.add(name)

    def finish(self, digest: str) -> bytearray:
        if missing := set(self._spans) - self._filled:
            raise ValueError(f"tensors never filled: {sorted(missing)[:5]}")
        head = self._header_bytes(digest)
        assert len(head) == self._head_len  # the digest replaced a placeholder of its length
        self.buf[:8] = struct.pack("<Q", len(head))
        self.buf[8 : 8 + len(head)] = head
        data, self.buf = self.buf, bytearray()  # handed over, not copied
        return data
