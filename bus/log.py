"""Structured logging for every jetrl process (structlog).

Each process calls :func:`configure` once; code binds run, step, tenant and worker ids with
``structlog.contextvars.bind_contextvars`` (or ``log.bind``) so every line carries them.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure(level: str | None = None, *, json: bool | None = None) -> None:
    """Console lines on a terminal, JSON lines otherwise (or when JETRL_LOG_JSON=1)."""
    global _configured
    level_name = (level or os.environ.get("JETRL_LOG_LEVEL", "info")).upper()
    if json is None:
        json = os.environ.get("JETRL_LOG_JSON") == "1" or not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level_name]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        # Not cached: module-level loggers must follow a later configure() call.
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str, **ids: object) -> structlog.typing.FilteringBoundLogger:
    """A lazy logger: it takes the configuration in force when it logs, so module-level
    loggers follow a later :func:`configure` (e.g. a command's log level)."""
    if not _configured and not structlog.is_configured():
        configure()
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name, **ids)
    return logger
