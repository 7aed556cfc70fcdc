"""One rank's share of the policy: jetrl's torchtitan model, parallelised by torchtitan's own
``parallelize_qwen3`` or ``parallelize_llama`` (FSDP2 ``fully_shard``, expert parallelism
through its all-to-all token dispatcher), its AdamW, and the collective operations every rank runs together.

Every method is collective: all ranks call it in the same order; inputs and results live on
rank 0 (``None`` elsewhere). Why the maths equals the single-process step's:

* Each data-parallel rank takes whole rollouts (split.py); its loss is its tokens' sum divided
  by the step's total token count, and FSDP2 sums gradients instead of averaging them
  (``set_force_sum_reduction_for_comms``; gloo also has no PREMUL_SUM, FSDP2's averaging
  reduce), so the summed gradient is the whole batch's, as one process computes it.
* Router Replay hooks the routers (policy/routing.py) before torchtitan's dispatcher runs, so
  the replayed expert ids are what the all-to-all sends tokens by, to the rank owning them.
* Equal up to float rounding, not bit for bit: rank batches are narrower than the whole batch
  (other matmul shapes) and gradients are summed in another order. For a fixed layout every
  run is bit-identical again (gloo's and FSDP2's reduction order is fixed), which is what
  replay checks; a checkpoint therefore records the layout.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from jetrl.consumers.trainer.parallel.group import RankGroup
from jetrl.consumers.trainer.parallel.split import split_by_tokens
from jetrl.consumers.trainer.settings import TrainerPart
from jetrl.policy.models import build_model, state_dict_adapter
from jetrl.policy.origin import initial_model, model_config_of
from jetrl.policy.packing import PackedLayout, collate_for
from jetrl.policy.titan_dist import (
    SPMD_BACKEND,
    CompileConfig,
    ParallelismConfig,
    TrainingConfig,
    clip_grad_norm_,
    parallelize_llama,
    parallelize_qwen3,
)
from jetrl.policy.train import (
    Rollout,
    TrainBatch,
    add_metrics,
    compute_logprobs,
    forward_backward,
    make_optimizer,
    scheduled_lr,
    set_deterministic,
)
from jetrl.policy.weights import META_LAYOUT, ExportedWeights, Hasher, SafetensorsBuffer, canonical_order

# Gathering an expert weight sharded over ep and efsdp takes two all-gathers, and torch warns
# about it at every checksum; the order is fixed, so the result is the same every time.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def completion_tokens(r: Rollout) -> int:
    return sum(bool(x) for x in r.completion_mask) if r.completion_mask is not None else len(r.completion_ids)


class ShardedPolicy:
    def __init__(self, part: TrainerPart, group: RankGroup) -> None:
        s = self.s = part.trainer
        self.group = group
        self.temperature = part.temperature
        set_deterministic(part.seed, num_threads=s.threads)
        self.mcfg = model_config_of(part.model)
        par = s.parallelism
        if self.mcfg.is_moe and self.mcfg.num_experts % par.ep:
            raise ValueError(f"ep = {par.ep} must divide the model's {self.mcfg.num_experts} experts")
        titan_par = ParallelismConfig(
            data_parallel_replicate_degree=par.dp_replicate,
            data_parallel_shard_degree=par.dp_shard,
            tensor_parallel_degree=par.tp,
            context_parallel_degree=par.cp,
            expert_parallel_degree=par.ep,
            spmd_backend=SPMD_BACKEND,
        )
        # Only rank 0 builds the version-0 weights (as one process would: same seed, same
        # values); every rank builds the model on the meta device, shards it, and then takes
        # its shards of rank 0's weights, so no other rank ever holds the whole model.
        source = initial_model(part.model, seed=part.seed, parallelism=titan_par) if group.rank == 0 else None
        model = build_model(self.mcfg, seed=None, device="meta", parallelism=titan_par)
        parallelize = parallelize_llama if self.mcfg.family == "llama" else parallelize_qwen3
        parallelize(
            model,
            parallel_dims=group.dims,
            training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
            parallelism=titan_par,
            compile_config=CompileConfig(enable=False),
            ac_config=None,
            dump_folder="",
        )
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        model.to_empty(device=group.device)
        self.model = model
        self.load_weights(None if source is None else source.state_dict())
        # Buffers outside the state dict (RoPE's tables) are whole on every rank: rank 0's.
        mine = dict(source.named_buffers()) if source is not None else {}
        for name, buf in model.named_buffers():
            full = (
                mine[name].to("cpu").contiguous()
                if source is not None
                else torch.empty(tuple(buf.shape), dtype=buf.dtype)
            )
            dist.broadcast(full, src=0, group=group.control)
            with torch.no_grad():
                buf.copy_(_placed_like(buf, full.to(group.device)))
        del source, mine
        self.optimizer = make_optimizer(model, lr=s.lr, weight_decay=s.weight_decay)
        self.loss_cfg = s.loss_config()
        self.lr_schedule = s.lr_schedule()
        self.replay = s.replay and self.mcfg.is_moe
        self.last_token_stats: torch.Tensor | None = None
        # Names and per-expert tensors of Hugging Face's layout, one tensor at a time (a meta
        # tensor too, to lay out the bytes before gathering).
        self._to_hf = state_dict_adapter(self.mcfg).to_hf

    # ------------------------------------------------------------------ rollouts over ranks

    def _padding(self) -> Rollout:
        """What a rank without rollouts trains on (FSDP and the all-to-all need every rank in
        every forward and backward): one token, masked out, so it adds nothing."""
        trace = None
        if self.replay:
            trace = torch.arange(self.mcfg.top_k).expand(1, self.mcfg.num_moe_layers, -1).clone()
        return Rollout([0], [0], torch.zeros(1), 0.0, routing=trace, completion_mask=[False])

    def _share(self, rollouts: Sequence[Rollout] | None) -> tuple[list[Rollout], list[int], int]:
        """This rank's rollouts, their indices in the step, and the step's loss-token total."""
        g = self.group
        per_rank = None
        if g.rank == 0:
            assert rollouts is not None
            shares = split_by_tokens([len(r.prompt_ids) + len(r.completion_ids) for r in rollouts], g.par.dp)
            total = max(sum(completion_tokens(r) for r in rollouts), 1)
            per_rank = []
            for r in range(g.world):
                idx = shares[g.dp_rank(r)]
                per_rank.append(([rollouts[i] for i in idx], idx, total))
        mine: tuple[list[Rollout], list[int], int] = g.scatter(per_rank)
        return mine

    def _batch(self, local: list[Rollout]) -> tuple[TrainBatch, PackedLayout]:
        batch, layout = collate_for(local or [self._padding()], self.mcfg, self.s.pack_tokens)
        for f in dataclasses.fields(batch):
            t = getattr(batch, f.name)
            if isinstance(t, torch.Tensor):
                setattr(batch, f.name, t.to(self.group.device))
        return batch, layout

    # ------------------------------------------------------------------ collective operations

    def step(self, rollouts: Sequence[Rollout] | None) -> dict[str, float] | None:
        local, idx, total = self._share(rollouts)
        batch, layout = self._batch(local)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats: list[torch.Tensor] | None = [] if self.s.record_token_stats else None
        m = forward_backward(
            self.model,
            batch,
            self.loss_cfg,
            temperature=self.temperature,
            replay=self.replay,
            num_tokens=total,
            token_stats=stats,
        )
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.s.max_grad_norm if self.s.max_grad_norm else math.inf
        norm = clip_grad_norm_(params, max_norm, ep_enabled=self.group.dims.ep_enabled)
        lr = scheduled_lr(self.optimizer, self.lr_schedule)
        self.optimizer.step()
        slices = layout.per_rollout(stats[0].cpu()) if stats else [None] * len(local)
        mine = [(i, None if t is None else t.clone()) for i, t in zip(idx, slices, strict=False)]
        report = (m, batch.num_tokens, mine) if self.group.reports and local else None
        got = self.group.gather(report)
        if got is None:
            return None
        metrics: dict[str, float] = {}
        by_index: dict[int, torch.Tensor | None] = {}
        for rep in got:
            if rep is None:
                continue
            rm, n, slices = rep
            add_metrics(metrics, rm, n / total)
            by_index.update(slices)
        metrics["grad_norm"] = float(norm)
        metrics["lr"] = lr
        assert rollouts is not None
        kept = [by_index[i] for i in range(len(rollouts))]
        whole = [t for t in kept if t is not None]
        self.last_token_stats = torch.cat(whole) if len(whole) == len(kept) else None
        return metrics

    def logprobs(self, rollouts: Sequence[Rollout] | None) -> list[torch.Tensor] | None:
        local, idx, _ = self._share(rollouts)
        batch, layout = self._batch(local)
        with torch.no_grad():
            lp, _ = compute_logprobs(self.model, batch, temperature=self.temperature, replay=self.replay)
        mine = list(zip(idx, layout.per_rollout(lp.cpu(), batch.loss_mask.cpu()), strict=False))
        got = self.group.gather(mine if self.group.reports else None)
        if got is None:
            return None
        out = dict(pair for rep in got if rep for pair in rep)
        assert rollouts is not None
        return [out[i] for i in range(len(rollouts))]

    def _full_tensors(self) -> Any:
        """``(name, full tensor on rank 0 / None elsewhere)`` in canonical order, gathered one at
        a time (a DTensor's ``full_tensor`` is an all-gather every rank joins)."""
        sd = self.model.state_dict()
        for name in canonical_order(sd):
            t = sd[name]
            full = t.full_tensor() if isinstance(t, DTensor) else t
            yield name, (full.detach().cpu() if self.group.rank == 0 else None)
            del full

    def checksum(self, _: object = None) -> str | None:
        h = Hasher() if self.group.rank == 0 else None
        for name, t in self._full_tensors():
            if h is not None and t is not None:
                h.add(name, t)
        return None if h is None else h.hexdigest()

    def export_weights(self, metadata: Mapping[str, str] | None) -> ExportedWeights | None:
        """The safetensors bytes of the full weights (Hugging Face layout when the run asks for
        it), gathered tensor by tensor into one buffer on rank 0, their checksum and transfer
        digest (taken as each tensor is copied into place, policy/weights.py)."""
        hf = self.s.weights_layout == "hf"
        sd = self.model.state_dict()
        buf = h = None
        if self.group.rank == 0:
            specs = []
            for name in canonical_order(sd):
                meta = torch.empty(tuple(sd[name].shape), dtype=sd[name].dtype, device="meta")
                for out_name, out in (self._to_hf({name: meta}) if hf else {name: meta}).items():
                    specs.append((out_name, out.dtype, tuple(out.shape)))
            meta_out = {**(metadata or {}), **({META_LAYOUT: "hf"} if hf else {})}
            # Hashed beside the copy where what it hashes is the buffer's (not in Hugging Face
            # layout, whose checksum takes each gathered tensor: a queue of them would hold
            # that many full tensors more).
            buf = SafetensorsBuffer(specs, meta_out)
            h = Hasher.for_export(0 if hf else buf.buf.nbytes)
        try:
            for name, t in self._full_tensors():
                if buf is not None and h is not None and t is not None:
                    if not hf:
                        buf.put(name, t.contiguous(), checksum=h)  # hashed from the copy as it is made
                        continue
                    h.add(name, t)
                    for out_name, out in self._to_hf({name: t}).items():
                        buf.put(out_name, out.contiguous())
            if buf is None or h is None:
                return None
            return buf.finish(h.hexdigest())
        finally:
            if h is not None:
                h.close()  # its thread, where it has one, ends with the export, failed or not

    def load_weights(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Full tensors on rank 0 become every rank's shards: each broadcast, then cut to the
        placement of the parameter it replaces. (torch's ``set_model_state_dict`` cannot be
        used, for the reason given at :meth:`_state`.)"""
        g = self.group
        sd = self.model.state_dict()
        problem = None
        if g.rank == 0:
            assert tensors is not None
            missing, extra = set(sd) - set(tensors), set(tensors) - set(sd)
            if missing or extra:
                problem = (
                    f"weights do not fit the model: missing {sorted(missing)[:5]}, "
                    f"unexpected {sorted(extra)[:5]}"
                )
        if problem := g.broadcast(problem):  # every rank refuses, none is left waiting
            raise ValueError(problem)
        new: dict[str, Any] = {}
        for name in canonical_order(sd):
            t = sd[name]
            full = (
                tensors[name].detach().to("cpu", t.dtype).contiguous()
                if tensors is not None and g.rank == 0
                else torch.empty(tuple(t.shape), dtype=t.dtype)
            )
            dist.broadcast(full, src=0, group=g.control)
            new[name] = _placed_like(t, full.to(g.device))
        self.model.load_state_dict(new)

    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds, keyed by names: the model's state dict (its DTensor
        shards) and AdamW's state per parameter name. torch's ``get_state_dict`` cannot be
        used: it walks modules by state-dict key, and torchtitan's fused QKV projection
        publishes ``wq``/``wk``/``wv`` keys that are not modules' attributes."""
        optim: dict[str, Any] = {}
        for name, p in self.model.named_parameters():
            st = self.optimizer.state[p]
            if not st:  # never stepped: AdamW's own starting state, so it can be filled in place
                st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            optim[name] = st
        return {"model": self.model.state_dict(), "optimizer": optim}

    def save_state(self, directory: str) -> None:
        """Every rank writes its own shards (torch.distributed.checkpoint)."""
        dcp_save(self._state(), checkpoint_id=directory)

    def load_state(self, directory: str) -> None:
        state = self._state()
        dcp_load(state, checkpoint_id=directory)  # in place, each rank its own shards
        # The optimizer's tensors were filled in place; the model's state dict may hold views
        # of fused weights, so it goes back through the model's own loading.
        self.model.load_state_dict(state["model"])


def _placed_like(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (the same on every rank) as ``like`` is laid out: cut to its placement when it
    is a DTensor, with no communication."""
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full
