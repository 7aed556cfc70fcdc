"""Weights I/O: safetensors files and bytes, with a content checksum.

Checksum (scheme ``jetrl-sha256-v1``): SHA-256 over the tensors in canonical order, sorted by
the UTF-8 bytes of their names. It starts with the scheme tag ``b"jetrl-sha256-v1\\0"``, then,
per tensor, every field length-prefixed so no two layouts can collide::

    u32 len(name) | name (UTF-8) | u8 len(dtype) | dtype (safetensors code: F32, BF16, ...)
    | u8 ndim | u64 dim * ndim | u64 nbytes | raw bytes (C order, little-endian)

Integers are little-endian. The digest depends only on names, dtypes, shapes and values: not on
file layout, header order, metadata, storage sharing or the order tensors were inserted.

Weights on their way to inference (:func:`export_weights`) are serialised in one pass: each
tensor is copied a piece at a time into the buffer a payload store sends from, and each piece,
still in cache, is fed to the checksum and to the bytes' transfer digest (BLAKE3, see
:func:`transfer_digest`), which is what a reader checks as the bytes land. Weights of 8 MB and
more have their checksum taken by a thread of its own beside the copy: SHA-256 is the slowest
of the three (a third of BLAKE3's speed here), so the copy and the transfer digest are then
hidden behind it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import struct
import threading
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from blake3 import blake3
from safetensors import safe_open
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

_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

Tensors = Mapping[str, torch.Tensor]
# Tensors are copied and hashed in pieces of this size: a piece is still in cache when it is
# hashed after its copy.
_PIECE = 4 << 20
# Weights of this many bytes and more have their checksum taken in a thread of its own while
# they are copied (Hasher's ``background``); below it, the thread costs more than it saves.
_BACKGROUND_CHECKSUM = 8 << 20
_QUEUED = 16  # pieces waiting for the checksum's thread, at most


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
    sharded trainer gathers one full tensor at a time). Tensors must come in canonical order.

    ``background``: hashed in a thread of its own, in order, while the caller goes on (SHA-256
    releases the interpreter lock as it hashes): an export then copies and takes the transfer
    digest beside it instead of before it. What is handed to :meth:`update` or :meth:`add` must
    not change until :meth:`hexdigest` returns; at most ``_QUEUED`` pieces wait their turn."""

    def __init__(self, *, background: bool = False) -> None:
        self._h = hashlib.sha256(CHECKSUM_SCHEME.encode() + b"\0")
        self._last: bytes | None = None
        self._queue: queue.Queue[bytes | memoryview | None] | None = None
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None  # the thread's, raised by close()
        if background:
            self._queue = queue.Queue(maxsize=_QUEUED)
            self._thread = threading.Thread(target=self._drain, name="weights-checksum", daemon=True)
            self._thread.start()

    @classmethod
    def for_export(cls, nbytes: int) -> Hasher:
        """The hasher for an export of ``nbytes`` (whose pieces stay as they are until it
        ends): in a thread of its own from ``_BACKGROUND_CHECKSUM`` bytes on."""
        return cls(background=nbytes >= _BACKGROUND_CHECKSUM)

    def _drain(self) -> None:
        assert self._queue is not None
        while (piece := self._queue.get()) is not None:
            if self._failed is None:  # after a failure, drained only: the feeder never blocks
                try:
                    self._h.update(piece)
                except BaseException as exc:  # raised in the caller's thread, by close()
                    self._failed = exc

    def _feed(self, data: bytes | memoryview) -> None:
        if self._queue is None:
            self._h.update(data)
        else:
            self._queue.put(data)

    def close(self) -> None:
        """Wait for the hashing thread to finish what it was given (a no-op without one)."""
        if self._thread is not None and self._queue is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = self._queue = None
        if self._failed is not None:
            raise self._failed

    def add(self, name: str, t: torch.Tensor) -> None:
        raw = _raw_bytes(t)
        self.begin(name, t.dtype, tuple(t.shape), raw.nbytes)
        self._feed(raw)

    def begin(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> None:
        """Start a tensor whose raw bytes follow through :meth:`update` (all ``nbytes`` of them,
        before the next tensor begins)."""
        nb = name.encode()
        if self._last is not None and nb <= self._last:
            raise ValueError(f"{name}: tensors must be added in canonical (sorted, distinct) order")
        self._last = nb
        code = _DTYPE_CODES.get(dtype)
        if code is None:
            raise TypeError(f"{name}: dtype {dtype} has no checksum code")
        self._feed(
            struct.pack("<I", len(nb))
            + nb
            + struct.pack("<B", len(code))
            + code.encode()
            + struct.pack("<B", len(shape))
            + b"".join(struct.pack("<Q", d) for d in shape)
            + struct.pack("<Q", nbytes)
        )

    def update(self, raw: memoryview) -> None:
        self._feed(raw)

    def hexdigest(self) -> str:
        self.close()
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
    data: bytes | bytearray | memoryview | np.ndarray,
    *,
    expected_checksum: str | None = None,
    model_cfg: Any = None,
) -> tuple[dict[str, torch.Tensor], str]:
    """Canonical tensors of safetensors bytes, checksum verified (the tensors are views of
    ``data`` where no conversion copies them). Bytes in Hugging Face layout are converted first,
    which needs ``model_cfg``."""
    tensors, meta = tensors_of(data)
    tensors = canonical_tensors(tensors, meta, model_cfg)
    return tensors, _verify(tensors, meta.get(META_CHECKSUM), expected_checksum, "weights bytes")


