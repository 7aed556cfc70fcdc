"""vLLM behind the generation-engine seam: each worker runs a vLLM OpenAI-compatible server as
its child process and drives it token in, token out.

Why a server and not vLLM in the worker's process: vLLM pins its own torch-adjacent stack
(transformers, triton, its CPU or CUDA kernels) and is installed in an environment of its own
(``.venv-vllm`` on CPU, the GPU image in a cluster); the worker stays in jetrl's, and a vLLM crash
is a child's exit, not the worker's. The server is reached on loopback only.

* **Generation.** One ``/v1/completions`` request per group, all of a batch's groups at once (vLLM
  batches them itself): the prompt as token ids, ``n`` samples (vLLM forks them after one
  prefill, so the prompt is computed once per group), temperature, top-p, max tokens and stop
  token ids one to one (only those: not also the model's EOS); the server's sampler is seeded
  from the run seed and the worker id. Out: the completion's token ids (``return_token_ids``), each sampled
  token's logprob under the distribution it was drawn from (``--logprobs-mode
  processed_logprobs``: after temperature and top-p, as the embedded engine reports; 0 at
  temperature 0), and the finish reason.
* **Weights.** The worker hands the engine up to ``batches_in_flight`` batches at once and loads a
  WeightsReady only when none is in flight, so requests always finish on the version they
  started on (none is aborted). The bytes are received straight into a file in shared memory
  (``/dev/shm``: memory, not disk), checked against their transfer digest as they land, and
  loaded in place through the server's ``/collective_rpc`` by jetrl's worker extension
  (``vllm_ext/jetrl_vllm_ext.py``), which maps the file and hands vLLM views of its tensors:
  no copy between the received bytes and vLLM's own weights. Bytes in jetrl's layout (a trainer
  without ``weights_layout = "hf"``) get a Hugging Face layout copy beside them first.
* **Routing traces** for Router Replay (MoE): vLLM's own ``--enable-return-routed-experts``
  needs Triton's GPU backend, so jetrl's worker extension hooks each MoE gate and records every
  computed position's top-k experts per request; the engine takes a group's routes after its
  request and lays them out as the embedded engine does (``[P + C - 1, moe_layers, top_k]``).
  Capturing turns vLLM's prefix cache off: a prefix served from the cache is not computed, so it
  has no routes. ``[inference.vllm] capture_routing = false`` keeps the cache and sends no traces
  (then the trainer needs ``replay = false``).

The server runs under ``vllm_ext/jetrl_vllm_reaper.py``, which takes its whole process group
(vLLM's engine core and workers) down when the engine closes, when the worker dies (even
SIGKILLed) or when the server exits. It prints to ``vllm.log`` in the engine's scratch directory,
where vLLM's sockets are too; its tail is in any error. The folder goes when the engine closes,
or with the reaper when the worker was killed.

What the run config checks before any process starts is :data:`CHECKS`' (registered with the
engine, jetrl/plugins.py); this module imports no torch until an engine is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import mmap
import os
import random
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import aiohttp
import numpy as np

from jetrl.bus import events as ev
from jetrl.bus.log import get_logger
from jetrl.bus.payloads import Payloads
from jetrl.bus.server import free_port
from jetrl.consumers.inference.engine import EngineChecks, FinishReason, GroupRequest, Limits, Sample
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings, VLLMSettings
from jetrl.policy.settings import ModelSettings

EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
EXTENSION = "jetrl_vllm_ext.RoutingExtension"
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# Runs the server in a process group of its own and takes the group (vLLM's engine core and
# workers included) down when told to, when the worker dies (even SIGKILLed), or when it exits.
REAPER = EXTENSION_DIR / "jetrl_vllm_reaper.py"


class VLLMError(RuntimeError):
    pass


def start_reaped(
    cmd: Sequence[str], env: dict[str, str] | None = None, out: Any = None
) -> subprocess.Popen[bytes]:
    """``cmd`` under the reaper. The reaper gets a session of its own: a part that does not stop
    in time is SIGKILLed with its whole process group, and a reaper in that group would die
    with it, leaving the server's group (its own session) running with no one to take it down;
    outside it, the reaper sees its parent die and takes the server's group down."""
    return subprocess.Popen(
        [cmd[0], str(REAPER), *cmd], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def vllm_python(s: VLLMSettings) -> Path:
    """The Python that runs vLLM: the setting, $JETRL_VLLM_PYTHON, or .venv-vllm next to the
    working directory or the repository."""
    named = s.python or os.environ.get("JETRL_VLLM_PYTHON")
    if named:
        return Path(named)
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = root / ".venv-vllm" / "bin" / "python"
        if candidate.exists():
            return candidate
    raise VLLMError(
        "no vLLM environment: set [inference.vllm] python or $JETRL_VLLM_PYTHON, or run `make vllm-venv`"
    )


def vllm_available(s: VLLMSettings | None = None) -> bool:
    """Whether a vLLM environment is there to run (tests and benches skip without one)."""
    try:
        return vllm_python(s or VLLMSettings()).exists()
    except VLLMError:
        return False


class VLLMChecks(EngineChecks):
    """``engine = "vllm"`` serves a checkpoint, from a vLLM environment on this machine, and sends
    routing traces unless ``capture_routing`` is off."""

    def check(self, inference: InferenceSettings, model: ModelSettings) -> None:
        if not model.hf_path:
            raise ValueError("[inference] engine = 'vllm' serves a checkpoint: set [model] hf_path")

    def check_here(self, inference: InferenceSettings) -> None:
        if not vllm_python(inference.vllm).exists():
            raise ValueError(f"no vLLM environment at {vllm_python(inference.vllm)}")

    def no_routing(self, inference: InferenceSettings) -> str | None:
        if inference.vllm.capture_routing:
            return None
        return "[inference.vllm] capture_routing = false sends no routing traces"


CHECKS = VLLMChecks()


def vllm_precision(s: InferenceSettings) -> Literal["bf16", "fp32"]:
    """The settings' precision for the server's device (``auto``: bf16 on a GPU that has it)."""
    from jetrl.policy.sampling import resolve_precision  # torch: here only, as below

    return resolve_precision(s.precision)


def server_command(part: InferencePart, port: int, seed: int, *, capture: bool = False) -> list[str]:
    s, v = part.inference, part.inference.vllm
    assert part.model.hf_path
    cmd = [
        str(vllm_python(v)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(Path(part.model.hf_path).resolve()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        DTYPES[vllm_precision(s)],
        "--seed",
        str(seed),
        "--gpu-memory-utilization",
        str(v.gpu_memory_utilization),
        "--tensor-parallel-size",
        str(v.tensor_parallel_size),
        "--max-num-seqs",
        str(v.max_num_seqs),
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        EXTENSION,
    ]
    if v.max_model_len:
        cmd += ["--max-model-len", str(v.max_model_len)]
    if v.enable_expert_parallel:
        cmd.append("--enable-expert-parallel")
    if v.quantization:
        cmd += ["--quantization", v.quantization]
    if v.enforce_eager:
        cmd.append("--enforce-eager")
    # Routes are captured as positions are computed: a prefix served from the cache has none.
    caching = v.enable_prefix_caching and not capture
    cmd.append("--enable-prefix-caching" if caching else "--no-enable-prefix-caching")
    return cmd + list(v.extra_args)


def shared_memory_dir(fallback: Path) -> Path:
    """Where weights are handed to vLLM's workers: /dev/shm (memory) where there is one to
    write to, else ``fallback``."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else fallback


class SharedFile:
    """A file, mapped into this process, that the bytes of one weights version are received
    into and another process maps in turn (it lives in memory when under /dev/shm)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None

    def create(self, size: int) -> memoryview:
        with self.path.open("w+b") as f:
            f.truncate(size)
            if size == 0:
                return memoryview(bytearray())
            self._map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_WRITE)
        return memoryview(self._map)

    def remove(self) -> None:
        """Unlink the file (the memory goes with the last mapping). The mapping is closed when
        nothing holds a view of it any more; a read abandoned into it keeps it for good."""
        self.path.unlink(missing_ok=True)
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


HEALTH_CHECK_TIMEOUT = aiohttp.ClientTimeout(total=10)


class VLLMEngine:
    # The worker hands it this many batches at once: vLLM batches continuously, so a batch that
    # arrives while another generates joins it instead of waiting for it to end.
    batches_in_flight = 4

    def __init__(self, part: InferencePart, worker_id: str) -> None:
        if not part.model.hf_path:
            raise VLLMError("the vLLM engine serves a Hugging Face checkpoint: set [model] hf_path")
        from jetrl.policy.origin import model_config_of

        self.part = part
        self.mcfg = model_config_of(part.model)
        served = part.inference.vllm.max_model_len  # what the server takes, when set
        context = min(self.mcfg.max_seq_len, served) if served else self.mcfg.max_seq_len
        self.limits: Limits | None = Limits(self.mcfg.vocab_size, context)
        self.log = get_logger(__name__, worker_id=worker_id)
        self.scratch = Path(tempfile.mkdtemp(prefix="jetrl-vllm-"))
        self.shm_dir = shared_memory_dir(self.scratch)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_name = str(Path(part.model.hf_path).resolve())
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",  # exposes /collective_rpc, on loopback only
            "PYTHONPATH": os.pathsep.join([str(EXTENSION_DIR), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # vLLM's processes talk over Unix sockets it names in the temp folder and never
            # removes: in the scratch folder, they go when the engine closes.
            "VLLM_RPC_BASE_PATH": str(self.scratch),
            "JETRL_VLLM_SCRATCH": str(self.scratch),  # the reaper removes it if this worker dies
        }
        env.pop("VIRTUAL_ENV", None)
        self.log_path = self.scratch / "vllm.log"
        # The server samples from one stream, reproducible from the run seed and the worker id.
        seed = random.Random(f"{part.seed}/{uuid.uuid5(uuid.NAMESPACE_URL, worker_id)}").getrandbits(31)
        self.capture = self.mcfg.is_moe and part.inference.vllm.capture_routing
        cmd = server_command(part, self.port, seed, capture=self.capture)
        self.log.info("vllm_starting", cmd=" ".join(cmd), log=str(self.log_path))
        self._log_file = self.log_path.open("wb")
        self.proc = start_reaped(cmd, env, self._log_file)
        self._session: aiohttp.ClientSession | None = None
        self._starting = asyncio.Lock()
        self._ready = False
        self._version: int | None = None

    @property
    def loaded_version(self) -> int | None:
        return self._version

    # ------------------------------------------------------------------ the server

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        async with self._starting:  # the batch's requests wait for one health check
            if not self._ready:
                await self._wait_healthy()
        return self._session

    async def _wait_healthy(self) -> None:
        assert self._session is not None
        t0 = time.monotonic()
        deadline = t0 + self.part.inference.vllm.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VLLMError(f"the vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            # Each check bounded: a listener that accepts and never answers (the server not
            # serving yet, or another process on the port) must not outlast the deadline.
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with self._session.get(f"{self.url}/health", timeout=HEALTH_CHECK_TIMEOUT) as r:
                    if r.status == 200:
                        self._ready = True
                        if self.capture:
                            await self._send(
                                self._session, "/collective_rpc", {"method": "jetrl_start_routes"}
                            )
                        self.log.info("vllm_ready", startup_s=round(time.monotonic() - t0, 1))
                        return
            await asyncio.sleep(0.5)
        raise VLLMError(
            f"the vLLM server was not healthy after {time.monotonic() - t0:.0f} s:\n{self.log_tail()}"
        )

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        return await self._send(await self._client(), path, body)

    async def _send(self, session: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> Any:
        async with session.post(f"{self.url}{path}", json=body) as r:
            if r.status != 200:
                raise VLLMError(f"vLLM {path} answered {r.status}: {(await r.text())[:2000]}")
            return await r.json()

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        """A call of jetrl's worker extension on every vLLM worker; their answers."""
        out = await self._post("/collective_rpc", {"method": method, "args": list(args)})
        results: list[Any] = out["results"]
        return results

    # ------------------------------------------------------------------ the seam

    async def generate(self, groups: Sequence[GroupRequest]) -> list[list[Sample]]:
        return list(await asyncio.gather(*(self._group(g) for g in groups)))

    async def _group(self, g: GroupRequest) -> list[Sample]:
        tag = f"jetrl{uuid.uuid4().hex}"
        body = {
            "request_id": tag,
            "model": self.model_name,
            "prompt": [int(t) for t in g.prompt_tokens],
            "n": g.n,
            "max_tokens": max(1, g.max_tokens),
            "temperature": g.temperature,
            "top_p": g.top_p,
            # Exactly the stop ids asked for, as the embedded engine (the worker passes the
            # tokenizer's EOS and end-of-turn ids): not also the model's own EOS.
            "stop_token_ids": [int(t) for t in g.stop_token_ids],
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            # No per-request seed: on CPU vLLM fails a seeded request that is preempted and
            # resumed ("CPU Generator does not use offset"); the server samples from its seed.
        }
        out = await self._post("/v1/completions", body)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        samples = [self._sample(c, g) for c in choices]
        if not self.capture:
            return samples
        routes = (await self.rpc("jetrl_take_routes", tag))[0]
        return [
            dataclasses.replace(s, routing_trace=self._trace(routes, tag, i, g.n, len(g.prompt_tokens), s))
            for i, s in enumerate(samples)
        ]

    def _trace(
        self, routes: dict[str, list[list[list[int]]]], tag: str, index: int, n: int, p: int, s: Sample
    ) -> Any:
        """Sample ``index``'s trace ``[P + C - 1, moe_layers, top_k]`` (the last sampled token is
        never fed back), the embedded engine's layout. vLLM names a group's samples
        ``<index>_<request id>``."""
        mine = [r for r in routes if r.startswith(f"{index}_") or (n == 1 and not r[0].isdigit())]
        if len(mine) != 1:
            raise VLLMError(f"no routes (or several) for sample {index} of {tag}: {sorted(routes)[:4]}")
        want = p + len(s.completion_tokens) - 1
        rows = routes[mine[0]][:want]
        if len(rows) != want or any(not r for r in rows):
            got = sum(bool(r) for r in rows)
            raise VLLMError(f"sample {index} of {tag}: routes for {got} positions, not {want}")
        import torch

        from jetrl.policy.routing import trace_dtype

        return torch.tensor(rows, dtype=trace_dtype(self.mcfg.num_experts)).numpy()

    def _sample(self, choice: dict[str, Any], g: GroupRequest) -> Sample:
        ids = [int(t) for t in choice.get("token_ids") or []]
        lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        finish: FinishReason = "stop" if choice.get("finish_reason") == "stop" else "length"
        if len(lps) != len(ids):
            raise VLLMError(f"vLLM returned {len(ids)} tokens but {len(lps)} logprobs")
        if g.temperature == 0:
            lps = [0.0] * len(ids)  # greedy: a point mass, as the embedded engine reports
        return Sample(
            completion_tokens=np.asarray(ids, dtype=np.int32),
            logprobs=np.asarray(lps, dtype=np.float32),
            finish_reason=finish,
            routing_trace=None,
        )

    async def load_weights(self, ready: ev.WeightsReady, payloads: Payloads) -> None:
        # The bytes land in a file in shared memory (/dev/shm: memory, not disk), checked as they
        # land; vLLM's workers map that file and load views of it (vllm_ext/jetrl_vllm_ext.py).
        shm = SharedFile(self.shm_dir / f"jetrl-weights-{uuid.uuid4().hex}.safetensors")
        hf_copy: Path | None = None
        try:
            data = await payloads.get_weights(ready, into=shm.create)
            hf_copy = await asyncio.to_thread(self._check_hf, data, ready, shm.path)
            del data
            await self.rpc("jetrl_load_weights", str(hf_copy or shm.path))
        finally:
            shm.remove()
            if hf_copy is not None:
                hf_copy.unlink(missing_ok=True)
        self._version = ready.version

    def _check_hf(self, data: memoryview, ready: ev.WeightsReady, path: Path) -> Path | None:
        """Check what the bytes hold (the checksum they carry is the announced one; for an
        announcement without a transfer digest, the content checksum recomputed) and, when they
        are not in Hugging Face layout, write a copy that is (beside them, in shared memory):
        the path of that copy, or None when vLLM loads the bytes as they are."""
        from safetensors.torch import save_file

        from jetrl.policy.weights import (
            META_LAYOUT,
            check_stored_checksum,
            tensors_of,
            to_hf,
            weights_from_bytes,
        )

        tensors, meta = tensors_of(data)
        if ready.blake3 is None:  # an announcement of before the transfer digest
            weights_from_bytes(data, expected_checksum=ready.weights_checksum, model_cfg=self.mcfg)
        else:
            check_stored_checksum(meta, ready.weights_checksum)
        if meta.get(META_LAYOUT) == "hf":
            return None
        # jetrl's layout: vLLM loads Hugging Face names (a trainer with weights_layout = "hf"
        # publishes those, and this copy is not made).
        out = path.with_name(path.stem + "-hf.safetensors")
        save_file(to_hf(tensors, self.mcfg), str(out))  # canonical names already
        return out

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self.proc.poll() is None:
            self.proc.terminate()  # the reaper stops the server's whole process group
            try:
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        self._log_file.close()
        # The server's log and sockets (the reaper removes them if this worker is killed).
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __del__(self) -> None:  # a worker that never closed its engine leaves no server behind
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                proc.terminate()
