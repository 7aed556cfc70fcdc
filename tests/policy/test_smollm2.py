"""A real pretrained model: SmolLM2-135M-Instruct, imported from the GGUF file of its PyPI
package (`make smollm2`), against transformers on the same files.

Logits are compared in fp32 with an absolute tolerance of 2e-4: they reach ~40 here and pass
through 30 layers whose sums torchtitan's Llama and transformers' add in other orders (measured
max difference 6.4e-5, argmax agreement 100%); a wrong permutation, RoPE or norm moves them by
whole units."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from jetrl.policy.gguf_import import MARKER, GGUFImportError, import_gguf
from jetrl.policy.hf import read_config
from jetrl.policy.hf_tokenizer import HFTokenizer
from jetrl.policy.origin import initial_model
from jetrl.policy.sampling import SamplingConfig, generate
from jetrl.policy.settings import ModelSettings
from tests.support.smollm2 import GGUF, smollm2_dir

transformers = pytest.importorskip("transformers")

TOL = 2e-4


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> Any:  # a transformers LlamaForCausalLM
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(ckpt: Path) -> torch.nn.Module:
    model: torch.nn.Module = initial_model(ModelSettings(hf_path=str(ckpt)))
    model.eval()
    return model


def _prompt(ckpt: Path, question: str) -> list[int]:
    tok = HFTokenizer(ckpt)
    return tok.encode(tok.render_chat([{"role": "user", "content": question}]), bos=False)


def test_the_import_is_a_llama_checkpoint_jetrl_reads(ckpt: Path) -> None:
    cfg = read_config(ckpt)
    shape = (cfg.family, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size)
    assert shape == ("llama", 30, 576, 9, 3, 64, 49152)
    assert cfg.dense_hidden_dim == 1536 and cfg.tie_embeddings and cfg.rope_theta == 100_000.0
    assert cfg.llama_rope_scaling is None
    marker = json.loads((ckpt / MARKER).read_text())
    assert marker["source"] == GGUF.name and len(marker["sha256"]) == 64


def test_the_import_is_done_once_and_never_over_something_else(ckpt: Path, tmp_path: Path) -> None:
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} is not here (JETRL_SMOLLM2 names an import made elsewhere)")
    weights = ckpt / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert import_gguf(GGUF, ckpt) == ckpt  # the same file: nothing is converted again
    assert weights.stat().st_mtime_ns == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match="not empty and not a jetrl import"):
        import_gguf(GGUF, foreign)
    other = tmp_path / "other"
    shutil.copytree(ckpt, other, ignore=shutil.ignore_patterns("*.safetensors"))
    (other / MARKER).write_text(json.dumps({"source": "x.gguf", "bytes": 1, "sha256": "0" * 64}))
    with pytest.raises(GGUFImportError, match="another file"):
        import_gguf(GGUF, other)
    with pytest.raises(GGUFImportError, match="no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_logits_equal_transformers(ckpt: Path, ours: torch.nn.Module, reference: Any) -> None:
    ids = torch.tensor([_prompt(ckpt, "Is 14 even? Answer yes or no.")])
    with torch.no_grad():
        a, b = ours(ids), reference(ids).logits
    assert b.abs().max() > 10  # a pretrained model's confident logits
    assert (a - b).abs().max().item() <= TOL
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_chat_template_and_stops_are_the_models(ckpt: Path) -> None:
    tok = HFTokenizer(ckpt)
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    im_end = tok.encode("<|im_end|>", bos=False)
    assert len(im_end) == 1 and im_end[0] in tok.stop_ids


def test_greedy_generation_equals_transformers(ckpt: Path, ours: torch.nn.Module, reference: Any) -> None:
    """jetrl's sampler (KV cache, fp32) writes what transformers' greedy decoding writes."""
    prompt = _prompt(ckpt, "What is 3 + 4?")
    (gen,) = generate(ours, [prompt], SamplingConfig(max_tokens=12, temperature=0.0))
    ids = torch.tensor([prompt])
    with torch.no_grad():  # the mask given: pad is <|im_end|>, which the prompt holds
        ref = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    assert gen.completion_ids == ref[0, len(prompt) :].tolist()
