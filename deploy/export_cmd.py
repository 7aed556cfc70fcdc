"""`jetrl export-model RUN --version V DIR [--dtype bf16]`: a policy version as a Hugging Face
checkpoint directory that transformers and vLLM load as it is.

Reads the run's config (RunStarted) and the version's WeightsReady event from the log, fetches
the weights (their bytes' SHA-256 and the tensors' checksum verified), and writes them in HF layout
(policy/hf.py) with the config.json and tokenizer files of the checkpoint the run started from
(``[model] hf_path``), or a config.json made from the model's config for a run from scratch.
Without ``--nats-url`` the run's own log files are served by a private nats-server.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jetrl.bus.client import Bus
from jetrl.bus.log import configure
from jetrl.bus.payloads import PayloadMissing, Payloads
from jetrl.deploy.config import RunConfig
from jetrl.deploy.run_log import with_run_log

DTYPES = ("float32", "bfloat16", "float16")


async def export(
    url: str, run_id: str, run_dir: Path, version: int | None, out: Path, dtype: str | None
) -> int:
    # Imported here: every jetrl command imports this module to list its options.
    import torch

    from jetrl.consumers.trainer.replay import read_run_log
    from jetrl.policy.hf import save_checkpoint
    from jetrl.policy.origin import model_config_of
    from jetrl.policy.weights import weights_from_bytes

    bus = await Bus.connect(url, name="export-model")
    try:
        log = await read_run_log(bus, run_id)
        if log.config is None:
            print(f"export-model: run {run_id} has no RunStarted event in its log")
            return 2
        if not log.weights:
            print(f"export-model: run {run_id} has published no weights")
            return 2
        v = max(log.weights) if version is None else version
        ready = log.weights.get(v)
        if ready is None:
            have = f"{min(log.weights)}..{max(log.weights)}"
            print(f"export-model: run {run_id} has no weights of version {v}; it has {have}")
            return 2
        model = RunConfig.model_validate(log.config).model
        payloads = await Payloads.for_run(bus.js, run_id, weights_dir=run_dir / "payloads")
        try:
            data = await payloads.get_weights(ready)
        except PayloadMissing:
            print(
                f"export-model: version {v} of run {run_id} is no longer in its store: the trainer keeps "
                "version 0 and the newest [trainer] weights_keep versions (None keeps every one)"
            )
            return 2
        cfg = model_config_of(model)
        tensors, digest = weights_from_bytes(data, expected_checksum=ready.weights_checksum, model_cfg=cfg)
        save_checkpoint(
            out,
            tensors,
            cfg,
            source=model.hf_path,
            dtype=None if dtype is None else getattr(torch, dtype),
            metadata={"jetrl.run": run_id, "jetrl.version": str(v), "jetrl.checksum": digest},
        )
        print(f"exported version {v} of run {run_id} to {out} (weights checksum {digest[:16]})")
        return 0
    finally:
        await bus.close()


def main(args: argparse.Namespace) -> int:
    configure(level="warning")
    run_dir = Path(args.runs_dir) / args.run
    out = Path(args.dir)
    return with_run_log(
        "export-model",
        run_dir,
        args.nats_url,
        lambda url: export(url, args.run, run_dir, args.version, out, args.dtype),
    )


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("export-model", help="write a policy version as a Hugging Face checkpoint directory")
    p.add_argument("run")
    p.add_argument("dir")
    p.add_argument("--version", type=int, default=None, help="policy version (default: the latest)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="saved precision (default: the trainer's)")
    p.add_argument("--nats-url", default=None)
    p.add_argument("--runs-dir", default="runs")
    p.set_defaults(func=main)
