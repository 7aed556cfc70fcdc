"""A sandboxed evaluator of Python arithmetic *expressions*, for tool calls.

What is allowed (checked on the ``ast`` before anything runs, and again in the worker):

* numeric literals (int, float; True/False), the names ``pi`` and ``e``;
* ``+ - * / // % **``, unary ``+ -``, ``not``, ``and``/``or``, comparisons (chains too),
  parentheses;
* calls, positional arguments only, of ``abs min max round pow sqrt exp log log2 log10 floor
  ceil sin cos tan gcd``, bare or as ``math.<name>`` (``math.pi`` and ``math.e`` too).

Everything else (other names, attributes, strings, subscripts, lambdas, comprehensions,
keyword arguments, statements) is refused with ``"not allowed: ..."`` or ``"syntax error:
..."``; no code object is ever compiled: the worker walks the tree itself.

Bounds: an expression has at most ``MAX_CHARS`` characters; ``int ** int`` (and ``pow``) whose
result would pass ``MAX_POW_BITS`` bits is refused before it is computed (``9**9**9`` costs
nothing); ``round``'s digits are bounded; a result of more than ``MAX_RESULT_DIGITS`` digits is
an error. What the static bounds cannot see (a long chain of big products) meets the limits of
the worker process:

* wall time (``timeout_s``): the caller stops waiting and kills the worker -> ``"timeout"``;
* memory (``memory_mb``): ``RLIMIT_AS`` is the worker's idle address space plus this much, so
  the bound means the same whatever the interpreter's own footprint -> ``"memory limit"``;
* CPU (``cpu_s`` per evaluation, ``RLIMIT_CPU``): a backstop that also ends a worker whose
  caller died while it was computing (an idle worker exits when its stdin closes) ->
  ``"cpu limit"``.

The worker is a persistent ``python -I -S`` process running this file (stdlib only: it imports
nothing of ours or of site-packages), fed one JSON line per expression; it is started on first
use and started again after a timeout, a memory error or a crash, so a bad call costs one
process start and the next call finds a fresh worker. A :class:`Sandbox` serves one call at a
time (a lock); every public path returns a :class:`Result`, never raises on bad input.
"""

from __future__ import annotations

import ast
import json
import math
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_CHARS = 1000
MAX_POW_BITS = 1_000_000  # 2**1e6 is instant; the bound keeps pow from being the easy blow-up
MAX_RESULT_DIGITS = 1000
MAX_ROUND_DIGITS = 100
TIMEOUT, MEMORY, CPU = "timeout", "memory limit", "cpu limit"

Number = int | float


class _Refused(Exception):
    """An expression outside the language or its bounds: the message is the error text."""


# ---------------------------------------------------------------- the language


def _power(base: Number, exp: Number) -> Number:
    ints = isinstance(base, int) and isinstance(exp, int)
    if ints and exp > 0 and abs(base) > 1 and exp * math.log2(abs(base)) > MAX_POW_BITS:
        raise _Refused(f"number too large (a power over {MAX_POW_BITS} bits)")
    result: Number = base**exp
    return result


def _round(x: Number, ndigits: int | None = None) -> Number:
    if ndigits is not None and isinstance(ndigits, int) and abs(ndigits) > MAX_ROUND_DIGITS:
        raise _Refused(f"round: digits beyond {MAX_ROUND_DIGITS}")
    return round(x, ndigits)


# name -> (function, fewest arguments, most arguments)
FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int]] = {
    "abs": (abs, 1, 1),
    "min": (min, 2, 16),
    "max": (max, 2, 16),
    "round": (_round, 1, 2),
    "pow": (_power, 2, 2),
    "sqrt": (math.sqrt, 1, 1),
    "exp": (math.exp, 1, 1),
    "log": (math.log, 1, 2),
    "log2": (math.log2, 1, 1),
    "log10": (math.log10, 1, 1),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
    "sin": (math.sin, 1, 1),
    "cos": (math.cos, 1, 1),
    "tan": (math.tan, 1, 1),
    "gcd": (math.gcd, 2, 2),
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: _power,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: lambda a: +a,
    ast.USub: lambda a: -a,
    ast.Not: lambda a: not a,
}
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
}