def canonical_tensors(
    tensors: dict[str, torch.Tensor], meta: Mapping[str, str], model_cfg: Any
) -> dict[str, torch.Tensor]:
    """``tensors`` (of bytes whose metadata is ``meta``) in canonical names: converted back from
    Hugging Face layout when the bytes are in it, which needs ``model_cfg``."""
    if meta.get(META_LAYOUT) != "hf":
        return tensors
    if model_cfg is None:
        raise ValueError("these weights are in Hugging Face layout: reading them needs the model's config")
    return from_hf(tensors, model_cfg)


def verified_tensors(
    data: bytes | bytearray | memoryview | np.ndarray, expected_checksum: str, model_cfg: Any = None
) -> dict[str, torch.Tensor]:
    """Canonical tensors (views of ``data`` where no conversion copies them) of bytes already
    checked against their transfer digest, which the writer took as it hashed the same bytes
    into ``expected_checksum``: not hashed again. The checksum the bytes carry in their metadata
    must be that one (a reference to another version's bytes is refused)."""
    tensors, meta = tensors_of(data)
    check_stored_checksum(meta, expected_checksum)
    return canonical_tensors(tensors, meta, model_cfg)


def check_stored_checksum(meta: Mapping[str, str], expected_checksum: str) -> None:
    """The checksum weights bytes carry in their metadata must be ``expected_checksum``."""
    stored = meta.get(META_CHECKSUM)
    if stored != expected_checksum:
        raise ChecksumMismatch(f"weights bytes: stored checksum {stored} but expected {expected_checksum}")


