import pytest
import torch

from jetrl.policy.models import build_model, get_config
from jetrl.policy.weights import (
    ChecksumMismatch,
    Hasher,
    SafetensorsBuffer,
    canonical_order,
    checksum,
    from_hf,
    load_into,
    load_weights,
    read_metadata,
    save_weights,
    to_hf,
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
    data = buf.finish(h.hexdigest())
    tensors, digest = weights_from_bytes(data, expected_checksum=checksum(model))
    assert digest == h.hexdigest() and all(torch.equal(tensors[n], sd[n]) for n in names)
    assert read_metadata(data)["version"] == "7"


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
