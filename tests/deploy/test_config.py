"""Run configs: TOML, overrides, validation, and the per-process settings derived from them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jetrl.deploy.config import ConfigError, apply_overrides, load_config
from jetrl.deploy.run_cmd import split_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_demo_config_loads_and_derives_settings(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "demo.toml")
    t = cfg.trainer_part(tmp_path)
    assert t.model.name == cfg.model.name and t.seed == cfg.run.seed
    assert t.trainer.max_off_policy_steps == cfg.trainer.max_off_policy_steps
    (p,) = cfg.producer_parts()
    assert p.groups_per_step == cfg.trainer.batch_groups
    assert p.max_off_policy_steps == cfg.trainer.max_off_policy_steps
    assert cfg.inference_part(tmp_path).inference.precision == "auto"


CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def _names_a_checkpoint(path: Path) -> bool:
    return bool(tomllib.loads(path.read_text()).get("model", {}).get("hf_path"))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from jetrl.deploy.tiny_hf_cmd import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("hf") / "tiny", "moe")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path: Path, tiny_checkpoint: Path) -> None:
    # A config that names a checkpoint is checked against one (the real weights are not here):
    # everything but the architecture is the shipped config's.
    over = ["--model.hf_path", str(tiny_checkpoint)] if _names_a_checkpoint(path) else []
    cfg = load_config(path, over)
    assert len(cfg.producer_parts()) == len(cfg.envs)  # every part derives from it


def test_a_config_naming_a_missing_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        load_config(ROOT / "configs" / "hf-tiny.toml", ["--model.hf_path", str(tmp_path / "nothing")])


def test_overrides_parse_toml_literals_and_list_indices() -> None:
    data = {"trainer": {"lr": 1.0}, "envs": [{"name": "modsum"}]}
    apply_overrides(
        data,
        [
            "--trainer.lr",
            "0.01",
            "--envs.0.group_size=8",
            "--run.name",
            "abc",
            "--store.recorder",
            "false",
            "--envs.0.params",
            "{ modulus = 7 }",
        ],
    )
    assert data == {
        "trainer": {"lr": 0.01},
        "envs": [{"name": "modsum", "group_size": 8, "params": {"modulus": 7}}],
        "run": {"name": "abc"},
        "store": {"recorder": False},
    }


def test_bad_configs_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nlr = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="lrr"):
        load_config(None, ["--trainer.lrr", "1"])  # unknown keys are refused, not ignored
    with pytest.raises(ConfigError, match="batch_groups"):
        load_config(None, ["--trainer.batch_groups", "0"])
    with pytest.raises(ConfigError, match="subject token"):
        load_config(None, ["--envs.0.tenant", "a.b"])
    with pytest.raises(ConfigError, match="needs a value"):
        load_config(None, ["--trainer.lr"])


def test_env_shares_split_the_batch() -> None:
    cfg = load_config(None, ["--trainer.batch_groups", "8"])
    cfg.envs.append(cfg.envs[0].model_copy(update={"name": "sort", "share": 3.0}))
    groups = [p.groups_per_step for p in cfg.producer_parts()]
    assert groups == [2, 6]


def test_cli_splits_overrides_from_flags() -> None:
    own, over = split_overrides(
        ["run", "c.toml", "--run-id", "x", "--trainer.lr", "0.1", "--envs.0.name=sort"]
    )
    assert own == ["run", "c.toml", "--run-id", "x"]
    assert over == ["--trainer.lr", "0.1", "--envs.0.name=sort"]


def test_loading_any_shipped_config_imports_no_torch() -> None:
    # Settings live in torch-free modules: reading and validating a config (as `jetrl run` does
    # before any process starts, and `jetrl replay` does with a recorded one) needs no torch.
    code = (
        "import sys, pathlib\n"
        "from jetrl.deploy.config import RunConfig, load_config\n"
        f"for p in sorted(pathlib.Path({str(ROOT / 'configs')!r}).glob('*.toml')):\n"
        "    if 'hf_path' in p.read_text():\n"
        "        continue  # checking a checkpoint reads it with torch\n"
        "    cfg = load_config(p)\n"
        "    RunConfig.model_validate(cfg.model_dump(mode='json'))\n"
        "    cfg.trainer_part(pathlib.Path('x')), cfg.inference_part(pathlib.Path('x'))\n"
        "    cfg.producer_parts()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchtitan')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-2000:]