def _is_math(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "math"


def _callee(node: ast.expr) -> str:
    """The whitelisted function a call names (``sqrt`` or ``math.sqrt``)."""
    if isinstance(node, ast.Name) and node.id in FUNCTIONS:
        return node.id
    if isinstance(node, ast.Attribute) and _is_math(node.value) and node.attr in FUNCTIONS:
        return node.attr
    _check(node)  # says what is wrong with it
    raise _Refused("not allowed: calling that")


def _check(node: ast.AST) -> None:
    """Raise _Refused for anything outside the language."""
    if isinstance(node, ast.Expression):
        _check(node.body)
    elif isinstance(node, ast.Constant):
        if type(node.value) not in (int, float, bool):
            raise _Refused(f"not allowed: {type(node.value).__name__} literal")
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY:
            raise _Refused(f"not allowed: operator {type(node.op).__name__}")
        _check(node.left)
        _check(node.right)
    elif isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY:
            raise _Refused(f"not allowed: operator {type(node.op).__name__}")
        _check(node.operand)
    elif isinstance(node, ast.BoolOp):
        for v in node.values:
            _check(v)
    elif isinstance(node, ast.Compare):
        if any(type(op) not in _COMPARE for op in node.ops):
            raise _Refused("not allowed: comparison other than == != < <= > >=")
        for v in (node.left, *node.comparators):
            _check(v)
    elif isinstance(node, ast.Call):
        name = _callee(node.func)
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise _Refused("not allowed: keyword or starred arguments")
        _, lo, hi = FUNCTIONS[name]
        if not lo <= len(node.args) <= hi:
            raise _Refused(f"{name} takes {lo}..{hi} arguments" if lo != hi else f"{name} takes {lo}")
        for a in node.args:
            _check(a)
    elif isinstance(node, ast.Name):
        if node.id not in CONSTANTS:
            raise _Refused(f"not allowed: name {node.id!r}")
    elif isinstance(node, ast.Attribute):
        if not _is_math(node.value):
            _check(node.value)  # "name 'os'" says more than "attribute 'system'"
        if not (_is_math(node.value) and node.attr in CONSTANTS):
            raise _Refused(f"not allowed: attribute {node.attr!r}")
    else:
        raise _Refused(f"not allowed: {type(node).__name__}")


def parse(expr: object) -> ast.Expression:
    """The checked tree of ``expr``; raises _Refused with the reason otherwise."""
    if not isinstance(expr, str):
        raise _Refused("not an expression: expected text")
    if len(expr) > MAX_CHARS:
        raise _Refused(f"too long (over {MAX_CHARS} characters)")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise _Refused(f"syntax error: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes; absurd nesting
        raise _Refused(f"syntax error: {type(e).__name__}") from None
    _check(tree)
    return tree


def check(expr: object) -> str | None:
    """Why ``expr`` is refused, or None when it is in the language (nothing is evaluated)."""
    try:
        parse(expr)
    except _Refused as e:
        return str(e)
    except RecursionError:
        return "too deeply nested"
    return None


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BoolOp):  # short-circuits, and yields an operand, as Python does
        value: Any = None
        for v in node.values:
            value = _eval(v)
            if bool(value) == isinstance(node.op, ast.Or):
                return value
        return value
    if isinstance(node, ast.Compare):
        left = _eval(node.left)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = _eval(comp)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call):
        return FUNCTIONS[_callee(node.func)][0](*[_eval(a) for a in node.args])
    if isinstance(node, ast.Name):
        return CONSTANTS[node.id]
    if isinstance(node, ast.Attribute):
        return CONSTANTS[node.attr]
    raise _Refused(f"not allowed: {type(node).__name__}")  # parse() lets nothing else through


_RESULT_BOUND = 10**MAX_RESULT_DIGITS


def evaluate_here(expr: object) -> dict[str, Any]:
    """Evaluate in this process, without limits (the worker's body): ``{"ok": True, "value":
    v}`` or ``{"ok": False, "error": text}``."""
    try:
        value = _eval(parse(expr))
        if isinstance(value, complex):
            return {"ok": False, "error": "not a real number"}
        if isinstance(value, int) and abs(value) >= _RESULT_BOUND:
            return {"ok": False, "error": f"result too large (over {MAX_RESULT_DIGITS} digits)"}
        return {"ok": True, "value": value}
    except _Refused as e:
        return {"ok": False, "error": str(e)}
    except MemoryError:
        return {"ok": False, "error": MEMORY}
    except RecursionError:
        return {"ok": False, "error": "too deeply nested"}
    except ZeroDivisionError:
        return {"ok": False, "error": "division by zero"}
    except OverflowError:
        return {"ok": False, "error": "overflow"}
    except (ArithmeticError, ValueError, TypeError) as e:
        return {"ok": False, "error": f"bad value: {e}"[:200]}
    except Exception as e:  # whatever else: an answer, not a dead worker
        return {"ok": False, "error": f"failed: {type(e).__name__}"}


