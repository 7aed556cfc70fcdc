"""The Llama family (torchtitan's Llama3Model and its state-dict adapter) against transformers'
LlamaForCausalLM on checkpoints made on the spot: logits, Llama 3's RoPE scaling, tied
embeddings, export both ways, the KV cache and packed batches, a cast model, and what is refused.

fp32 on both sides; the differences left are float summation order (measured ~2e-6 here): the
adapter permutes Q and K between Hugging Face's half-split RoPE layout and torchtitan's
adjacent pairs, which computes the same rotation in another order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from jetrl.deploy.tiny_hf_cmd import VOCAB, make_checkpoint
from jetrl.policy.hf import CheckpointError, check_checkpoint, read_config, save_checkpoint
from jetrl.policy.models import PackedMask, RealPairRoPE, build_model, get_config
from jetrl.policy.origin import initial_model
from jetrl.policy.settings import ModelSettings
from jetrl.policy.weights import checksum, state_dict_of
from tests.support.forwards import cached_logits, hf_logits, random_tokens

transformers = pytest.importorskip("transformers")

TOL = 1e-5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama")
    return {
        "untied": make_checkpoint(root / "untied", "llama", seed=3),
        "tied": make_checkpoint(root / "tied", "llama", seed=4, tie=True),
    }


def _tokens(seed: int, shape: tuple[int, int] = (3, 23)) -> torch.Tensor:
    return random_tokens(seed, shape, VOCAB)


def _ours(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = initial_model(ModelSettings(hf_path=str(path)))
    with torch.no_grad():
        out: torch.Tensor = model(ids)
    return out


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_logits_equal_transformers(ckpts: dict[str, Path], kind: str) -> None:
    cfg = check_checkpoint(ckpts[kind])
    assert cfg.family == "llama" and cfg.tie_embeddings == (kind == "tied") and not cfg.is_moe
    ids = _tokens(0)
    ours, ref = _ours(ckpts[kind], ids), hf_logits(ckpts[kind], ids)
    assert ref.abs().max() > 0.1  # a model that says something
    assert (ours - ref).abs().max().item() <= TOL


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_llama3_rope_scaling_equals_transformers(ckpts: dict[str, Path], tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 10_000.0,
    }
    path = _with_config(ckpts["untied"], tmp_path / "scaled", rope_scaling=scaling, rope_theta=10_000.0)
    assert read_config(path).llama_rope_scaling == (8.0, 1.0, 4.0, 16)
    ids = _tokens(1, (2, 60))  # past the original 16 positions, where the scaling shows
    ours, ref = _ours(path, ids), hf_logits(path, ids)
    assert (ours - ref).abs().max().item() <= TOL
    plain = _ours(ckpts["untied"], ids)
    assert (plain - ref).abs().max().item() > 100 * TOL  # the scaling changed something


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_export_loads_in_transformers_with_the_same_logits(
    ckpts: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    cfg = read_config(ckpts[kind])
    model = initial_model(ModelSettings(hf_path=str(ckpts[kind])))
    with torch.no_grad():  # a changed model, so the export is not the source's bytes again
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ids = _tokens(2)
    with torch.no_grad():
        ours = model(ids)
    for source in (ckpts[kind], None):  # the source's config.json, or one made from the config
        out = save_checkpoint(tmp_path / f"out-{source is None}", state_dict_of(model), cfg, source=source)
        made = json.loads((out / "config.json").read_text())
        assert made["architectures"] == ["LlamaForCausalLM"]
        assert (hf_logits(out, ids) - ours).abs().max().item() <= TOL
        again = initial_model(ModelSettings(hf_path=str(out))) if source is not None else None
        if again is not None:
            assert checksum(again) == checksum(model)  # Q/K permuted there and back exactly


def test_kv_cache_and_packed_rows_equal_the_plain_forward() -> None:
    cfg = get_config("tiny-llama")
    model = build_model(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(x)
        torch.testing.assert_close(cached_logits(model, x, 6), full, rtol=1e-5, atol=1e-5)
        # Both rows packed into one, each at its own positions and seeing only itself.
        packed = model(
            x.reshape(1, 20),
            torch.arange(10).repeat(2)[None],
            PackedMask(torch.tensor([[0] * 10 + [1] * 10])),
        )
        torch.testing.assert_close(packed.reshape(2, 10, -1), full, rtol=1e-5, atol=1e-5)


def test_a_cast_model_keeps_its_rope_table(ckpts: dict[str, Path]) -> None:
    """The table is real (cos, sin) pairs: casting the model keeps it (a complex table would
    lose its imaginary half), and a bf16 copy stays close to the fp32 model."""
    model = initial_model(ModelSettings(hf_path=str(ckpts["untied"])))
    ids = _tokens(4)
    with torch.no_grad():
        ref = model(ids)
        half = model.to(torch.bfloat16)(ids).float()
    ropes = [m for m in model.modules() if isinstance(m, RealPairRoPE)]
    assert len(ropes) == read_config(ckpts["untied"]).n_layers
    for rope in ropes:
        table = rope.cache.float()  # (cos, sin) pairs: each of magnitude 1, sines not dropped
        assert table.shape[-1] == 2 and table[..., 1].abs().max() > 0.5
        torch.testing.assert_close(table.norm(dim=-1), torch.ones(table.shape[:-1]), atol=1e-2, rtol=0)
    assert (half - ref).abs().max().item() < 0.1
    assert (half.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


def test_what_the_family_does_not_compute_is_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    src = ckpts["untied"]
    refused: list[tuple[dict[str, object], str]] = [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ]
    for i, (change, words) in enumerate(refused):
        with pytest.raises(CheckpointError, match=words):
            read_config(_with_config(src, tmp_path / str(i), **change))
    with pytest.raises(ValueError, match="dense"):
        get_config("tiny-llama", num_experts=4, top_k=2, moe_hidden_dim=16)
    with pytest.raises(ValueError, match="family"):
        get_config("tiny-dense", llama_rope_scaling=(8.0, 1.0, 4.0, 16))
