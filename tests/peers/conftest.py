"""The peers' tests (timm, diffusers, ema-pytorch, Lightning, stable-baselines3) skip where a peer is not installed.
With ``COPY_CORRECT_REQUIRE_PEERS=1`` (set by ``tools/peers/run.sh``, whose environment installs them all) every skip
below this folder is a failure instead, naming the skip's reason, so a peer missing there cannot pass unnoticed; a test
marked ``gpu`` still skips without a GPU."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

REQUIRED = os.environ.get("COPY_CORRECT_REQUIRE_PEERS") == "1"


def _failed(report: Any) -> None:
    """Turn the skipped ``report`` into a failure that names why it skipped."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"COPY_CORRECT_REQUIRE_PEERS=1, so this skip is a failure: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, Any, None]:
    report = (yield).get_result()
    if REQUIRED and report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("gpu") is None:
        _failed(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    report = (yield).get_result()
    if REQUIRED and report.skipped:  # a module-level importorskip
        _failed(report)
