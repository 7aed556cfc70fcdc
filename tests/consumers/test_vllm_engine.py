"""The vLLM engine against real vLLM (its CPU build, in .venv-vllm): a server started by the
engine on a tiny Hugging Face checkpoint made on the spot, checked against jetrl's own model on
the same files (fp32): sampled-token logprobs, stops, and live weight updates; and a worker
stopped while its server starts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import torch

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.identity import cancel_and_wait
from jetrl.bus.payloads import FilePayloads, PayloadIntegrityError, Payloads
from jetrl.consumers.inference.engine import GroupRequest, Sample
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings, VLLMSettings
from jetrl.consumers.inference.vllm_engine import VLLMEngine, vllm_available
from jetrl.consumers.inference.worker import InferenceWorker
from jetrl.deploy.tiny_hf_cmd import make_checkpoint
from jetrl.policy.hf import read_config
from jetrl.policy.hf_tokenizer import HFTokenizer
from jetrl.policy.origin import initial_model
from jetrl.policy.settings import ModelSettings
from jetrl.policy.weights import ChecksumMismatch, export_weights, weights_to_bytes
from tests.support.forwards import logprob_gap
from tests.support.processes import vllm_processes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM environment (make vllm-venv)"),
]

# fp32 on both sides; vLLM's CPU kernels sum in other orders than torch's.
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("vllm") / "moe", "moe", seed=5)


def _part(ckpt: Path) -> InferencePart:
    settings = VLLMSettings(
        gpu_memory_utilization=0.08, max_model_len=512, enforce_eager=True, max_num_seqs=32
    )
    return InferencePart(
        inference=InferenceSettings(engine="vllm", precision="fp32", vllm=settings),
        model=ModelSettings(hf_path=str(ckpt)),
    )


@pytest.fixture(scope="module")
async def engine(ckpt: Path) -> AsyncIterator[VLLMEngine]:
    assert not vllm_processes(), "vLLM processes left from before"
    e = VLLMEngine(_part(ckpt), "test-worker")
    yield e
    await e.close()
    assert e.proc.returncode is not None
    assert not vllm_processes(), "vLLM processes outlived the engine"


def _prompts(ckpt: Path) -> list[list[int]]:
    tok = HFTokenizer(ckpt)
    qs = ["What is 3 + 4?", "Ann has 12 apples and buys 7 more. How many apples?", "2 * 8 ="]
    return [tok.encode(tok.render_chat([{"role": "user", "content": q}]), bos=False) for q in qs]


def _max_logprob_gap(model: torch.nn.Module, prompt: list[int], samples: list[Sample]) -> float:
    return max(logprob_gap(model, prompt, s.completion_tokens.tolist(), s.logprobs) for s in samples)


async def _generate(
    engine: VLLMEngine, ckpt: Path, **kw: object
) -> tuple[list[list[int]], list[list[Sample]]]:
    prompts = _prompts(ckpt)
    args = {"n": 4, "max_tokens": 12, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": ()} | kw
    groups = [GroupRequest(prompt_tokens=p, **args) for p in prompts]  # type: ignore[arg-type]
    return prompts, await engine.generate(groups)


async def test_logprobs_match_jetrls_model_on_the_same_checkpoint(engine: VLLMEngine, ckpt: Path) -> None:
    model = initial_model(ModelSettings(hf_path=str(ckpt)))
    prompts, out = await _generate(engine, ckpt)
    assert [len(g) for g in out] == [4, 4, 4]
    for p, samples in zip(prompts, out, strict=True):
        assert all(len(s.completion_tokens) == 12 and s.finish_reason == "length" for s in samples)
        assert all(s.logprobs.dtype.name == "float32" and (s.logprobs <= 0).all() for s in samples)
        assert _max_logprob_gap(model, p, samples) <= TOL
    # Samples of one group differ (n draws, not one repeated).
    assert len({tuple(s.completion_tokens.tolist()) for s in out[0]}) > 1


async def test_stop_ids_end_a_completion_with_the_stop_token(engine: VLLMEngine, ckpt: Path) -> None:
    stops = tuple(range(0, 512, 3))  # a third of the vocabulary: most samples stop early
    _, out = await _generate(engine, ckpt, max_tokens=24, stop_token_ids=stops)
    samples = [s for g in out for s in g]
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, "no sample hit a stop id"
    for s in samples:
        ids = s.completion_tokens.tolist()
        assert not set(ids[:-1]) & set(stops)
        if s.finish_reason == "stop":
            assert ids[-1] in stops
        else:
            assert len(ids) == 24


async def test_routing_traces_equal_jetrls_router_on_the_same_tokens(engine: VLLMEngine, ckpt: Path) -> None:
    """vLLM's traces (from its gates) against jetrl's capture on a forward of the same tokens:
    the same experts wherever vLLM computed the same numbers (fp32; a near tie may flip)."""
    from jetrl.policy.routing import capture_routing

    model = initial_model(ModelSettings(hf_path=str(ckpt)))
    prompts, out = await _generate(engine, ckpt)
    rows = same = 0
    for p, samples in zip(prompts, out, strict=True):
        for s in samples:
            trace = s.routing_trace
            ids = s.completion_tokens.tolist()
            assert trace is not None and trace.dtype.name == "uint8"
            assert trace.shape == (len(p) + len(ids) - 1, 2, 2)
            with torch.no_grad(), capture_routing(model) as cap:
                model(torch.tensor([p + ids[:-1]]))
                ours = cap.take()[0]
            mine = torch.from_numpy(trace.astype("int64")).sort(-1).values
            theirs = ours.long().sort(-1).values
            rows += mine.shape[0] * mine.shape[1]
            same += int((mine == theirs).all(-1).sum())
    assert same / rows >= 0.99, f"{same} of {rows} (token, layer) choices agree"


# Last: it changes the server's weights.
async def test_weights_update_in_place_and_match_the_new_version(
    engine: VLLMEngine, ckpt: Path, bus: Bus, run_id: str, tmp_path: Path
) -> None:
    cfg = read_config(ckpt)
    model = initial_model(ModelSettings(hf_path=str(ckpt)))
    files = FilePayloads(tmp_path, "w")
    payloads = Payloads((await Payloads.for_run(bus.js, run_id)).default, files)
    shm_before = set(engine.shm_dir.glob("jetrl-weights-*"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    # Hugging Face layout, then jetrl's, announced as before the transfer digest (the bytes'
    # SHA-256 and the content checksum recomputed); then as the trainer announces them now:
    # received into shared memory, checked against the digest as they land, loaded as views.
    for version, layout in ((1, cfg), (2, None), (3, cfg), (4, None)):
        with torch.no_grad():
            model.lm_head.weight.mul_(1.25)
        if version <= 2:
            data, digest = weights_to_bytes(model, {"version": str(version)}, hf_config=layout)
            ref = await payloads.default.put(f"weights-v{version}", data)
            ready = ev.WeightsReady(version=version, location=ref, weights_checksum=digest)
        else:
            exported = export_weights(model, {"version": str(version)}, hf_config=layout)
            ref = await files.put(f"weights-v{version}", exported.data, sha256=False)
            ready = ev.WeightsReady(
                version=version, location=ref, weights_checksum=exported.checksum, blake3=exported.blake3
            )
        await engine.load_weights(ready, payloads)
        assert engine.loaded_version == version
        prompts, out = await _generate(engine, ckpt)
        assert max(_max_logprob_gap(model, p, g) for p, g in zip(prompts, out, strict=True)) <= TOL
    # Weights whose checksum does not match are refused; the engine keeps what it had.
    data, _ = weights_to_bytes(model)
    ref = await payloads.default.put("weights-v5", data)
    with pytest.raises(ChecksumMismatch):
        await engine.load_weights(
            ev.WeightsReady(version=5, location=ref, weights_checksum="0" * 64), payloads
        )
    # So are bytes changed on their way (one bit, in the middle), and bytes of another version.
    exported = export_weights(model, {"version": "6"}, hf_config=cfg)
    ref = await files.put("weights-v6", exported.data, sha256=False)
    ready = ev.WeightsReady(
        version=6, location=ref, weights_checksum=exported.checksum, blake3=exported.blake3
    )
    bad = bytearray(exported.data)
    bad[len(bad) // 2] ^= 0x10
    (tmp_path / "w" / "weights-v6").write_bytes(bad)
    with pytest.raises(PayloadIntegrityError, match="BLAKE3"):
        await engine.load_weights(ready, payloads)
    (tmp_path / "w" / "weights-v6").write_bytes(exported.data)
    with pytest.raises(ChecksumMismatch):
        await engine.load_weights(msgspec.structs.replace(ready, weights_checksum="1" * 64), payloads)
    assert engine.loaded_version == 4
    assert set(engine.shm_dir.glob("jetrl-weights-*")) == shm_before  # nothing left in memory


async def test_a_worker_stopped_while_its_server_starts_stops_there_and_takes_the_server_down(
    ckpt: Path, bus: Bus, run_id: str
) -> None:
    """A stop that comes while the worker's first load waits for its vLLM server to start ends
    that wait (it used to last until the server was up: a supervisor stopping the run killed
    the worker 15 s after asking)."""
    payloads = await Payloads.for_run(bus.js, run_id)
    data, digest = weights_to_bytes(initial_model(ModelSettings(hf_path=str(ckpt))), {"version": "0"})
    ref = await payloads.default.put("weights-v0", data)
    ready = ev.WeightsReady(version=0, location=ref, weights_checksum=digest)
    await bus.publish(ev.new_event(ready, run_id=run_id))
    worker = InferenceWorker(bus, run_id, "stopped-worker", _part(ckpt))
    engine = worker.engine
    assert isinstance(engine, VLLMEngine)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        async with asyncio.timeout(120):
            while engine._session is None:  # the load has read the weights: it waits for the server
                await asyncio.sleep(0.05)
            assert not engine._ready
            stop.set()
            await running
    finally:
        await cancel_and_wait(running)
        await engine.close()
    assert not engine._ready and worker.loaded_version is None  # stopped before the server was up
    assert engine.proc.returncode is not None  # the server's reaper went with the worker
