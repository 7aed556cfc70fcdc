"""The single-process train engine: jetrl's torchtitan model and AdamW in this process, on CPU
bit-reproducible for a fixed thread count (policy/train.py)."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from jetrl.consumers.trainer.settings import TrainerPart
from jetrl.policy.origin import initial_model, model_config_of
from jetrl.policy.packing import collate_for
from jetrl.policy.train import (
    Rollout,
    StepAccumulator,
    compute_logprobs,
    make_optimizer,
    set_deterministic,
    train_step,
)
from jetrl.policy.weights import ExportedWeights, checksum, export_weights, load_into

STATE_FILE = "state.pt"  # weights and optimizer, one file


class LocalTrainEngine:
    def __init__(self, part: TrainerPart) -> None:
        s = self.s = part.trainer
        self.temperature = part.temperature
        set_deterministic(part.seed, num_threads=s.threads)
        self.mcfg = model_config_of(part.model)
        self.model = initial_model(part.model, seed=part.seed)
        self.optimizer = make_optimizer(self.model, lr=s.lr, weight_decay=s.weight_decay)
        self.loss_cfg = s.loss_config()
        self.lr_schedule = s.lr_schedule()
        self.replay = s.replay and self.mcfg.is_moe
        self.last_token_stats: torch.Tensor | None = None
        self.accumulator = StepAccumulator(
            self.model,
            self.optimizer,
            self.loss_cfg,
            temperature=self.temperature,
            replay=self.replay,
            max_grad_norm=s.max_grad_norm,
            lr_schedule=self.lr_schedule,
        )
        self._accumulated_stats: list[torch.Tensor] = []

    def logprobs(self, rollouts: Sequence[Rollout]) -> list[torch.Tensor]:
        batch, layout = collate_for(rollouts, self.mcfg, self.s.pack_tokens)
        with torch.no_grad():
            lp, _ = compute_logprobs(self.model, batch, temperature=self.temperature, replay=self.replay)
        return layout.per_rollout(lp, batch.loss_mask)

    def step(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        stats: list[torch.Tensor] = []
        batch, layout = collate_for(rollouts, self.mcfg, self.s.pack_tokens)
        metrics = train_step(
            self.model,
            self.optimizer,
            batch,
            self.loss_cfg,
            replay=self.replay,
            max_grad_norm=self.s.max_grad_norm,
            temperature=self.temperature,
            token_stats=stats,
            lr_schedule=self.lr_schedule,
        )
        self.last_token_stats = layout.completions(stats[0])
        return metrics

    def accumulate(self, rollouts: Sequence[Rollout]) -> None:
        stats: list[torch.Tensor] = []
        batch, layout = collate_for(rollouts, self.mcfg, self.s.pack_tokens)
        self.accumulator.add(batch, token_stats=stats)
        self._accumulated_stats.append(layout.completions(stats[0]))

    def finish_step(self) -> dict[str, float]:
        metrics = self.accumulator.finish()
        self.last_token_stats, self._accumulated_stats = torch.cat(self._accumulated_stats), []
        return metrics

    def step_token_stats(self) -> torch.Tensor | None:
        return self.last_token_stats

    def checksum(self) -> str:
        return checksum(self.model)

    def export_weights(self, metadata: Mapping[str, str]) -> ExportedWeights:
        hf = self.mcfg if self.s.weights_layout == "hf" else None
        return export_weights(self.model, metadata, hf_config=hf)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        load_into(self.model, tensors)

    def layout(self) -> dict[str, Any]:
        return {"engine": "local", "world_size": 1}

    def save_state(self, directory: Path) -> None:
        with (directory / STATE_FILE).open("wb") as f:
            torch.save(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())

    def load_state(self, directory: Path) -> None:
        self.load_state_dict(torch.load(directory / STATE_FILE, weights_only=True))

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_into(self.model, state["model"])  # copies into the model's own tensors
        # torch's optimizer keeps the given moment tensors as they are: copy them, so that the
        # engine never shares state with whoever handed it over (another engine, say).
        self.optimizer.load_state_dict(copy.deepcopy(dict(state["optimizer"])))
