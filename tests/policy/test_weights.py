import struct
import threading

import numpy as np
import pytest
import torch
from blake3 import blake3

from jetrl.policy.models import build_model, get_config
from jetrl.policy.weights import (
    META_CHECKSUM,
    ChecksumMismatch,
    Hasher,
    SafetensorsBuffer,
    _raw_bytes,
    canonical_order,
    checksum,
    export_weights,
    from_hf,
    load_into,
    load_weights,
    read_metadata,
    save_weights,
    tensors_of,
    to_hf,
    transfer_digest,
    verified_tensors,
    weights_from_bytes,
    weights_to_bytes,
)


def test_checksum_is_content_only():
    a = {"b": torch.arange(6, dtype=torch.float32).view(2, 3), "a": torch.ones(2, dtype=torch.bfloat16)}
    b = {
        "a": torch.ones(2, dtype=torch.bfloat16),
        "b": torch.arange(6, dtype=torch.float32).view(3, 2).t().t().view(2, 3),
    }
    assert checksum(a) == checksum(b)
    # non-contiguous views hash like their contiguous copies
    t = torch.arange(6, dtype=torch.float32).view(3, 2).t()
    assert checksum({"x": t}) == checksum({"x": t.contiguous()})


@pytest.mark.parametrize(
    "change",
    [
        lambda d: {**d, "b": d["b"].view(3, 2)},  # shape
        lambda d: {**d, "a": d["a"].float()},  # dtype
        lambda d: {"c" if k == "a" else k: v for k, v in d.items()},  # name
        lambda d: {**d, "b": d["b"] + torch.tensor([[0, 0, 1e-6], [0, 0, 0]])},  # one value
    ],
)
def test_checksum_sees_every_field(change):
    d = {"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.arange(6, dtype=torch.float32).view(2, 3)}
    assert checksum(change(d)) != checksum(d)


def test_save_load_roundtrip_and_layout_independence(tmp_path, model):
    digest = save_weights(tmp_path / "w.safetensors", model, metadata={"policy_version": "3"})
    assert digest == checksum(model)
    tensors, got = load_weights(tmp_path / "w.safetensors", expected_checksum=digest)
    assert got == digest and checksum(tensors) == digest
    # Another file layout (reverse insertion order, different metadata) hashes the same.
    rev = dict(reversed(list(tensors.items())))
    assert save_weights(tmp_path / "r.safetensors", rev, metadata={"other": "x"}) == digest
    assert (tmp_path / "w.safetensors").read_bytes() != (tmp_path / "r.safetensors").read_bytes()
    fresh = build_model("tiny-moe", seed=99)
    assert checksum(fresh) != digest
    load_into(fresh, tensors)
    assert checksum(fresh) == digest
    assert not list(tmp_path.glob(".*tmp*"))


def test_load_detects_corruption(tmp_path, model):
    path = tmp_path / "w.safetensors"
    digest = save_weights(path, model)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="stored checksum"):
        load_weights(path)
    intact = tmp_path / "ok.safetensors"
    save_weights(intact, model)
    with pytest.raises(ChecksumMismatch, match="expected checksum"):
        load_weights(intact, expected_checksum="0" * 64)
    _, unverified = load_weights(path, verify=False)
    assert unverified == digest  # the stored value, unchecked


def test_bytes_roundtrip(model):
    data, digest = weights_to_bytes(model, metadata={"v": "1"})
    assert read_metadata(data)["jetrl.checksum"] == digest and read_metadata(data)["v"] == "1"
    tensors, got = weights_from_bytes(data, expected_checksum=digest)
    assert got == digest
    assert torch.equal(tensors["lm_head.weight"], model.state_dict()["lm_head.weight"])
    with pytest.raises(ChecksumMismatch):
        weights_from_bytes(data, expected_checksum="f" * 64)


def test_bf16_copy_checksums_differ_but_roundtrip(model):
    bf = {k: v.bfloat16() for k, v in model.state_dict().items()}
    data, digest = weights_to_bytes(bf)
    assert digest != checksum(model)
    assert weights_from_bytes(data)[1] == digest