# ---------------------------------------------------------------- the worker (child side)


def _idle_address_space() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 256 * 1024**2  # no /proc (macOS): a generous guess at an interpreter's footprint


def _serve(memory_mb: int, cpu_s: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core files from SIGXCPU
    limit = _idle_address_space() + memory_mb * 1024**2
    _, as_hard = resource.getrlimit(resource.RLIMIT_AS)
    if as_hard != resource.RLIM_INFINITY:  # an unprivileged process may only lower it
        limit = min(limit, as_hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    for line in sys.stdin:  # ends when the caller closes the pipe (or dies)
        try:
            expr = json.loads(line)["expr"]
        except (ValueError, KeyError, TypeError):
            reply: dict[str, Any] = {"ok": False, "error": "bad request"}
        else:
            # RLIMIT_CPU counts the process's whole life: allow cpu_s more than used so far.
            used = resource.getrusage(resource.RUSAGE_SELF)
            soft = math.ceil(used.ru_utime + used.ru_stime) + cpu_s
            if cpu_hard != resource.RLIM_INFINITY:
                soft = min(soft, cpu_hard)
            resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_hard))
            reply = evaluate_here(expr)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        if reply.get("error") == MEMORY:
            return  # a fresh worker rather than one that just ran out of memory


# ---------------------------------------------------------------- the caller's side


@dataclass(frozen=True)
class Result:
    ok: bool
    value: Number | None = None
    error: str = ""

    @property
    def text(self) -> str:
        """The value as a calculator shows it, or ``error: ...``."""
        if not self.ok:
            return f"error: {self.error}"
        if isinstance(self.value, float) and self.value.is_integer() and abs(self.value) < 1e16:
            return str(int(self.value))
        return str(self.value)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


class Sandbox:
    """Evaluates expressions in a limited worker process; see the module docstring."""

    def __init__(self, *, timeout_s: float = 2.0, memory_mb: int = 256, cpu_s: int | None = None) -> None:
        if timeout_s <= 0 or memory_mb < 1:
            raise ValueError("need timeout_s > 0 and memory_mb >= 1")
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        # Above the wall-time limit: on a healthy machine the caller's timeout comes first.
        self.cpu_s = cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1
        if self.cpu_s < 1:
            raise ValueError("cpu_s must be >= 1")
        self.starts = 0  # worker processes started (one, plus one per kill)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reaper: weakref.finalize[Any, Any] | None = None  # kills the worker with the Sandbox
        self._buf = b""
        self._lock = threading.Lock()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def evaluate(self, expr: object) -> Result:
        refused = check(expr)  # refused here: no round trip, no worker needed
        if refused is not None:
            return Result(False, error=refused)
        failure: Exception | None = None
        with self._lock:
            for _ in range(2):  # a worker that died between calls: once more, on a fresh one
                try:
                    return self._ask(str(expr))
                except (OSError, ValueError) as e:  # a broken pipe, no process, a garbled reply
                    self._stop()
                    failure = e
        return Result(False, error=f"worker failed: {failure}"[:200])

    # -------------------------------------------------------------- worker handling

    def _start(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        # Big blocks always from mmap, so that freed memory leaves the address space and the
        # worker's headroom under RLIMIT_AS stays what it was.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(self.memory_mb), str(self.cpu_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            bufsize=0,
        )
        self._reaper = weakref.finalize(self, _kill, proc)
        self.starts += 1
        self._buf = b""
        return proc

    def _stop(self) -> None:
        if self._reaper is not None:
            self._reaper()  # kills the worker, once
        self._proc = self._reaper = None

    def _ask(self, expr: str) -> Result:
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._proc = self._start()
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write((json.dumps({"expr": expr}) + "\n").encode())
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([proc.stdout], [], [], left)[0] if left > 0 else []
            if not ready:
                self._stop()
                return Result(False, error=TIMEOUT)
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                return self._died(proc)
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        reply = json.loads(line)
        if not reply["ok"]:
            if reply["error"] == MEMORY:
                self._stop()
            return Result(False, error=str(reply["error"]))
        return Result(True, value=reply["value"])

    def _died(self, proc: subprocess.Popen[bytes]) -> Result:
        code = proc.wait()
        self._stop()
        if code == -signal.SIGXCPU:
            return Result(False, error=CPU)
        return Result(False, error=f"worker died (exit status {code})")


if __name__ == "__main__":  # the worker: python -I -S sandbox.py MEMORY_MB CPU_S
    _serve(int(sys.argv[1]), int(sys.argv[2]))
