"""The read model of a run's log: the facts its events state, and the same facts from its store.

Every reader of a run folds these facts, never event bodies: the recorder's projectors write
them to SQL (store/projectors.py), the monitor folds them into its series (consumers/monitor),
and replay into the steps, policy versions and weights it re-takes (consumers/trainer/replay.py).
So what an event means is said once, here.

- facts:       one fact type per event body, and ``fact_of`` (an event of the log → its fact)
- stored:      ``facts_of_store``: the same facts from a recorded run's rows (imported from
               there: it needs SQLAlchemy, which a trainer replaying the log never loads)
- evaluations: the summary of held-out evaluations (latest and best per tenant and env)
"""

from __future__ import annotations

from jetrl.store.readmodel.evaluations import (
    EvaluationSummary,
    summarize,
    summarize_evaluations,
)
from jetrl.store.readmodel.facts import (
    FACT_OF,
    Alerted,
    Beat,
    Dead,
    Evaluated,
    Fact,
    Finished,
    Generated,
    GeneratedSample,
    Loaded,
    Ready,
    Resumed,
    Scored,
    ScoredOne,
    Started,
    Stepped,
    Tasked,
    Versioned,
    Withheld,
    array_json,
    array_length,
    fact_of,
    worker_kind,
)

__all__ = [
    "FACT_OF",
    "Alerted",
    "Beat",
    "Dead",
    "Evaluated",
    "EvaluationSummary",
    "Fact",
    "Finished",
    "Generated",
    "GeneratedSample",
    "Loaded",
    "Ready",
    "Resumed",
    "Scored",
    "ScoredOne",
    "Started",
    "Stepped",
    "Tasked",
    "Versioned",
    "Withheld",
    "array_json",
    "array_length",
    "fact_of",
    "summarize",
    "summarize_evaluations",
    "worker_kind",
]
