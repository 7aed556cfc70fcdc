"""`jetrl run configs/smollm2-parity.toml` on the real SmolLM2-135M-Instruct (`make smollm2`),
one short run that every test of the module reads: its own tokenizer and chat template write
the prompts; the inference worker serves the imported folder with vLLM (its CPU build) where
`make vllm-venv` installed it, and vLLM's logprobs equal jetrl's model on the same tokens at
every version it served (weights updated in place, tied embeddings included); the held-out split
is evaluated at version 0 (the pretrained baseline); the last version exports to a checkpoint
transformers and vLLM load with jetrl's numbers; and the gateway answers the official `openai`
client from the trained policy, as transformers answers from the export.
Kept to two small steps: a step of the 135M model takes seconds on two cores."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.inference.engine import GroupRequest
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings, VLLMSettings
from jetrl.consumers.inference.vllm_engine import VLLMEngine, vllm_available
from jetrl.consumers.inference.worker import InferenceWorker
from jetrl.deploy.config import load_config
from jetrl.deploy.export_cmd import export
from jetrl.deploy.gateway_cmd import run_tokenizer
from jetrl.deploy.supervisor import Supervisor
from jetrl.policy.hf_tokenizer import HFTokenizer
from jetrl.policy.origin import initial_model, model_config_of
from jetrl.policy.settings import ModelSettings
from jetrl.policy.weights import load_into, weights_from_bytes
from jetrl.producers.gateway import ChatGateway, GatewaySettings
from tests.support.forwards import logprob_gap
from tests.support.processes import vllm_processes
from tests.support.runlog import bodies, read_log, samples
from tests.support.smollm2 import smollm2_dir
from tests.support.supervised import supervised

# The module's run is made in the first test's set-up: 75-79 s in the suite on a 2-core
# Xeon, 206 s on a 2-core AMD EPYC. RUN_BOUND_S is the bound meant to fire: it stops the run
# and its vLLM server before the test fails.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RUN_BOUND_S = 600

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
VLLM = vllm_available()
needs_vllm = pytest.mark.skipif(not VLLM, reason="no vLLM environment (make vllm-venv)")
# vLLM's small footprint on a CPU: its KV cache, no graph capture.
VLLM_SETTINGS = VLLMSettings(
    gpu_memory_utilization=0.08, max_model_len=512, enforce_eager=True, max_num_seqs=16
)
# fp32 on both sides through 30 layers; vLLM's CPU kernels sum in other orders than torch's.
LOGPROB_TOL = 1e-4
LOGIT_TOL = 2e-4  # jetrl against transformers, as tests/policy/test_smollm2.py


@dataclass
class SmolRun:
    url: str
    run_id: str
    run_dir: Path
    ckpt: Path
    log: list[ev.Event]
    export: Path
    weights: dict[int, dict[str, torch.Tensor]]  # version -> jetrl's tensors, as the log holds them

    def model_at(self, version: int) -> torch.nn.Module:
        model: torch.nn.Module = initial_model(ModelSettings(hf_path=str(self.ckpt)))
        load_into(model, self.weights[version])
        model.eval()
        return model


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
async def smol(nats_server: EmbeddedServer, ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> SmolRun:
    engine = [
        "--inference.engine=vllm",
        f"--inference.vllm.gpu_memory_utilization={VLLM_SETTINGS.gpu_memory_utilization}",
        f"--inference.vllm.max_model_len={VLLM_SETTINGS.max_model_len}",
        "--inference.vllm.enforce_eager=true",
    ]
    cfg = load_config(
        ROOT / "configs" / "smollm2-parity.toml",
        [
            f"--model.hf_path={ckpt}",
            f"--trainer.max_steps={STEPS}",
            "--trainer.batch_groups=1",
            "--trainer.checkpoint_every=0",
            "--envs.0.eval_every=100",  # version 0 only: the pretrained baseline
            "--envs.0.eval_tasks=4",
            "--envs.0.eval_samples=1",
            "--envs.0.group_size=4",
            *(engine if VLLM else []),
        ],
    )
    run_id = "smol1"
    tmp = tmp_path_factory.mktemp("smol")
    run_dir = tmp / run_id
    assert not vllm_processes(), "vLLM processes left from before"
    sup = Supervisor(cfg, run_id, run_dir, nats_url=nats_server.url, quiet=True)
    async with supervised(sup) as run, asyncio.timeout(RUN_BOUND_S):
        assert await run == 0
    assert not vllm_processes(), "vLLM processes outlived the run"
    log = await read_log(nats_server.url, run_id)
    out = tmp / "export"
    assert await export(nats_server.url, run_id, run_dir, None, out, None) == 0
    mcfg = model_config_of(ModelSettings(hf_path=str(ckpt)))
    weights = {}
    bus = await Bus.connect(nats_server.url)
    try:
        payloads = await Payloads.for_run(bus.js, run_id, weights_dir=run_dir / "payloads")
        for w in bodies(log, ev.WeightsReady):
            data = await payloads.get_weights(w)
            weights[w.version], _ = weights_from_bytes(
                data, expected_checksum=w.weights_checksum, model_cfg=mcfg
            )
    finally:
        await bus.close()
    return SmolRun(nats_server.url, run_id, run_dir, ckpt, log, out, weights)


async def test_every_rollout_is_trained_once_and_the_baseline_evaluated(smol: SmolRun) -> None:
    steps = bodies(smol.log, ev.StepCompleted)
    assert [s.step for s in steps] == list(range(STEPS))
    trained = Counter(rid for s in steps for rid in s.rollout_ids)
    assert len(trained) == STEPS * 4 and all(n == 1 for n in trained.values())
    assert not bodies(smol.log, ev.DeadLettered)
    assert bodies(smol.log, ev.RunFinished)[-1].status == "completed"
    evals = bodies(smol.log, ev.EvaluationReported)
    assert [e.policy_version for e in evals] == [0] and evals[0].n_tasks == 4
    assert sorted(smol.weights) == list(range(STEPS + 1))


async def _arrays(
    smol: SmolRun, gens: list[tuple[ev.CompletionsGenerated, ev.Completion]]
) -> list[tuple[list[int], list[int], Any]]:
    """(prompt, completion, logprobs) of each sample: its prompt read where it lies (its task)."""
    bus = await Bus.connect(smol.url)
    try:
        payloads = await Payloads.for_run(bus.js, smol.run_id, weights_dir=smol.run_dir / "payloads")
        out = []
        for g, smp in gens:
            prompt = (await payloads.get_array(g.prompt_tokens)).tolist()
            completion = (await payloads.get_array(smp.completion_tokens)).tolist()
            out.append((prompt, completion, await payloads.get_array(smp.logprobs)))
        return out
    finally:
        await bus.close()


async def test_prompts_and_completions_are_the_models_own(smol: SmolRun) -> None:
    tok = HFTokenizer(smol.ckpt)
    tasks = [t for t in bodies(smol.log, ev.TaskSubmitted) if not ids.is_eval_task(t.task_id)]
    assert tasks and all(t.prompt_text.startswith("<|im_start|>") for t in tasks)
    assert all(t.prompt_text.endswith("<|im_start|>assistant\n") for t in tasks)
    assert all(t.prompt_tokens == tok.encode(t.prompt_text, bos=False) for t in tasks)
    gens = samples(smol.log)[:4]
    texts = [tok.decode(completion) for _, completion, _ in await _arrays(smol, gens)]
    assert any(any(c.isalpha() for c in t) for t in texts), texts  # words, from a pretrained model


@needs_vllm
async def test_vllms_logprobs_equal_jetrls_model_at_every_version_it_served(smol: SmolRun) -> None:
    """The behaviour logprobs in the log, from vLLM serving the imported folder and then each
    version loaded in place, against jetrl's model at that version on the same tokens."""
    gens = [(g, s) for g, s in samples(smol.log) if g.policy_version_start == g.policy_version_end]
    by_version: dict[int, list[tuple[ev.CompletionsGenerated, ev.Completion]]] = {}
    for g, s in gens:
        by_version.setdefault(g.policy_version_end, []).append((g, s))
    # Version 0 is the imported checkpoint as vLLM read it; version 1 came in place, as bytes.
    assert {0, 1} <= set(by_version), sorted(by_version)
    for version, group in sorted(by_version.items()):
        model = smol.model_at(version)
        for prompt, completion, logprobs in await _arrays(smol, group[:3]):
            assert logprob_gap(model, prompt, completion, logprobs) <= LOGPROB_TOL, version