def test_tied_embeddings_save(tmp_path):
    m = build_model(get_config("tiny-moe", tie_embeddings=True))
    assert m.tok_embeddings.weight is m.lm_head.weight
    digest = save_weights(tmp_path / "t.safetensors", m)
    tensors, _ = load_weights(tmp_path / "t.safetensors", expected_checksum=digest)
    assert torch.equal(tensors["tok_embeddings.weight"], tensors["lm_head.weight"])


def test_hf_names_roundtrip(model, cfg):
    hf = to_hf(model, cfg)
    assert "model.layers.0.mlp.gate.weight" in hf
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf
    assert "model.layers.0.self_attn.q_proj.weight" in hf
    back = from_hf(hf, cfg)
    assert checksum(back) == checksum(model)


def test_safetensors_buffer_filled_tensor_by_tensor_is_the_plain_serialisation() -> None:
    model = build_model("tiny-moe", seed=1)
    sd = model.state_dict()
    names = canonical_order(sd)
    buf = SafetensorsBuffer([(n, sd[n].dtype, tuple(sd[n].shape)) for n in names], {"version": "7"})
    h = Hasher()
    for n in reversed(names):  # the buffer takes tensors in any order; the hasher does not
        buf.put(n, sd[n])
    for n in names:
        h.add(n, sd[n])
    data, digest, blake3 = buf.finish(h.hexdigest())
    tensors, got = weights_from_bytes(data, expected_checksum=checksum(model))
    assert got == digest == h.hexdigest() and all(torch.equal(tensors[n], sd[n]) for n in names)
    assert read_metadata(bytes(data))["version"] == "7"
    # Filled out of order, the transfer digest was still taken in file order.
    assert blake3 == transfer_digest(data) == transfer_digest(bytes(data))


def test_hasher_and_buffer_refuse_what_would_make_a_wrong_checksum() -> None:
    h = Hasher()
    h.add("b", torch.zeros(2))
    with pytest.raises(ValueError, match="canonical"):
        h.add("a", torch.zeros(2))  # out of order: another digest for the same weights
    buf = SafetensorsBuffer([("a", torch.float32, (2,)), ("b", torch.float32, (3,))], {})
    with pytest.raises(ValueError, match="planned"):
        buf.put("a", torch.zeros(3))
    buf.put("a", torch.zeros(2))
    with pytest.raises(ValueError, match="never filled"):
        buf.finish("0" * 64)


def _mixed() -> dict[str, torch.Tensor]:
    """Mixed dtypes, odd sizes (a float32 after 3 bf16 values lies misaligned), a non-ASCII
    name, an empty and a 0-d tensor, two names sharing one storage."""
    base = torch.arange(12, dtype=torch.float32).view(3, 4)
    return {
        "b.bf16": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),
        "c.f32": torch.linspace(-1, 1, 7),
        "é.i64": torch.tensor([1, 2**40], dtype=torch.int64),
        "d.empty": torch.empty(0, 5),
        "e.scalar": torch.tensor(2.5),
        "f.tied": base,
        "g.tied": base,
        "h.view": base.t(),
    }


