"""bench/weights.py's figures on what a slow machine leaves: no round measured, no floor, a
zero floor. A clear line, never a crash; no store or worker is started."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.support.benches import load_bench


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("weights")


def test_median_and_ratio_of_nothing(bench: ModuleType) -> None:
    assert bench.median([]) is None
    assert bench.median([3.0, 1.0, 2.0]) == 2.0
    assert bench.ratio(None, 1.0) is None
    assert bench.ratio(1.0, None) is None
    assert bench.ratio(1.0, 0.0) is None
    assert bench.ratio(3.0, 2.0) == 1.5


def test_best_store_skips_what_was_not_measured(bench: ModuleType) -> None:
    assert bench.best_store({}) is None
    assert bench.best_store({"objstore": None, "file": None}) is None
    assert bench.best_store({"objstore": None, "file": 0.5, "mooncake": 0.3}) == ("mooncake", 0.3)


def test_summary_lines(bench: ModuleType) -> None:
    assert "too slow to measure" in bench.summary_line("500 MB", {"objstore": None}, 0.2)
    assert "too slow to measure" in bench.summary_line("500 MB", {}, None)
    no_floor = bench.summary_line("50 MB", {"file": 0.25}, None)
    assert "file 250.0 ms" in no_floor and "loopback floor too slow" in no_floor
    assert "loopback floor too slow" in bench.summary_line("50 MB", {"file": 0.25}, 0.0)
    met = bench.summary_line("500 MB", {"objstore": 9.0, "mooncake": 0.3}, 0.2)
    assert met == "weights best store 500 MB: mooncake 1.5x loopback (target <= 2x, met)"
    assert bench.summary_line("50 MB", {"file": 1.0}, 0.2).endswith("(target <= 2x, missed)")


def test_figure_lines(bench: ModuleType) -> None:
    assert "not measured" in bench.figure_line("50 MB", "objstore", None, 50_000_000, 0.1)
    assert "no loopback floor" in bench.figure_line("50 MB", "file", 0.2, 50_000_000, None)
    assert "- GB/s" in bench.figure_line("50 MB", "memcpy", 0.0, 50_000_000, 0.1)
    assert "2.00x loopback" in bench.figure_line("50 MB", "file", 0.2, 50_000_000, 0.1)
    assert bench.size_label(500_000_000) == "500 MB"


def test_paired_ratios_decide_the_best_store(bench: ModuleType) -> None:
    """A store's ratio is to the loopback rounds run beside its own: the best store is the one
    of lowest ratio, whatever the floor measured before says."""
    medians = {"objstore": 9.0, "file": 0.3, "mooncake": 0.4}
    paired = {"objstore": 40.0, "file": 2.5, "mooncake": 1.6}
    line = bench.summary_line("500 MB", medians, 0.1, paired)
    assert line == "weights best store 500 MB: mooncake 1.6x loopback (target <= 2x, met)"
    assert bench.summary_line("50 MB", medians, 0.1, {"file": 2.5, "mooncake": None}).endswith(
        "file 2.5x loopback (target <= 2x, missed)"
    )
    # No paired ratio at all: the floor measured before decides, as without pairing.
    assert "file 3.0x" in bench.summary_line("50 MB", medians, 0.1, {"file": None, "mooncake": None})
    assert "1.60x loopback" in bench.figure_line("50 MB", "file", 0.4, 50_000_000, 0.1, 1.6)
