"""jetrl: asynchronous RL for LLMs as an event-sourced system over NATS JetStream.

The design's top-level folders (bus/, policy/, producers/, consumers/, store/, deploy/) are
installed as subpackages of this namespace; see pyproject.toml.
"""

__version__ = "0.1.0"