@pytest.mark.parametrize("weights", ["model", "mixed"])
def test_export_in_one_pass_is_the_checksum_and_digest_of_what_it_wrote(weights, model) -> None:
    tensors = model.state_dict() if weights == "model" else _mixed()
    data, digest, b3 = export_weights(tensors, {"version": "4"})
    assert data.readonly  # handed over: a store may serve it where it lies
    assert digest == checksum(tensors)  # what PolicyVersionPublished records, as before
    back, got = weights_from_bytes(data, expected_checksum=digest)
    assert got == digest and set(back) == set(tensors)
    assert all(torch.equal(back[n], tensors[n]) for n in tensors)
    # The transfer digest: BLAKE3 of the bytes after the header, then of the header.
    (n,) = struct.unpack("<Q", data[:8])
    h = blake3(bytes(data[8 + n :]))
    h.update(bytes(data[: 8 + n]))
    assert b3 == h.hexdigest() == transfer_digest(data)
    # One byte changed anywhere changes it (a tensor's, the header's).
    for at in (len(data) - 1, 8 + n // 2):
        bad = bytearray(data)
        bad[at] ^= 1
        assert transfer_digest(bad) != b3


def test_a_checksum_taken_in_its_own_thread_is_the_same_checksum() -> None:
    """Large weights have their checksum taken by a thread beside the copy (policy/weights.py):
    the same digest as in line, for a Hasher fed piece by piece and for a whole export."""
    tensors = _mixed()
    for background in (False, True):
        h = Hasher(background=background)
        for name in canonical_order(tensors):
            t = tensors[name]
            raw = _raw_bytes(t)  # what Hasher.add feeds it, here in pieces of 5 bytes
            h.begin(name, t.dtype, tuple(t.shape), raw.nbytes)
            for off in range(0, raw.nbytes, 5):  # many small pieces: the queue fills and drains
                h.update(raw[off : off + 5])
        assert h.hexdigest() == checksum(tensors)
    h = Hasher(background=True)
    h.close()  # a thread given nothing ends; its digest is the empty weights'
    assert h.hexdigest() == checksum({})
    # A piece its thread cannot hash fails the digest, in the caller's thread, and what comes
    # after it (more than the queue holds) never blocks the caller.
    h = Hasher(background=True)
    h.begin("a", torch.float32, (2,), 8)
    h.update(np.zeros((4, 4)).data[::2])  # not contiguous: SHA-256 refuses it
    for _ in range(40):
        h.update(memoryview(b"x"))
    with pytest.raises(BufferError):
        h.hexdigest()
    big = {f"w{i}": torch.randn(1_000_000, generator=torch.Generator().manual_seed(i)) for i in range(3)}
    data, digest, b3 = export_weights(big)  # 12 MB: past the size hashed beside the copy
    assert digest == checksum(big) and b3 == transfer_digest(data)
    assert not [t for t in threading.enumerate() if t.name == "weights-checksum"]


def test_export_in_hugging_face_layout_keeps_the_canonical_checksum(model, cfg) -> None:
    data, digest, b3 = export_weights(model, {"version": "2"}, hf_config=cfg)
    assert digest == checksum(model) and b3 == transfer_digest(data)
    hf, meta = tensors_of(data)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf and meta["jetrl.layout"] == "hf"
    assert weights_from_bytes(data, expected_checksum=digest, model_cfg=cfg)[1] == digest


def test_tensors_are_views_of_the_received_bytes(model) -> None:
    data, digest, _ = export_weights(model)
    buf = np.frombuffer(data, dtype=np.uint8).copy()  # as received: a writable buffer
    lo = buf.ctypes.data
    tensors = verified_tensors(buf, digest)
    assert all(lo <= t.data_ptr() < lo + buf.size for t in tensors.values() if t.numel())
    assert checksum(tensors) == digest
    # A misaligned one is copied rather than viewed.
    mixed, _ = tensors_of(export_weights(_mixed()).data)
    assert mixed["c.f32"].data_ptr() % 4 == 0 and torch.equal(mixed["c.f32"], torch.linspace(-1, 1, 7))


def test_verified_tensors_refuse_bytes_of_another_version(model) -> None:
    data, digest, _ = export_weights(model)
    with pytest.raises(ChecksumMismatch, match="stored checksum"):
        verified_tensors(data, "0" * 64)
    assert tensors_of(data)[1][META_CHECKSUM] == digest


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d[:4],  # shorter than its header length
        lambda d: struct.pack("<Q", 10**9) + d[8:],  # a header past the end
        lambda d: d[:8] + b"[" + d[9:],  # a header that does not parse
        lambda d: d[: len(d) - 4],  # a tensor past the end
    ],
)
def test_malformed_bytes_are_refused_not_read(mangle, model) -> None:
    data = bytes(export_weights(model).data)
    with pytest.raises(ValueError):
        tensors_of(mangle(data))
