"""Drive the parallel train engine in its own process (rank 0 starts the other ranks) and save
what it computed, for tests to compare with the single-process engine:

    python -m tests.support.parallel_run PARALLELISM_JSON OUT.pt train|resume CKPT_DIR

``train``: the starting checksum, logprobs, ``STEPS`` steps (metrics, token records, checksum
after each), the published bytes, and a checkpoint after step ``CKPT_AFTER``. ``resume``: that
checkpoint loaded in a fresh group, then the remaining steps' checksums (same rollouts).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from jetrl.consumers.trainer.core import TrainCore, checkpoint_path
from jetrl.consumers.trainer.settings import TrainerPart
from jetrl.policy.models import ModelConfig, get_config
from jetrl.policy.train import Rollout

STEPS = 4
CKPT_AFTER = 2
MODEL = "tiny-moe"
ROLLOUTS = "rollouts.pt"


def part(parallelism: dict[str, Any], model: str = MODEL, **trainer: Any) -> TrainerPart:
    return TrainerPart.model_validate(
        {"trainer": {"lr": 1e-2, "parallelism": parallelism, **trainer}, "model": {"name": model}, "seed": 3}
    )


def make_rollouts(cfg: ModelConfig, n: int = 7, seed: int = 0) -> list[Rollout]:
    """Mixed lengths (so ranks get unequal shares), a masked-out environment span, and for an
    MoE random routing traces: the replayed experts differ from those the trainer's router
    would pick, so replay (and under EP, dispatch by the replayed ids) decides the result."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(2, 7, (1,), generator=g))
        c = int(torch.randint(2, 11, (1,), generator=g))
        ids = torch.randint(0, cfg.vocab_size, (p + c,), generator=g).tolist()
        rows = (p + c - 1) * cfg.num_moe_layers
        trace = (
            torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k] for _ in range(rows)])
            if cfg.is_moe
            else None
        )
        mask = [not (i == 1 and 0 < j < 3) for j in range(c)]
        out.append(
            Rollout(
                ids[:p],
                ids[p:],
                -0.5 - torch.rand(c, generator=g),
                float(torch.randn(1, generator=g)),
                routing=None if trace is None else trace.view(p + c - 1, cfg.num_moe_layers, cfg.top_k),
                completion_mask=mask,
            )
        )
    return out


def with_logprobs(rollouts: list[Rollout], logprobs: list[torch.Tensor]) -> list[Rollout]:
    """Inference logprobs near the trainer's (a little off, as inference's are), so that few
    tokens fall outside the ratio bounds and every step trains."""
    g = torch.Generator().manual_seed(1)
    for r, lp in zip(rollouts, logprobs, strict=True):
        # logprobs cover the trained tokens only; the environment's span keeps its value.
        mask = torch.tensor(r.completion_mask) if r.completion_mask is not None else slice(None)
        full = r.inference_logprobs.clone()
        full[mask] = lp + 0.02 * torch.randn(lp.shape, generator=g)
        r.inference_logprobs = full
    return rollouts


def train(core: TrainCore, ckpt_dir: Path) -> dict[str, Any]:
    eng = core.engine
    out: dict[str, Any] = {"checksum0": eng.checksum()}
    rs = make_rollouts(get_config(core.part.model.name))
    out["logprobs"] = eng.logprobs(rs)
    rs = with_logprobs(rs, out["logprobs"])
    torch.save(rs, ckpt_dir / ROLLOUTS)  # resume trains on exactly these
    out["metrics"], out["stats"], out["checksums"] = [], [], []
    for step in range(1, STEPS + 1):
        out["metrics"].append(eng.step(rs))
        out["stats"].append(eng.step_token_stats())
        out["checksums"].append(eng.checksum())
        if step == CKPT_AFTER:
            core.save_checkpoint(ckpt_dir, step, log_seq=step)
    exported = eng.export_weights({"version": str(STEPS)})
    out["export"] = (bytes(exported.data), exported.checksum, exported.blake3)  # pickled back
    return out


def resume(core: TrainCore, ckpt_dir: Path) -> dict[str, Any]:
    ck = core.load_checkpoint(checkpoint_path(ckpt_dir, CKPT_AFTER))
    eng = core.engine
    rs = torch.load(ckpt_dir / ROLLOUTS, weights_only=False)
    return {"loaded": ck.weights_checksum, "checksums": [_step(eng, rs) for _ in range(CKPT_AFTER, STEPS)]}


def _step(eng: Any, rs: list[Rollout]) -> str:
    eng.step(rs)
    digest: str = eng.checksum()
    return digest


def main() -> int:
    parallelism, out_path, mode, ckpt_dir = (
        json.loads(sys.argv[1]),
        Path(sys.argv[2]),
        sys.argv[3],
        Path(sys.argv[4]),
    )
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    core = TrainCore(part(parallelism, **extra))
    result = train(core, ckpt_dir) if mode == "train" else resume(core, ckpt_dir)
    result["layout"] = core.engine.layout()
    torch.save(result, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
