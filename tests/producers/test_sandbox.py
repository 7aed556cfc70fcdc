"""The expression sandbox: the language it allows, what it refuses, and the worker's limits."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from jetrl.producers import sandbox
from jetrl.producers.sandbox import Sandbox, check

# Products of big numbers pass every static bound and take tens of seconds (quadratic in the
# factors): the worker's limits are what stops them.
BIG = "(9**99999)"
SLOW = "*".join([BIG] * 90)


@pytest.fixture(scope="module")
def box() -> Iterator[Sandbox]:
    with Sandbox(timeout_s=10.0) as s:
        yield s


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("abs(-4) + min(3, 1, 2) + max(1, 5)", 10),
        ("round(2.567, 2)", 2.57),
        ("pow(3, 4)", 81),
        ("sqrt(16) + math.sqrt(9)", 7.0),
        ("floor(2.5) + ceil(2.5) + gcd(12, 18)", 11),
        ("1 < 2 <= 2 != 3", True),
        ("3 > 2 > 2", False),
        ("not 0 and 5", 5),
        ("0 or 4", 4),
        ("math.pi > 3 and e < 3", True),
        ("1e3 * 2", 2000.0),
    ],
)
def test_allowed_expressions(box: Sandbox, expr: str, value: object) -> None:
    r = box.evaluate(expr)
    assert r.ok and r.value == value and type(r.value) is type(value), (expr, r)


@pytest.mark.parametrize(
    ("expr", "error"),
    [
        ("os", "not allowed: name 'os'"),
        ("os.system('ls')", "not allowed: name 'os'"),
        ("__import__('os')", "not allowed: name '__import__'"),
        ("(1).__class__", "not allowed: attribute '__class__'"),
        ("math.os", "not allowed: attribute 'os'"),
        ("math.floor.__globals__", "not allowed: attribute 'floor'"),  # a function is no value
        ("(1).__class__.__bases__", "not allowed: attribute '__class__'"),
        ("lambda: 1", "not allowed: Lambda"),
        ("(lambda: 1)()", "not allowed: Lambda"),
        ("[x for x in (1, 2)]", "not allowed: ListComp"),
        ("sum(x for x in (1, 2))", "not allowed: name 'sum'"),
        ("(1, 2)", "not allowed: Tuple"),
        ("[1][0]", "not allowed: Subscript"),
        ("'a' * 10", "not allowed: str literal"),
        ("1j", "not allowed: complex literal"),
        ("1 if 2 else 3", "not allowed: IfExp"),
        ("1 << 1000", "not allowed: operator LShift"),
        ("1 in 2", "not allowed: comparison other than == != < <= > >="),
        ("(x := 1)", "not allowed: NamedExpr"),
        ("round(1.5, ndigits=1)", "not allowed: keyword or starred arguments"),
        ("max(*[1, 2])", "not allowed: keyword or starred arguments"),
        ("sqrt(1, 2)", "sqrt takes 1"),
        ("min(1)", "min takes 2..16 arguments"),
        ("pi(1)", "not allowed: calling that"),
    ],
)
def test_forbidden_expressions_are_refused(box: Sandbox, expr: str, error: str) -> None:
    assert check(expr) == error
    r = box.evaluate(expr)
    assert not r.ok and r.error == error and r.text == f"error: {error}"


@pytest.mark.parametrize(
    "expr",
    [
        "import os",
        "exec('1')\nimport os",
        "1 +",
        "",
        "((((",
        "\x00",
        "\ud800",
        "2 +* 3",
        "1; 2",
        "def f(): pass",
    ],
)
def test_garbage_is_a_syntax_error(box: Sandbox, expr: str) -> None:
    r = box.evaluate(expr)
    assert not r.ok and r.error.startswith("syntax error"), r


def test_bad_input_never_raises(box: Sandbox) -> None:
    assert box.evaluate(None).error == "not an expression: expected text"
    assert box.evaluate(b"1+1").error == "not an expression: expected text"
    assert box.evaluate("1+" * 600 + "1").error.startswith("too long")
    assert box.evaluate("-" * 500 + "1").ok  # deep, but within bounds
    assert not box.evaluate("(" * 400 + "1" + ")" * 400).ok  # the parser's own nesting limit


@pytest.mark.parametrize(
    ("expr", "error"),
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("10.0 ** 400", "overflow"),
        ("exp(1000)", "overflow"),
        ("sqrt(-1)", "bad value: math domain error"),
        ("(-8) ** 0.5", "not a real number"),
        ("10 ** 1000", "result too large (over 1000 digits)"),
        ("round(1, -1000)", "round: digits beyond 100"),
    ],
)
def test_errors_of_evaluation_are_answers(box: Sandbox, expr: str, error: str) -> None:
    assert check(expr) is None  # in the language: the worker finds the error
    r = box.evaluate(expr)
    assert not r.ok and r.error == error, r
    assert box.evaluate("2 + 2").value == 4  # and the worker lives on


def test_huge_powers_are_refused_before_they_are_computed(box: Sandbox) -> None:
    starts = box.starts
    for expr in ("9**9**9", "pow(10, 10**7)", "(2**999999) ** 2", "2 ** 2 ** 100"):
        r = box.evaluate(expr)
        assert not r.ok and r.error.startswith("number too large"), (expr, r)
    assert box.starts == starts  # refused by the evaluator, not by killing the worker
    assert box.evaluate("2 ** 999999 > 0").value is True  # just under the bound is computed


def test_a_slow_expression_times_out_and_the_worker_is_replaced() -> None:
    with Sandbox(timeout_s=0.5) as s:
        assert s.evaluate("1 + 1").value == 2 and s.starts == 1
        r = s.evaluate(SLOW)
        assert not r.ok and r.error == sandbox.TIMEOUT
        assert s.evaluate("3 * 3").value == 9 and s.starts == 2


def test_the_memory_limit_stops_a_big_product() -> None:
    x = "(2**999999)"  # 125 kB; eight of them make 1 MB, over a worker allowed 1 MiB more
    expr = f"(({x}*{x})*({x}*{x}))*(({x}*{x})*({x}*{x}))"
    with Sandbox(timeout_s=60.0, memory_mb=1) as s:
        r = s.evaluate(expr)
        assert not r.ok and r.error == sandbox.MEMORY, r
        assert s.evaluate("3 * 3").value == 9 and s.starts == 2  # a fresh worker
    with Sandbox(timeout_s=60.0, memory_mb=64) as s:  # the same product within a larger limit
        r = s.evaluate(f"{expr} > 0")
        assert r.ok and r.value is True, r


def test_the_cpu_limit_ends_a_worker_nobody_waits_for() -> None:
    # A wall-time limit far above the CPU limit: the worker's own RLIMIT_CPU ends it.
    with Sandbox(timeout_s=120.0, cpu_s=1) as s:
        r = s.evaluate(SLOW)
        assert not r.ok and r.error == sandbox.CPU, r
        assert s.evaluate("3 * 3").value == 9 and s.starts == 2


def test_a_worker_killed_between_calls_is_replaced(box: Sandbox) -> None:
    assert box.evaluate("1").ok
    proc = box._proc
    assert proc is not None
    proc.kill()
    proc.wait()
    assert box.evaluate("6 * 7").value == 42


def test_a_worker_that_cannot_start_is_an_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")  # the worker's interpreter
    with Sandbox() as s:
        r = s.evaluate("1 + 1")
        assert not r.ok and r.error.startswith("worker failed:"), r


def test_results_as_text() -> None:
    assert sandbox.Result(True, 4.0).text == "4"
    assert sandbox.Result(True, 2.5).text == "2.5"
    assert sandbox.Result(True, 12).text == "12"
    assert sandbox.Result(False, error="timeout").text == "error: timeout"


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        Sandbox(timeout_s=0)
    with pytest.raises(ValueError):
        Sandbox(memory_mb=0)
