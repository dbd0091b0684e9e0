"""GraphRetentionCheck: the guard's check on a training batch's outputs and module, every n-th batch; its hook
also runs when called by hand without a trainer. Its runs inside Lightning are in ``tests/recipes/test_metrics.py``."""

from __future__ import annotations

import pytest
import torch

from copy_correct.lightning import GraphRetentionCheck
from copy_correct.probes import GraphRetentionError
from tests.probes.test_graph_refs import dcgan_generator

NZ, NGF = 8, 8


def test_the_callback_hook_called_without_a_trainer_uses_batch_idx_as_the_step() -> None:
    """A plain loop calling ``on_train_batch_end(None, model, outputs, batch, i)``: no AttributeError."""
    netG = dcgan_generator(NZ, NGF)
    noise = torch.randn(2, NZ, 1, 1)
    guard = GraphRetentionCheck()
    guard.on_train_batch_end(None, netG, {"loss": torch.zeros(())}, noise, 4)  # nothing held: passes
    with pytest.raises(GraphRetentionError, match=r"^step 5: 1 tensor\(s\) .*: outputs\['fake'\] \(\d"):
        guard.on_train_batch_end(None, netG, {"fake": netG(noise)}, noise, 5)
    skipping = GraphRetentionCheck(every_n_steps=2)
    skipping.on_train_batch_end(None, netG, {"fake": netG(noise)}, noise, 5)  # an odd batch: not checked
    assert skipping.find({"fake": netG(noise)}, netG) == ["outputs['fake']"]


def test_bad_every_n_steps_and_mode_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        GraphRetentionCheck(every_n_steps=0)
    with pytest.raises(ValueError, match="mode must be 'raise' or 'warn'"):
        GraphRetentionCheck(mode="ignore")