def test_the_export_loads_in_transformers_with_jetrls_logits(smol: SmolRun) -> None:
    from transformers import AutoModelForCausalLM

    ours = smol.model_at(STEPS)
    ref = AutoModelForCausalLM.from_pretrained(str(smol.export), dtype=torch.float32)
    task = next(t for t in bodies(smol.log, ev.TaskSubmitted) if not ids.is_eval_task(t.task_id))
    x = torch.tensor([task.prompt_tokens])
    with torch.no_grad():
        assert (ours(x) - ref(x).logits).abs().max().item() <= LOGIT_TOL
    template = (smol.export / "tokenizer_config.json").read_text()
    assert (smol.export / "chat_template.jinja").is_file() or "chat_template" in template


@needs_vllm
async def test_the_export_serves_in_vllm_with_jetrls_logprobs(smol: SmolRun) -> None:
    part = InferencePart(
        inference=InferenceSettings(engine="vllm", precision="fp32", vllm=VLLM_SETTINGS),
        model=ModelSettings(hf_path=str(smol.export)),
    )
    tok = HFTokenizer(smol.export)
    prompts = [
        tok.encode(tok.render_chat([{"role": "user", "content": q}]), bos=False)
        for q in ("Is 418 even? Answer yes or no.", "Is 77 an odd number? Answer yes or no.")
    ]
    engine = VLLMEngine(part, "export-check")
    try:
        groups = [
            GroupRequest(p, n=2, max_tokens=8, temperature=1.0, top_p=1.0, stop_token_ids=()) for p in prompts
        ]
        out = await engine.generate(groups)
    finally:
        await engine.close()
    model = smol.model_at(STEPS)
    for p, generated in zip(prompts, out, strict=True):
        assert len(generated) == 2
        for s in generated:
            assert logprob_gap(model, p, s.completion_tokens.tolist(), s.logprobs) <= LOGPROB_TOL


