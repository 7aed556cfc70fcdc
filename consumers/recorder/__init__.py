"""consumers/recorder: the log → SQL projection (docs/store.md).

Run it as its own process: ``python -m jetrl.consumers.recorder --nats-url URL --run RUN --settings
'{"db": URL}'``.
"""

from jetrl.consumers.recorder.recorder import DEFAULT_DURABLE, Lag, Recorder, RecorderStats

__all__ = ["DEFAULT_DURABLE", "Lag", "Recorder", "RecorderStats"]
