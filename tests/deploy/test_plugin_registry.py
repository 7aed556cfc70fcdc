"""The plugin registry is the one way in: a third implementation of each seam (a generation
engine, a train engine, a tokenizer, an environment, a payload store) is one file of
tests/support/plugins plus one registration, an entry point as an installed package declares
it, and a whole run goes through all five, every part its own process."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from jetrl import plugins
from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.payloads import StoreKind
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.inference.engine import GenerationEngine
from jetrl.consumers.inference.settings import InferencePart
from jetrl.consumers.trainer.engine import TrainEngine
from jetrl.consumers.trainer.settings import TrainerPart
from jetrl.deploy.config import ConfigError, load_config
from jetrl.deploy.parts import PartCommands
from jetrl.deploy.supervisor import Supervisor
from jetrl.policy.tokenizer import Tokenizer
from tests.support.plugins import (
    answer_key_engine,
    difference_env,
    digits_tokenizer,
    tally_engine,
    zipped_store,
)
from tests.support.plugins.difference_env import DifferenceEnv
from tests.support.plugins.digits_tokenizer import DigitsTokenizer

# Each plugin against its seam's protocol (the registry loads by name, untyped): mypy checks
# these, so a plugin that drifts from its seam fails `make static` before any run does.
GENERATION: Callable[[InferencePart, str], GenerationEngine] = answer_key_engine.AnswerKeyEngine
TRAIN: Callable[[TrainerPart], TrainEngine] = tally_engine.TallyEngine
TOKENIZER: Callable[[str | None], Tokenizer] = digits_tokenizer.digits_tokenizer
PAYLOAD_STORE: StoreKind = zipped_store.ZippedPayloads

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "tests.support.plugins"

# The registrations: one per plugin (a generation engine's checks, a train engine's launch
# under the same name in the seam's checks group), as a package's entry_points.txt says them.
ENTRY_POINTS = f"""\
[jetrl.generation_engines]
answer-key = {PACKAGE}.answer_key_engine:AnswerKeyEngine
[jetrl.generation_engines.checks]
answer-key = {PACKAGE}.answer_key_engine:CHECKS
[jetrl.train_engines]
tally = {PACKAGE}.tally_engine:TallyEngine
[jetrl.train_engines.checks]
tally = {PACKAGE}.tally_engine:LAUNCH
[jetrl.tokenizers]
digits = {PACKAGE}.digits_tokenizer:digits_tokenizer
[jetrl.environments]
difference = {PACKAGE}.difference_env:DifferenceEnv
[jetrl.payload_stores]
zipped = {PACKAGE}.zipped_store:ZippedPayloads
[jetrl.payload_stores.checks]
zipped = {PACKAGE}.zipped_store:ZippedPayloads
"""

PLUGINS = [
    "--inference.engine",
    "answer-key",
    "--trainer.engine",
    "tally",
    "--model.tokenizer",
    "digits",
    "--envs.0.name",
    "difference",
    "--bus.weights_store",
    "zipped",
]


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's plugins installed as a package is: a distribution's metadata on the path of
    this process and of every part it starts."""
    site = tmp_path / "site"
    dist = site / "jetrl_test_plugins-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: jetrl-test-plugins\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    paths = [str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    return site


def test_each_seam_finds_its_registered_plugin(installed: Path) -> None:
    found = {
        seam.key: (seam.load(name), seam.checks(name))
        for seam, name in [
            (plugins.GENERATION_ENGINES, "answer-key"),
            (plugins.TRAIN_ENGINES, "tally"),
            (plugins.TOKENIZERS, "digits"),
            (plugins.ENVIRONMENTS, "difference"),
            (plugins.PAYLOAD_STORES, "zipped"),
        ]
    }
    assert found == {
        "generation_engines": (answer_key_engine.AnswerKeyEngine, answer_key_engine.CHECKS),
        "train_engines": (tally_engine.TallyEngine, tally_engine.LAUNCH),
        "tokenizers": (digits_tokenizer.digits_tokenizer, None),
        "environments": (difference_env.DifferenceEnv, None),
        "payload_stores": (zipped_store.ZippedPayloads, zipped_store.ZippedPayloads),
    }
    # Built-ins first, then what is installed; a name of neither is refused with both.
    assert plugins.TOKENIZERS.names() == ["char", "hf", "digits"]
    with pytest.raises(ConfigError, match=r"unknown payload store 'nowhere'.*'zipped'"):
        load_config(None, ["--bus.weights_store", "nowhere"])


