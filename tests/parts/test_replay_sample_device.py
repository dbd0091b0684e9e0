"""``sample(..., device="cuda")``'s host side, on any machine: every field is gathered into the staging memory
``_host_batch.empty`` hands out (pinned, on CUDA) and handed to ``_host_batch.moved``, holding the values of the CPU
batch of the same draw. Here the staging is ordinary memory and ``moved`` records what it is given; the copy itself and
its pinning are proven on a GPU (``test_replay_sample_gpu.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import copy_correct.replay.host_batch as _host_batch
from copy_correct import FrameReplayBuffer, ReplayBuffer
from tests.parts.test_replay_sample_gpu import FIELDS, frames, stacks, vectors


class Staging:
    """Stands in for ``_host_batch``: records each field's staging and what ``moved`` is given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.staged: list[torch.Tensor] = []
        self.moved: dict[str, torch.Tensor] = {}
        self.pinned: list[bool] = []
        monkeypatch.setattr(_host_batch, "empty", self.empty)
        monkeypatch.setattr(_host_batch, "moved", self.move)

    def empty(self, shape: Any, dtype: np.dtype, pinned: bool) -> tuple[np.ndarray, torch.Tensor]:
        self.pinned.append(pinned)
        array = np.full(tuple(shape), 7, dtype=dtype)  # not zeros: a field left ungathered would show
        self.staged.append(torch.from_numpy(array))
        return array, self.staged[-1]

    def move(self, batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        assert device.type == "cuda"
        self.moved = batch
        return batch


@pytest.mark.parametrize("make", [vectors, stacks, frames], ids=["vectors", "whole stacks", "FrameReplayBuffer"])
def test_every_field_is_gathered_into_pinned_staging_and_handed_over_with_the_cpu_batchs_values(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    buffer: ReplayBuffer | FrameReplayBuffer = make()
    on_cpu = buffer.sample(64, generator=torch.Generator().manual_seed(3))
    staging = Staging(monkeypatch)
    buffer.sample(64, generator=torch.Generator().manual_seed(3), device="cuda")
    assert staging.pinned and all(staging.pinned)
    assert sorted(staging.moved) == sorted(FIELDS)
    staged = {t.untyped_storage().data_ptr() for t in staging.staged}
    for name in FIELDS:
        assert staging.moved[name].untyped_storage().data_ptr() in staged, name  # gathered into the staging
        assert torch.equal(staging.moved[name], on_cpu[name]), name
    # The control: a CPU sample asks for no pinned staging and hands nothing over.
    staging.pinned.clear()
    buffer.sample(64, device="cpu")
    assert not any(staging.pinned)