def tensors_of(
    data: bytes | bytearray | memoryview | np.ndarray,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of safetensors bytes as views of those bytes (no copy; one that would lie
    misaligned for its dtype is copied), and the bytes' ``__metadata__``. The views keep ``data``
    alive; they must not be written to when ``data`` is immutable. Malformed bytes (a header
    that does not parse, a tensor out of bounds) raise ``ValueError``."""
    view = data.reshape(-1).data if isinstance(data, np.ndarray) else memoryview(data).cast("B")
    size = view.nbytes
    if size < 8:
        raise ValueError("not safetensors data: shorter than its header length")
    (n,) = struct.unpack("<Q", view[:8])
    if 8 + n > size:
        raise ValueError(f"not safetensors data: a header of {n} bytes in {size}")
    try:
        header: dict[str, Any] = json.loads(bytes(view[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not safetensors data: its header does not parse ({exc})") from None
    meta = dict(header.pop("__metadata__", None) or {})
    base, body = 8 + n, size - 8 - n
    addr = _buffer_address(view)
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # torch warns of read-only buffers (bytes): the views are never written through.
        warnings.simplefilter("ignore", UserWarning)
        for name, info in header.items():
            try:
                dtype = _CODE_DTYPES[info["dtype"]]
                shape = [int(d) for d in info["shape"]]
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"not safetensors data: tensor {name!r} is described as {info!r}") from None
            item = torch.empty((), dtype=dtype).element_size()
            count = math.prod(shape)
            if not 0 <= begin <= end <= body or end - begin != count * item:
                raise ValueError(f"tensor {name!r}: bytes {begin}..{end} do not fit {info['dtype']}{shape}")
            if count == 0:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            t = torch.frombuffer(view, dtype=dtype, count=count, offset=base + begin).view(shape)
            out[name] = t if (addr + base + begin) % item == 0 else t.clone()
    return out, meta


def _buffer_address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def transfer_digest(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """The BLAKE3 digest (hex) a weights buffer travels with (WeightsReady ``blake3``): of the
    bytes after the safetensors header, then of the header (its 8-byte length and the header
    itself), the order in which :class:`SafetensorsBuffer` writes them (the header last)."""
    view = data.reshape(-1).data if isinstance(data, np.ndarray) else memoryview(data).cast("B")
    n = int.from_bytes(view[:8], "little") if view.nbytes >= 8 else view.nbytes
    head = min(8 + n, view.nbytes)
    h = blake3(view[head:])
    h.update(view[:head])
    return h.hexdigest()


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


class ExportedWeights(NamedTuple):
    """Weights serialised for inference: safetensors bytes (read-only: handed over, held by no
    one else, so a payload store may serve them where they lie), the weights checksum, and the
    bytes' transfer digest (:func:`transfer_digest`)."""

    data: memoryview
    checksum: str
    blake3: str


def export_weights(
    weights: nn.Module | Tensors, metadata: Mapping[str, str] | None = None, *, hf_config: Any = None
) -> ExportedWeights:
    """Serialise the weights for inference in one pass (see the module docstring): jetrl's layout,
    or Hugging Face's with ``hf_config`` (the model's :class:`~jetrl.policy.models.ModelConfig`;
    the checksum is still the canonical tensors')."""
    sd = weights.state_dict() if isinstance(weights, nn.Module) else weights
    names = canonical_order(sd)
    tensors = {n: sd[n].detach().cpu().contiguous() for n in names}
    convert = None
    if hf_config is not None:
        from jetrl.policy.models import state_dict_adapter

        convert = state_dict_adapter(hf_config).to_hf
    parts = {n: convert({n: tensors[n]}) if convert else {n: tensors[n]} for n in names}
    specs = [(o, t.dtype, tuple(t.shape)) for n in names for o, t in parts[n].items()]
    meta = {**(metadata or {}), **({META_LAYOUT: "hf"} if convert else {})}
    buf = SafetensorsBuffer(specs, meta)
    h = Hasher.for_export(buf.buf.nbytes)
    try:
        for n in names:
            if convert is None:
                buf.put(n, tensors[n], checksum=h)  # the checksum hashes the copy as it is made
            else:
                h.add(n, tensors[n])
                for o, t in parts[n].items():
                    buf.put(o, t.contiguous())
        return buf.finish(h.hexdigest())
    finally:
        h.close()


class SafetensorsBuffer:
    """safetensors bytes laid out before their tensors exist, then filled one tensor at a time:
    a sharded trainer gathers each full tensor into place, so the whole weights are held once
    (here) rather than as gathered tensors and again as their serialisation. Tensors are copied
    a piece at a time; each piece is hashed into the transfer digest while in cache when the
    tensors come in file order (the order of ``specs``; others are hashed when the gap before
    them fills), and into a checksum :class:`Hasher` when one is given. The weights checksum
    goes into the metadata last; a placeholder of its length keeps the header's size fixed."""

    def __init__(
        self, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
    ):
        self._meta = dict(metadata)
        header: dict[str, Any] = {}
        self._spans: dict[str, tuple[int, int, torch.dtype, tuple[int, ...], int]] = {}
        offset = 0
        for i, (name, dtype, shape) in enumerate(specs):
            code = _DTYPE_CODES.get(dtype)
            if code is None:
                raise TypeError(f"{name}: dtype {dtype} has no safetensors code")
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._spans[name] = (offset, n, dtype, tuple(shape), i)
            offset += n
        self._header = header
        self._head_len = len(self._header_bytes("0" * 64))
        self._base = 8 + self._head_len
        # Not zero-filled: every byte is written once, by a tensor or the header.
        self._array = np.empty(self._base + offset, dtype=np.uint8)
        self.buf = self._array.data
        self._ends = [s[0] + s[1] for s in sorted(self._spans.values(), key=lambda s: s[4])]
        self._filled = [False] * len(self._spans)
        self._hashed = 0  # tensors, in file order, whose bytes are in the transfer digest
        self._digest = blake3()

    def _header_bytes(self, digest: str) -> bytes:
        raw = json.dumps({**self._header, "__metadata__": _metadata(digest, self._meta)}).encode()
        return raw + b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes with spaces

    def put(self, name: str, t: torch.Tensor, *, checksum: Hasher | None = None) -> None:
        """Copy ``t`` into its place; with ``checksum``, add it there too (in canonical order,
        as :meth:`Hasher.add`), from the copy as it is made."""
        start, n, dtype, shape, index = self._spans[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name}: planned {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        if self._filled[index]:
            raise ValueError(f"{name}: filled twice")
        raw = _raw_bytes(t)
        dst = self.buf[self._base + start : self._base + start + n]
        hot = index == self._hashed  # next in file order: hashed piece by piece, in cache
        if checksum is not None:
            checksum.begin(name, dtype, shape, n)
        for off in range(0, n, _PIECE):
            piece = dst[off : off + _PIECE]
            piece[:] = raw[off : off + _PIECE]
            if checksum is not None:
                checksum.update(piece)
            if hot:
                self._digest.update(piece)
        self._filled[index] = True
        if hot:
            self._hashed += 1
        self._catch_up()

    def _catch_up(self) -> None:
        """Hash the tensors filled out of order once those before them are filled."""
        while self._hashed < len(self._filled) and self._filled[self._hashed]:
            i = self._hashed
            begin = self._ends[i - 1] if i else 0
            self._digest.update(self.buf[self._base + begin : self._base + self._ends[i]])
            self._hashed += 1

    def finish(self, digest: str) -> ExportedWeights:
        """The bytes, handed over (not copied), with ``digest`` (the weights checksum) in their
        metadata, and their transfer digest."""
        if missing := [name for name, s in self._spans.items() if not self._filled[s[4]]]:
            raise ValueError(f"tensors never filled: {sorted(missing)[:5]}")
        head = self._header_bytes(digest)
        assert len(head) == self._head_len  # the digest replaced a placeholder of its length
        self.buf[:8] = struct.pack("<Q", len(head))
        self.buf[8 : 8 + len(head)] = head
        self._digest.update(self.buf[: self._base])
        data = self.buf.toreadonly()
        self.buf = memoryview(b"")
        del self._array
        return ExportedWeights(data, digest, self._digest.hexdigest())
