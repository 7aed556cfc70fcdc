"""A `verifiers` taskset as a jetrl environment.

verifiers (``verifiers.v1``) splits an environment into a taskset (tasks: a prompt plus
whatever scoring needs) and the tasks' own scoring (``@vf.reward`` / ``@vf.metric`` methods,
and judges, reading a trace of the conversation). This adapter takes both from an installed
taskset package, named by its verifiers id, and plays the part of verifiers' chat harness
itself: the task's prompt goes out as a TaskSubmitted, the policy answers through the bus
like for any other environment, and the reply is scored by ``Task.score`` on a trace that
holds the conversation. The task's wire data rides in the event's ``info``, so scoring needs
nothing but the event (a restarted producer scores what its predecessor handed out).

What it does not run: verifiers harnesses that are programs in a runtime (tools, sandboxes,
user simulators) and rewards that need that runtime. Those call the model over an
OpenAI-compatible endpoint; a taskset that needs one is refused when the environment is built,
with the reason.

The tokenizer is the model's: a task whose prompt it cannot write is skipped and counted.
The optional extra installs verifiers: ``pip install 'jetrl[verifiers]'`` (torch untouched).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import random
from collections.abc import Iterator
from typing import Any

from jetrl.bus.log import get_logger
from jetrl.policy.tokenizer import ChatMessage, Tokenizer
from jetrl.producers.environments import Environment, FollowUp, Score, Task

DEFAULT_TASKSET = "jetrl.producers.verifiers_reverse"
TASK_KEY = "vf_task"  # the verifiers task's wire data, in TaskSubmitted.info
MAX_SKIPPED_IN_A_ROW = 1000  # an endless taskset that the tokenizer cannot write at all

log = get_logger(__name__)


def _needs_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _dotted_taskset(vf: Any, module_path: str) -> type[Any]:
    """A taskset named by a module path (``pkg.module``): verifiers' loader takes only
    top-level package ids (``owner/name`` from the hub, or an installed ``name``)."""
    module = importlib.import_module(module_path)
    found = [
        obj
        for name in getattr(module, "__all__", ())
        if isinstance(obj := getattr(module, name, None), type)
        and issubclass(obj, vf.Taskset)
        and obj is not vf.Taskset
    ]
    if len(found) != 1:
        raise ValueError(f"module {module_path!r} must export exactly one Taskset subclass in __all__")
    return found[0]


class VerifiersEnv(Environment):
    name = "verifiers"

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        taskset: str = DEFAULT_TASKSET,
        taskset_config: dict[str, Any] | None = None,
        max_tokens: int = 8,
        score_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(tokenizer)
        try:
            import verifiers.v1 as vf
            from verifiers.v1.graph import MessageNode
            from verifiers.v1.trace import AgentInfo, TraceTask
            from verifiers.v1.utils.generic import concrete_type
            from verifiers.v1.utils.loaders import taskset_class
        except ImportError as e:
            raise ImportError(
                f"the verifiers environment needs the optional extra: pip install 'jetrl[verifiers]' ({e})"
            ) from e
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.vf = vf
        self._node, self._trace_task = MessageNode, TraceTask
        self._agent = AgentInfo(config=vf.AgentConfig())  # the same for every trace: built once
        cls = _dotted_taskset(vf, taskset) if "." in taskset else taskset_class(taskset)
        config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        self.taskset = cls(config_cls(id=taskset, **(taskset_config or {})))
        self.task_cls = cls.task_type()
        self.data_cls = self.task_cls.data_type()
        self.taskset_id = taskset
        self.max_tokens = max_tokens
        # A reward that hangs (a judge waiting on a model, say) fails the scoring, which the
        # producer retries and in the end dead-letters, instead of holding the group forever.
        self.score_timeout_s = score_timeout_s
        if self.task_cls.NEEDS_CONTAINER:
            raise ValueError(f"taskset {taskset!r} needs a container; the jetrl adapter runs none")
        probe = self.task_cls(self.data_cls.model_construct(), self.taskset.config.task)
        if needy := [fn.__name__ for fn in probe.hooks("reward") if _needs_runtime(fn)]:
            raise ValueError(
                f"taskset {taskset!r} scores with a runtime (rewards {needy}); the jetrl adapter "
                "scores the conversation alone"
            )
        self._pool: list[Task] | None = None  # a finite taskset's writable tasks
        self._stream: Iterator[Any] | None = None  # an endless one
        self.skipped = 0  # tasks whose prompt the tokenizer cannot write

    # ------------------------------------------------------------------ tasks out

    def render(self, data: Any) -> str:
        """The prompt as the model sees it: the system prompt, then the prompt's messages,
        rendered by the tokenizer's chat template."""
        prompt = data.prompt
        msgs: list[ChatMessage] = [{"role": "system", "content": data.system_prompt or ""}]
        if prompt is None or isinstance(prompt, str):
            msgs.append({"role": "user", "content": prompt or ""})
        else:
            msgs += [{"role": m.role, "content": self.vf.types.content_text(m.content)} for m in prompt]
        return self.tok.render_chat(msgs)

    def _writable(self, vf_task: Any) -> Task | None:
        text = self.render(vf_task.data)
        try:
            tokens = self.tok.encode(text)
        except ValueError:
            self.skipped += 1
            return None
        info = {TASK_KEY: vf_task.data.model_dump(mode="json", exclude_none=True)}
        return Task(text, tokens, self.max_tokens, info)

    def _load_pool(self) -> list[Task]:
        pool = [t for t in map(self._writable, self.taskset) if t is not None]
        if not pool:
            raise ValueError(
                f"no task of taskset {self.taskset_id!r} can be written with the model's tokenizer "
                f"({self.skipped} skipped)"
            )
        log.info("verifiers_taskset_loaded", taskset=self.taskset_id, tasks=len(pool), skipped=self.skipped)
        return pool

    def prepare(self) -> None:
        if self.taskset.bounded and self._pool is None:
            self._pool = self._load_pool()

    def make_task(self, rng: random.Random) -> Task:
        if self.taskset.bounded:
            self.prepare()
            assert self._pool is not None
            return self._pool[rng.randrange(len(self._pool))]
        if self._stream is None:
            self._stream = iter(self.taskset)
        for vf_task in itertools.islice(self._stream, MAX_SKIPPED_IN_A_ROW):
            if (task := self._writable(vf_task)) is not None:
                return task
        raise ValueError(
            f"taskset {self.taskset_id!r}: {MAX_SKIPPED_IN_A_ROW} tasks in a row cannot be written "
            "with the model's tokenizer, or the taskset ended"
        )

    # ------------------------------------------------------------------ scores in

    def score(self, info: dict[str, Any], completion_tokens: list[int]) -> Score:
        raise TypeError("verifiers scoring is asynchronous: use areact()")

    async def areact(self, info: dict[str, Any], turn: int, completion_tokens: list[int]) -> Score | FollowUp:
        vf, node = self.vf, self._node
        try:
            data = self.data_cls.model_validate(info[TASK_KEY])
        except (KeyError, ValueError) as e:
            raise ValueError(f"task info holds no valid {self.data_cls.__name__}: {e}") from e
        task = self.task_cls(data, self.taskset.config.task)
        reply = self.tok.decode(completion_tokens)
        trace = vf.Trace(
            task=self._trace_task(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
            agent=self._agent,
            nodes=[
                node(message=vf.UserMessage(content=self.render(data))),
                node(parent=0, message=vf.AssistantMessage(content=reply), sampled=True),
            ],
            is_completed=True,
            ok=True,
        )
        async with asyncio.timeout(self.score_timeout_s):
            await task.score(trace)
        unscored = [k for k, r in trace.rewards.items() if r is None]
        if unscored:
            raise ValueError(f"taskset {self.taskset_id!r} left rewards {unscored} unscored")
        parts = {k: float(v) for k, v in trace.metrics.items() if v is not None}
        parts.update({k: float(r.score) for k, r in trace.rewards.items() if r is not None})
        return Score(reward=float(trace.reward), parts=parts)