@contextlib.asynccontextmanager
async def _serving(smol: SmolRun) -> AsyncIterator[ChatGateway]:
    """The finished run's last policy, served again: one embedded-engine worker that loads the
    newest weights in the log, and the gateway in front of it."""
    bus = await Bus.connect(smol.url, name="smol-gateway")
    part = InferencePart(
        inference=InferenceSettings(precision="fp32"),
        model=ModelSettings(hf_path=str(smol.ckpt)),
        weights_dir=str(smol.run_dir / "payloads"),
    )
    stop = asyncio.Event()
    worker = asyncio.create_task(InferenceWorker(bus, smol.run_id, "gateway-inf", part).run(stop))
    settings = GatewaySettings(port=0, max_tokens=16, timeout_s=120)
    gw = ChatGateway(bus, smol.run_id, settings, await run_tokenizer(bus, smol.run_id))  # as `jetrl gateway`
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()
        stop.set()
        await asyncio.wait_for(worker, 60)
        await bus.close()


def _greedy_from_export(export: Path, messages: list[Any], max_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(export))
    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    x = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**x, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return str(tok.decode(out[0, x["input_ids"].shape[1] :], skip_special_tokens=True))


async def test_the_gateway_answers_the_openai_client_from_the_trained_policy(smol: SmolRun) -> None:
    from openai import AsyncOpenAI

    messages: list[Any] = [{"role": "user", "content": "Is 418 even? Answer yes or no."}]
    async with _serving(smol) as gw:
        client = AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0)
        reply = await client.chat.completions.create(
            model="jetrl",
            messages=messages,
            temperature=0,
            max_tokens=12,
        )
    assert reply.model_extra is not None
    assert reply.model_extra["jetrl"]["policy_version"] == STEPS  # the trained policy, not the import
    content = reply.choices[0].message.content
    assert content and content == _greedy_from_export(smol.export, messages, 12)


@pytest.fixture(autouse=True)
def _no_stray_vllm() -> Iterator[None]:
    yield
    assert not vllm_processes(), "a vLLM process outlived its test"