def test_registered_plugins_are_settings_like_the_built_ins(installed: Path, tmp_path: Path) -> None:
    cfg = load_config(None, PLUGINS)
    # The names are what the run records; each part builds from them.
    assert (cfg.inference.engine, cfg.trainer.engine_name, cfg.model.tokenizer, cfg.envs[0].env_kind) == (
        "answer-key",
        "tally",
        "digits",
        "difference",
    )
    (producer,) = cfg.producer_parts()
    env = plugins.ENVIRONMENTS.load(producer.env.env_kind)(plugins.TOKENIZERS.load("digits")(None))
    assert isinstance(env, DifferenceEnv) and isinstance(env.tok, DigitsTokenizer)
    # The train engine's launch makes the trainer's command.
    argv = PartCommands(cfg, "r", tmp_path / "r", "nats://h:4222").trainer(None).argv
    assert argv[:4] == [sys.executable, "-m", f"{PACKAGE}.tally_engine", "jetrl.consumers.trainer"]
    # Each plugin's checks are asked as a built-in's are.
    with pytest.raises(ConfigError, match="answer-key engine has no model: it serves no checkpoint"):
        load_config(None, [*PLUGINS, "--model.hf_path", str(tmp_path)])
    with pytest.raises(ConfigError, match="the zipped store keeps weights only"):
        load_config(None, [*PLUGINS, "--bus.traces_store", "zipped"])


STEPS = 3


@pytest.mark.slow
async def test_a_run_goes_through_a_third_plugin_of_every_seam(
    installed: Path, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    cfg = load_config(
        None,
        [
            *PLUGINS,
            *("--model.name", "tiny-dense"),  # the engine records no routing: nothing to replay
            *("--trainer.max_steps", str(STEPS), "--trainer.batch_groups", "2"),
            *("--envs.0.group_size", "4", "--store.recorder", "false"),
        ],
    )
    run_id = "plugins1"
    run_dir = tmp_path / run_id
    sup = Supervisor(cfg, run_id, run_dir, nats_url=nats_server.url, quiet=True)
    assert await sup.run() == 0

    bus = await Bus.connect(nats_server.url)
    try:
        log = [i.event for i in await bus.read_log(run_id) if i.event is not None]
    finally:
        await bus.close()
    started = next(e.body for e in log if isinstance(e.body, ev.RunStarted))
    assert started.config["inference"]["engine"] == "answer-key"
    assert started.config["bus"]["weights_store"] == "zipped"
    # The tokenizer and the environment: every task is one of the environment's, written in
    # the digits tokenizer's ids, and the engine (reading them with the same) answered it.
    tok = DigitsTokenizer()
    tasks = [e.body for e in log if isinstance(e.body, ev.TaskSubmitted)]
    assert tasks
    for t in tasks:
        a, b = tok.decode(t.prompt_tokens).removesuffix("=").split("-")
        assert 0 <= int(b) <= int(a) <= 9
    # The train engine: every step trained on rewards of 1, in a process its launch started.
    steps = [e.body for e in log if isinstance(e.body, ev.StepCompleted)]
    assert [s.step for s in steps] == list(range(STEPS))
    assert all(s.metrics["reward_mean"] == 1.0 and s.metrics["tally_launched"] == 1.0 for s in steps)
    # The payload store: every version's weights went to it, and the workers read them back.
    ready = [e.body for e in log if isinstance(e.body, ev.WeightsReady)]
    assert {r.version for r in ready} == set(range(STEPS + 1))
    assert {r.location.store for r in ready} == {"zipped"}
    assert list((run_dir / "payloads" / "zipped").rglob("weights-v*.z"))
    loaded = {e.body.version for e in log if isinstance(e.body, ev.WeightsLoaded)}
    assert 0 in loaded and loaded <= set(range(STEPS + 1))
