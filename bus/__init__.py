"""bus/: the layer through which every part of jetrl talks (imports nothing else of jetrl).

- events:   the event catalog and its strict codec
- ids:      every id of a run (tasks, groups, rollouts, derived event ids), built and parsed
- subjects: the subject layout of a run's log
- streams:  the per-run stream and payload bucket, with explicit limits
- client:   connect, publish (single and pipelined), durable pull consumers, dead letters, tail
- payloads: the claim-check for large arrays (object store, shared filesystem)
- server:   a private nats-server for the embedded default and the tests
- log:      structlog configuration
- runtime:  process plumbing: signals, the part entry point
- settings: the ``[bus]`` section and the base of every settings section
"""
