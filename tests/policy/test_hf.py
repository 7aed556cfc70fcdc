"""Hugging Face checkpoints in and out, against transformers' own implementation.

Tiny random Qwen3 and Qwen3-MoE checkpoints and a byte-level BPE tokenizer are made on the spot
(`jetrl make-hf-tiny`, deploy/tiny_hf_cmd.py); transformers' forward on the same files is the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from jetrl.deploy.tiny_hf_cmd import VOCAB, make_checkpoint
from jetrl.policy.hf import CheckpointError, check_checkpoint, load_state, read_config, save_checkpoint
from jetrl.policy.origin import initial_model
from jetrl.policy.routing import capture_routing, replay_routing
from jetrl.policy.settings import ModelSettings
from jetrl.policy.weights import checksum, state_dict_of
from tests.support.forwards import hf_logits, random_tokens

transformers = pytest.importorskip("transformers")

# fp32 on both sides: the dense model matches exactly, the MoE to summation order (the grouped
# GEMM adds its products in another order than transformers' per-expert loop).
TOL = 1e-5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "dense": make_checkpoint(root / "dense", "dense", seed=1),
        "moe": make_checkpoint(root / "moe", "moe", seed=2),
    }


def _tokens(seed: int, shape: tuple[int, int] = (3, 19)) -> torch.Tensor:
    return random_tokens(seed, shape, VOCAB)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logits_equal_transformers(ckpts: dict[str, Path], kind: str) -> None:
    model = initial_model(ModelSettings(hf_path=str(ckpts[kind])))
    ids = _tokens(0)
    with torch.no_grad():
        ours = model(ids)
    ref = hf_logits(ckpts[kind], ids)
    assert ours.shape == ref.shape == (3, 19, VOCAB)
    assert ref.abs().max() > 0.1  # a model that says something
    assert (ours - ref).abs().max().item() <= TOL


def test_config_is_read_from_the_checkpoint(ckpts: dict[str, Path]) -> None:
    cfg = read_config(ckpts["moe"])
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.num_experts, cfg.top_k) == (VOCAB, 64, 2, 8, 2)
    assert cfg.moe_hidden_dim == 32 and cfg.route_norm and cfg.attention == "sdpa"
    assert read_config(ckpts["dense"]).dense_hidden_dim == 128
    assert read_config(ckpts["moe"], attention="flex").attention == "flex"


def test_unnormalised_top_k_routes_as_transformers(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", "moe", seed=3, norm_topk_prob=False, tokenizer=False)
    assert not read_config(path).route_norm
    model = initial_model(ModelSettings(hf_path=str(path), tokenizer="char"))
    ids = _tokens(1)
    with torch.no_grad():
        assert (model(ids) - hf_logits(path, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_export_loads_in_transformers_with_the_same_logits(
    ckpts: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    model = initial_model(ModelSettings(hf_path=str(ckpts[kind])))
    # Move the weights off the checkpoint's, so that the export is not the source file again.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    out = save_checkpoint(
        tmp_path / "export", model.state_dict(), read_config(ckpts[kind]), source=ckpts[kind]
    )
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    ids = _tokens(2)
    with torch.no_grad():
        ours = model(ids)
    assert (ours - hf_logits(out, ids)).abs().max().item() <= TOL
    tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_checksum_survives_a_round_trip_through_hf_layout(ckpts: dict[str, Path], tmp_path: Path) -> None:
    cfg = read_config(ckpts["moe"])
    canonical = load_state(ckpts["moe"], cfg)
    out = save_checkpoint(tmp_path / "rt", canonical, cfg, source=ckpts["moe"])
    again = load_state(out, cfg)
    assert checksum(again) == checksum(canonical)
    assert set(load_file(str(out / "model.safetensors"))) == set(
        load_file(str(ckpts["moe"] / "model.safetensors"))
    )


def test_export_without_a_source_makes_a_config_transformers_reads(tmp_path: Path) -> None:
    from jetrl.policy.models import build_model, get_config

    cfg = get_config("tiny-moe")
    model = build_model(cfg, seed=4)
    out = save_checkpoint(tmp_path / "scratch", model.state_dict(), cfg, max_shard_bytes=100_000)
    assert (out / "model.safetensors.index.json").is_file()  # sharded
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (model(ids) - hf_logits(out, ids)).abs().max().item() <= TOL
    assert checksum(load_state(out, read_config(out))) == checksum(state_dict_of(model))


def test_sharded_checkpoints_load(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "sh", "moe", seed=5, shard_bytes=60_000)
    assert (path / "model.safetensors.index.json").is_file()
    model = initial_model(ModelSettings(hf_path=str(path)))
    ids = _tokens(3)
    with torch.no_grad():
        assert (model(ids) - hf_logits(path, ids)).abs().max().item() <= TOL


def test_router_capture_and_replay_on_an_hf_moe(ckpts: dict[str, Path]) -> None:
    model = initial_model(ModelSettings(hf_path=str(ckpts["moe"])))
    ids = _tokens(4, (2, 13))
    with torch.no_grad(), capture_routing(model) as cap:
        ref = model(ids)
        trace = cap.take()
    assert trace.shape == (2, 13, 2, 2)
    with torch.no_grad(), replay_routing(model, trace):
        assert torch.equal(model(ids), ref)
    with torch.no_grad(), replay_routing(model, (trace.long() + 1) % 8):
        assert not torch.allclose(model(ids), ref)


# ----------------------------------------------------------------------------- bad checkpoints


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_shard_is_refused(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "sh", "dense", seed=6, shard_bytes=40_000)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing: {shard.name}"):
        check_checkpoint(path)


def test_wrong_shapes_are_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(ckpts["dense"], tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"wrong shape: .*mlp.*\(128, 64\) \(config says \(96, 64\)\)"):
        check_checkpoint(path)


def test_missing_and_unexpected_tensors_are_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(ckpts["dense"], tmp_path / "c")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        check_checkpoint(path)
    assert "1 missing: model.layers.1.self_attn.o_proj.weight" in str(err.value)
    assert "1 unexpected: model.layers.0.extra.weight" in str(err.value)


def test_unknown_architecture_is_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(ckpts["dense"], tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'GPT2LMHeadModel' is not supported"):
        check_checkpoint(path)


def test_mixed_dense_and_moe_layers_are_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(ckpts["moe"], tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg["mlp_only_layers"] = [0]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        check_checkpoint(path)


def test_missing_tokenizer_and_config_are_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(ckpts["dense"], tmp_path / "c")
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer"):
        check_checkpoint(path)
    check_checkpoint(path, tokenizer=False)  # a run with another tokenizer needs none
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        check_checkpoint(path)
    with pytest.raises(CheckpointError, match="not a directory"):
        check_checkpoint(tmp_path / "nowhere")


def test_weights_published_in_hf_layout_keep_the_canonical_checksum(ckpts: dict[str, Path]) -> None:
    from safetensors.torch import load as st_load

    from jetrl.policy.hf import expected_hf_shapes
    from jetrl.policy.weights import weights_from_bytes, weights_to_bytes

    cfg = read_config(ckpts["moe"])
    model = initial_model(ModelSettings(hf_path=str(ckpts["moe"])))
    data, digest = weights_to_bytes(model, {"version": "3"}, hf_config=cfg)
    assert digest == checksum(model)
    assert {k: tuple(v.shape) for k, v in st_load(data).items()} == expected_hf_shapes(cfg)
    with pytest.raises(ValueError, match="Hugging Face layout"):
        weights_from_bytes(data, expected_checksum=digest)
    tensors, got = weights_from_bytes(data, expected_checksum=digest, model_cfg=cfg)
    assert got == digest and set(tensors) == set(model.state_dict())
