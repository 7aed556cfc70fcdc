"""A verifiers taskset, written the verifiers way, that a tiny MoE can learn on a CPU.

It is the adapter's default and its test subject: ``verifiers_env.VerifiersEnv`` loads it by
its id (``jetrl.producers.verifiers_reverse``) exactly as it loads any installed taskset
package. The tasks are every string of 2 to 4 letters over ``abcd`` (336 tasks, a finite
dataset); the reward is a ``@vf.reward`` method reading the model's reply off the trace.

Importing this module needs the optional extra: ``pip install 'jetrl[verifiers]'``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import verifiers.v1 as vf


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def positions(self, task: ReverseData, trace: vf.Trace) -> float:
        """Share of answer positions the reply got right, over the longer of the two, so
        that only the exact answer scores 1 and a longer reply pays for its extra letters."""
        reply, answer = trace.last_reply, task.answer
        hits = sum(a == b for a, b in zip(reply, answer, strict=False))
        return hits / max(len(answer), len(reply))

    @vf.metric
    async def exact(self, task: ReverseData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)


class ReverseTextTaskset(vf.Taskset[ReverseTask, vf.TasksetConfig]):
    alphabet = "abcd"

    def load(self) -> Iterator[ReverseTask]:
        for n in (2, 3, 4):
            for letters in itertools.product(self.alphabet, repeat=n):
                s = "".join(letters)
                yield ReverseTask(ReverseData(prompt=f"{s}=", answer=s[::-1]), self.config.task)


__all__ = ["ReverseTextTaskset"]
