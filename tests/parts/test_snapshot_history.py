"""``snapshot_gaps``: a history followed by its links names the missing snapshot, up to the step asked for; snapshots
that name no previous one are checked by their schedule (the control: a history missing its first snapshots still
synthesizes, silently, another average). ``link_or_copy``: a hard link, or an atomic copy where linking fails."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from copy_correct import PowerEMA, synthesize
from copy_correct.averages.power_ema import snapshot_name
from copy_correct.averages.snapshot_history import check_snapshot_history, snapshot_gaps
from copy_correct.files.link_or_copy import link_or_copy


def write_history(folder: Path, steps: list[int], *, links: bool, final: int | None = None) -> dict[int, Path]:
    """Snapshots of a PowerEMA of a small linear model at ``steps`` (with ``previous`` links when ``links``), and a
    final one at ``final``."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ema = PowerEMA(model, sigma_rels=(0.05, 0.1))
    written, previous = {}, 0
    for step in range(1, max([*steps, final or 0]) + 1):
        with torch.no_grad():
            model.weight.add_(0.01 * torch.randn_like(model.weight))
        ema.update()
        if step in steps or step == final:
            state: dict[str, Any] = dict(ema.snapshot())
            if links:
                state["previous"] = previous
            if step == final:
                state["final"] = True
            else:
                previous = step
            written[step] = folder / snapshot_name(step)
            torch.save(state, written[step])
    return written


def test_a_missing_link_is_named_and_only_the_history_up_to_the_step_counts(tmp_path: Path) -> None:
    files = write_history(tmp_path, [2, 4, 6, 8], links=True, final=9)
    assert snapshot_gaps(tmp_path) == []
    files[4].unlink()
    assert snapshot_gaps(tmp_path) == [f"{tmp_path}: the snapshot of step 4, which {files[6].name} follows, is missing"]
    assert snapshot_gaps(tmp_path, step=3) == []  # the history up to step 3 is step 2's
    loaded = {path: torch.load(path, weights_only=True) for path in [files[2], files[6]]}
    loaded[files[6]]["previous"] = 2  # states the caller loaded already are used as given, not read again
    assert snapshot_gaps(tmp_path, step=7, states=loaded) == []
    with pytest.raises(ValueError, match=r"the snapshot of step 4, which power-ema-000000006\.pt follows"):
        check_snapshot_history(tmp_path, step=7)


def test_snapshots_without_links_are_checked_by_their_schedule(tmp_path: Path) -> None:
    write_history(tmp_path / "whole", [100, 200, 300, 400], links=False, final=450)
    assert snapshot_gaps(tmp_path / "whole") == []
    files = write_history(tmp_path / "late", [100, 200, 300, 400], links=False)
    complete = synthesize(tmp_path / "late", 0.08)
    files[100].unlink(), files[200].unlink()  # what a resumed run's directory held: its own snapshots only
    late = synthesize(tmp_path / "late", 0.08)  # the control: it synthesizes, silently, another average
    assert not torch.equal(late["weight"], complete["weight"])
    assert snapshot_gaps(tmp_path / "late") == [
        f"{tmp_path / 'late'}: 2 snapshots of a schedule of every 100 steps are missing (steps 100, 200)"
    ]  # fmt: skip
    write_history(tmp_path / "by hand", [100, 250, 400], links=False)  # no one schedule: no verdict
    assert snapshot_gaps(tmp_path / "by hand") == []


def test_link_or_copy_links_and_copies_atomically_where_it_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "a.pt"
    source.write_bytes(b"snapshot" * 1000)
    assert link_or_copy(source, tmp_path / "linked" / "a.pt") == "link"
    assert (tmp_path / "linked" / "a.pt").stat().st_ino == source.stat().st_ino

    def cannot(*args: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cannot)
    assert link_or_copy(source, tmp_path / "copied" / "a.pt") == "copy"
    copied = tmp_path / "copied" / "a.pt"
    assert copied.read_bytes() == source.read_bytes() and copied.stat().st_ino != source.stat().st_ino
    assert os.listdir(tmp_path / "copied") == ["a.pt"]  # no temporary file left
