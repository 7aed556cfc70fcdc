"""The parallel train engine on CPU with gloo, 2 ranks: FSDP2, FSDP2 with the experts split over
the ranks (expert parallel, Router Replay dispatching by the replayed ids), and FSDP2 on the
Llama family (torchtitan's parallelize_llama, tied embeddings), against the single-process
engine on the same rollouts; DCP checkpoints resumed in a fresh group.

Each layout runs in its own process (tests/support/parallel_run.py: rank 0 starts rank 1), so
this test process never joins a process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from jetrl.consumers.trainer.core import TrainCore, checkpoint_path
from jetrl.consumers.trainer.local_engine import LocalTrainEngine
from jetrl.policy.train import Rollout
from jetrl.policy.weights import transfer_digest, weights_from_bytes
from tests.support.parallel_run import CKPT_AFTER, MODEL, ROLLOUTS, STEPS, part

pytestmark = pytest.mark.slow  # each layout starts a group of ranks
ROOT = Path(__file__).resolve().parents[3]

# fp32, tolerances measured on this machine (max differences ~1e-6): rank batches are narrower
# than the whole batch (other matmul shapes, other float summation orders), and the ranks'
# gradients are summed in another order than one process sums them. Bit-equality holds within
# one layout (the resume checks below), not across layouts.
LOGPROB_ATOL = 1e-5
# After 4 AdamW steps at lr 1e-2 (weights move by up to ~4e-2): Adam divides by the root of the
# squared gradients, which magnifies rounding where a gradient is near 0 (measured up to 1e-4).
WEIGHT_ATOL = 5e-4
LOSS_RTOL = 1e-4


def run(parallelism: dict[str, Any], mode: str, ckpt_dir: Path, out: Path, **trainer: Any) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "tests.support.parallel_run",
        json.dumps(parallelism),
        str(out),
        mode,
        str(ckpt_dir),
    ]
    if trainer:
        argv.append(json.dumps(trainer))
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result: dict[str, Any] = torch.load(out, weights_only=False)
    return result


def local_reference(rollouts: list[Rollout], **trainer: Any) -> tuple[LocalTrainEngine, dict[str, Any]]:
    eng = LocalTrainEngine(part({}, **trainer))
    out: dict[str, Any] = {"checksum0": eng.checksum(), "metrics": [], "stats": []}
    for _ in range(STEPS):
        out["metrics"].append(eng.step(rollouts))
        out["stats"].append(eng.step_token_stats())
    return eng, out


# A learning rate that moves at every one of the STEPS steps, and across the checkpoint.
SCHEDULE = {"lr_warmup_steps": 2, "lr_decay": "linear", "lr_decay_steps": 3, "lr_min_ratio": 0.1}
# name: ([trainer.parallelism], other [trainer] settings). Packed rows (several rollouts a row)
# are compared with the single-process engine's padded rows: the same maths, other shapes.
LAYOUTS: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    "fsdp": ({"dp_shard": 2}, {}),
    "fsdp+ep": ({"dp_shard": 2, "ep": 2}, {}),
    "fsdp+ep packed": ({"dp_shard": 2, "ep": 2}, {"pack_tokens": 24, **SCHEDULE}),
    "fsdp llama": ({"dp_shard": 2}, {"model": "tiny-llama"}),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp(request.param.replace(" ", "-"))
    layout, extra = LAYOUTS[request.param]
    got = run(layout, "train", d, d / "train.pt", weights_layout="hf", **extra)
    rollouts = torch.load(d / ROLLOUTS, weights_only=False)
    schedule = {k: v for k, v in extra.items() if k in SCHEDULE}
    eng, want = local_reference(rollouts, weights_layout="hf", model=extra.get("model", MODEL), **schedule)
    return request.param, (layout, extra), d, got, eng, want, rollouts


def test_a_parallel_step_equals_the_single_process_step(trained: Any) -> None:
    name, (layout, extra), _, got, eng, want, rollouts = trained
    model = extra.get("model", MODEL)
    assert got["layout"] == {
        "engine": "parallel",
        "world_size": 2,
        "dp_replicate": 1,
        "cp": 1,
        "tp": 1,
        **{"ep": 1, **layout},
    }
    # The same weights hash the same, gathered from shards or not.
    assert got["checksum0"] == want["checksum0"]
    # Logprobs of the starting weights under replay, row by row.
    start = LocalTrainEngine(part({}, model=model))
    for lp, ref in zip(got["logprobs"], start.logprobs(rollouts), strict=True):
        assert lp.shape == ref.shape and torch.allclose(lp, ref, atol=LOGPROB_ATOL, rtol=0)
    for g, w in zip(got["metrics"], want["metrics"], strict=True):
        assert g["num_tokens"] == w["num_tokens"]
        assert g["lr"] == w["lr"]  # the schedule's, from each engine's own step count
        for k in ("loss", "pg_loss", "grad_norm", "ratio_min", "ratio_max", "entropy"):
            assert g[k] == pytest.approx(w[k], rel=LOSS_RTOL, abs=1e-6), (name, k)
    if "lr_decay" in extra:  # warming up, then decaying: 5e-3, 1e-2, 1e-2, 7e-3
        assert len({m["lr"] for m in got["metrics"]}) == 3
    # The per-token records of each step: trainer logprobs close, routing differences equal.
    for a, b in zip(got["stats"], want["stats"], strict=True):
        assert a.shape == b.shape == (sum(len(r.completion_ids) for r in rollouts), 2)
        assert torch.allclose(a[:, 0], b[:, 0], atol=LOGPROB_ATOL, rtol=0)
        assert torch.equal(a[:, 1], b[:, 1])
    if eng.mcfg.is_moe:  # the random traces are not what the router would pick: replay decided
        assert bool(got["stats"][0][:, 1].any())
    # Four steps later the weights are still the single-process weights, to float rounding.
    data, digest, blake3 = got["export"]
    assert digest == got["checksums"][-1]
    assert blake3 == transfer_digest(data)  # the digest the gathered bytes were sent with
    tensors, stored = weights_from_bytes(data, model_cfg=eng.mcfg)  # HF layout, converted back
    assert stored == digest
    ref = eng.model.state_dict()
    assert set(tensors) == set(ref)
    worst = max(float((tensors[k] - ref[k]).abs().max()) for k in ref)
    assert worst < WEIGHT_ATOL, worst
    initial = LocalTrainEngine(part({}, model=model)).model.state_dict()
    moved = max(float((tensors[k] - initial[k]).abs().max()) for k in ref)
    assert moved > 20 * WEIGHT_ATOL, moved  # it trained, far past the tolerance
    # The checksum is the canonical tensors': the same bytes loaded into one process hash alike.
    start.load_weights(tensors)
    assert start.checksum() == digest


def test_a_dcp_checkpoint_resumes_bit_for_bit_in_a_fresh_group(trained: Any, tmp_path: Path) -> None:
    _, (layout, extra), d, got, _, _, _ = trained
    ck = checkpoint_path(d, CKPT_AFTER)
    # One shard file per rank, DCP's index, and jetrl's metadata.
    assert {p.name for p in ck.iterdir()} == {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.json"}
    again = run(layout, "resume", d, tmp_path / "resume.pt", weights_layout="hf", **extra)
    assert again["loaded"] == got["checksums"][CKPT_AFTER - 1]
    assert again["checksums"] == got["checksums"][CKPT_AFTER:]


def test_a_checkpoint_is_refused_by_another_layout(trained: Any) -> None:
    d, model = trained[2], trained[1][1].get("model", MODEL)
    with pytest.raises(ValueError, match=r"laid out as .*'dp_shard': 2"):
        TrainCore(part({}, model=model)).load_checkpoint(checkpoint_path(d, CKPT_AFTER))
