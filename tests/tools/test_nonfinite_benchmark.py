"""``benchmarks/nonfinite_stop.py`` runs end to end at its smallest (one round, one epoch); no timing is asserted."""

from __future__ import annotations

from pathlib import Path

from benchmarks.nonfinite_stop import fits, hooks


def test_the_benchmark_measures_the_hooks_and_three_fits(tmp_path: Path) -> None:
    assert all(seconds > 0 for seconds in hooks(tmp_path, repeat=1))
    times, steps = fits(tmp_path, repeat=1, epochs=1)
    assert steps == 90 and sorted(times) == ["with NonFiniteStop", "with an empty Callback instead", "without"]
    assert all(len(seconds) == 1 for seconds in times.values())
