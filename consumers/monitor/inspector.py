"""The rollout inspector: a step's rollouts, token by token, from the run's log.

For a step it reads the StepCompleted, the RolloutsScored events at the sequences the step
recorded, their arrays (inline, in the log, or in the payload store) and the step's token
records (trainer log-probs and routing differences, ``StepCompleted.token_stats``), and
returns for each rollout its text, reward and parts, versions and staleness, and per
completion token: its text, the inference and trainer log-probs, their gap, and in how many
MoE layers the trainer's own router disagreed with the replayed routes. Without a bus (a
finished run whose server is gone) it returns what the store knows: no tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads
from jetrl.policy.settings import ModelSettings
from jetrl.policy.tokenizer import Tokenizer, tokenizer_for
from jetrl.store.db import Store


class Inspector:
    def __init__(self, run_id: str, *, bus: Bus | None = None, store: Store | None = None) -> None:
        self.run_id = run_id
        self.bus = bus
        self.store = store
        self._tokenizer: Tokenizer | None = None
        self._payloads: Payloads | None = None

    async def step(self, step: int, seq: int | None, config: dict[str, Any]) -> dict[str, Any] | None:
        """Step ``step``, whose StepCompleted lies at ``seq`` of the log, in a run of ``config``."""
        if self.bus is None:
            return self._from_store(step)
        if seq is None:
            return None
        if self._tokenizer is None:
            self._tokenizer = tokenizer_for(ModelSettings(**config.get("model", {})))
        if self._payloads is None:
            self._payloads = await Payloads.for_run(self.bus.js, self.run_id)
        body = (await self._payloads.event(seq)).body
        if not isinstance(body, ev.StepCompleted) or body.step != step:
            return None
        stats = None
        if body.token_stats is not None:
            stats = (await self._payloads.get_array(body.token_stats)).reshape(-1, 2)
        rollouts, offset = [], 0
        for rid, rseq in zip(body.rollout_ids, body.rollout_seqs, strict=False):
            event = await self._payloads.event(rseq)
            group = event.body
            r = (
                next((x for x in group.rollouts if x.rollout_id == rid), None)
                if isinstance(group, ev.RolloutsScored)
                else None
            )
            if not isinstance(group, ev.RolloutsScored) or r is None:
                rollouts.append({"rollout_id": rid, "error": f"log position {rseq} holds no such rollout"})
                stats = None  # its length is unknown: the token records no longer line up
                continue
            out = await self._rollout(step, event, group, r, stats, offset)
            offset += len(out["tokens"])
            rollouts.append(out)
        return {
            "step": body.step,
            "policy_version": body.policy_version,
            "recorded": body.token_stats is not None,
            "metrics": {k: body.metrics[k] for k in ("mismatch_kl", "mismatch_kl_max") if k in body.metrics},
            "rollouts": rollouts,
        }

    async def _rollout(
        self,
        step: int,
        event: ev.Event,
        group: ev.RolloutsScored,
        r: ev.ScoredRollout,
        stats: np.ndarray | None,
        offset: int,
    ) -> dict[str, Any]:
        assert self._payloads is not None
        gen_id = group.generation_event_id
        prompt = (await self._payloads.get_array(group.prompt_tokens)).tolist()
        completion = (await self._payloads.get_array(r.completion_tokens, of_event=gen_id)).tolist()
        inf_lp = (await self._payloads.get_array(r.logprobs, of_event=gen_id)).astype(np.float64).tolist()
        mask = [1] * len(completion)
        if r.completion_mask is not None:
            mask = (await self._payloads.get_array(r.completion_mask)).tolist()
        finish = ""
        if isinstance(r.completion_tokens, ev.LogArray):  # the generation's event, where the array lies
            gen = (await self._payloads.event(r.completion_tokens.seq)).body
            if isinstance(gen, ev.CompletionsGenerated):
                finish = next(
                    (x.finish_reason for x in gen.samples if x.generation_id == r.rollout_id),
                    gen.samples[0].finish_reason if len(gen.samples) == 1 else "",
                )
        mine = stats[offset : offset + len(completion)] if stats is not None else None
        if mine is not None and len(mine) != len(completion):
            mine = None  # the token records do not line up with this rollout: show none
        tok = self._tokenizer
        assert tok is not None
        tokens = []
        gaps = []
        for i, t in enumerate(completion):
            train_lp = float(mine[i, 0]) if mine is not None else None
            gap = (train_lp - inf_lp[i]) if train_lp is not None and mask[i] else None
            if gap is not None:
                gaps.append(abs(gap))
            tokens.append(
                {
                    "text": tok.decode([t], skip_special=False, stop_at_eos=False),
                    "id": t,
                    "model": bool(mask[i]),
                    "inference_lp": round(inf_lp[i], 5),
                    "train_lp": None if train_lp is None else round(train_lp, 5),
                    "gap": None if gap is None else round(gap, 5),
                    "route_diff": None if mine is None else int(mine[i, 1]),
                }
            )
        return {
            "rollout_id": r.rollout_id,
            "tenant": event.tenant,
            "env": group.env,
            "reward": r.reward,
            "reward_parts": dict(r.reward_parts),
            "policy_version_start": r.policy_version_start,
            "policy_version_end": r.policy_version_end,
            "staleness": step - r.policy_version_start,
            "turns": r.turns,
            "finish_reason": finish,
            "prompt_text": tok.decode(prompt, skip_special=False, stop_at_eos=False),
            "completion_text": tok.decode(completion, skip_special=False, stop_at_eos=False),
            "gap_abs_mean": round(sum(gaps) / len(gaps), 6) if gaps else None,
            "gap_abs_max": round(max(gaps), 6) if gaps else None,
            "route_diff_tokens": None if mine is None else int((mine[:, 1] > 0).sum()),
            "tokens": tokens,
        }

    def _from_store(self, step: int) -> dict[str, Any] | None:
        from jetrl.store import queries

        assert self.store is not None
        rows = queries.step_rollouts(self.store, self.run_id, step)
        if not rows:
            return None
        return {
            "step": step,
            "recorded": False,
            "metrics": {},
            "rollouts": [
                {
                    "rollout_id": r.rollout_id,
                    "tenant": r.tenant,
                    "env": r.env,
                    "reward": r.reward,
                    "reward_parts": {},
                    "policy_version_start": r.policy_version_start,
                    "policy_version_end": r.policy_version_end,
                    "staleness": r.staleness,
                    "completion_tokens": r.completion_tokens,
                    "tokens": [],
                    "note": "the run's log is not reachable, and the tokens are kept there only",
                }
                for r in rows
            ],
        }
