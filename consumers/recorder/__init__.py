"""consumers/recorder: the log → SQL projection (docs/store.md).

Run it as its own process: ``python -m jetrl.consumers.recorder --nats-url URL --run RUN --settings
'{"db": URL}'``.
"""

from jetrl.consumers.recorder.recorder import Lag, Recorder, RecorderStats, configure_gc
from jetrl.consumers.recorder.settings import DEFAULT_DURABLE

__all__ = ["DEFAULT_DURABLE", "Lag", "Recorder", "RecorderStats", "configure_gc"]
