"""``EMA.step`` is the count of ``update`` calls: an ``int`` in every use, which answers diffusers'
``ema.step(model.parameters())`` naming ``ema.update(model)`` (``copy_correct.averages.peer_calls.UpdateCount``). The
counts our states save are plain ``int``s that load anywhere; a raw ``ema.step`` saved by a user loads with
``weights_only=True`` where ``copy_correct`` is imported and is refused, naming the class, in a process without it
(the control, which shows why ``state_dict`` saves a plain ``int``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from copy_correct import EMA


def updated(calls: int) -> tuple[EMA, nn.Module]:
    model = nn.Linear(4, 2)
    ema = EMA(model)
    for _ in range(calls):
        ema.update(model)
    return ema, model


def test_the_count_is_an_int_in_every_use_and_a_call_names_update() -> None:
    ema, model = updated(3)
    step = ema.step
    assert isinstance(step, int) and step == 3 and step + 1 == 4 and type(step + 1) is int
    assert f"{step}" == str(step) == repr(int(step)) == "3" and json.dumps({"step": step}) == '{"step": 3}'
    assert range(step)[-1] == 2 and [0, 1, 2, 3][step] == 3 and torch.tensor(step).item() == 3
    with pytest.raises(TypeError, match=r"not diffusers' EMAModel\.step: average the model with ema\.update\(model\)"):
        step(model.parameters())
    assert ema.step == 3  # the call changed nothing


def _load_in_a_fresh_process(path: Path) -> subprocess.CompletedProcess[str]:
    code = f"import torch; print(torch.load({str(path)!r}, weights_only=True))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_states_count_is_a_plain_int_that_loads_anywhere_and_a_raw_one_only_beside_the_package(
    tmp_path: Path,
) -> None:
    ema, _ = updated(2)
    assert type(ema.state_dict()["step"]) is int
    torch.save({"step": ema.state_dict()["step"]}, tmp_path / "state.pt")
    loaded = _load_in_a_fresh_process(tmp_path / "state.pt")
    assert loaded.returncode == 0 and "{'step': 2}" in loaded.stdout, loaded.stderr[-500:]

    torch.save({"step": ema.step}, tmp_path / "raw.pt")  # the control: the count itself, not int(ema.step)
    refused = _load_in_a_fresh_process(tmp_path / "raw.pt")
    assert refused.returncode != 0 and "UpdateCount" in refused.stderr
    assert torch.load(tmp_path / "raw.pt", weights_only=True) == {"step": 2}  # here, copy_correct is imported
