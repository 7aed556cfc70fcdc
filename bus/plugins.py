"""Plugins: the object a setting names, a built-in by its short name or anything importable as
``package.module:attr``. A leaf module (nothing of jetrl's): every room that may import bus/ uses
it. policy/ may not (tests/system/test_layout.py), so its tokenizers are still chosen by name."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def load_plugin(spec: str, builtins: Mapping[str, str], what: str) -> Any:
    """The object a setting names: a built-in name of ``builtins`` (which maps names to
    ``module:attr``), or any ``package.module:attr``. Imported only when asked for, so a
    torch-free caller stays torch-free until it builds the thing."""
    target = builtins.get(spec, spec)
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"unknown {what} {spec!r}: give one of {sorted(builtins)} or 'package.module:attr'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {what} {spec!r} ({target}): {exc}") from exc
