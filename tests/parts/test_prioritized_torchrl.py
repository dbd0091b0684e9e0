"""Our prioritized ``ReplayBuffer`` against TorchRL's ``PrioritizedReplayBuffer`` on the same stream and the same
priorities, where the two define the same thing: the probability of each row (both against ``p**alpha`` by a
chi-square test over many draws) and the importance weight of a row, ``(p_i / min p)**-beta`` in both (TorchRL keeps
float32 sums, so to 1e-5). TorchRL 0.14.1's segment trees are in its compiled extension, which loads with the torch it
was built for (2.14.1; not 2.13.0: an undefined symbol), so this runs in an environment with that torch and TorchRL
(``pip install torch==2.14.1 torchrl==0.14.1``) and is skipped, saying why, elsewhere. The control: our draws fail the
chi-square test against uniform probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from copy_correct import ReplayBuffer

ROWS, ALPHA, BETA, DRAWS = 64, 0.6, 0.4, 100_000


def torchrl_buffer() -> object:
    data = pytest.importorskip("torchrl.data", reason="TorchRL is not installed")
    dicts = pytest.importorskip("tensordict")
    try:
        buffer = data.PrioritizedReplayBuffer(alpha=ALPHA, beta=BETA, storage=data.LazyTensorStorage(ROWS),
                                              batch_size=1000)  # fmt: skip
    except RuntimeError as error:  # its segment tree compiled for another torch
        pytest.skip(f"TorchRL's segment tree does not load with torch {torch.__version__}: {str(error)[:80]}")
    buffer.extend(dicts.TensorDict({"reward": torch.arange(ROWS, dtype=torch.float32)}, batch_size=[ROWS]))
    return buffer


def test_the_same_priorities_draw_rows_alike_and_weigh_them_alike() -> None:
    theirs = torchrl_buffer()
    priorities = np.linspace(0.1, 4.0, ROWS)
    ours = ReplayBuffer(ROWS, (1,), prioritized=True, alpha=ALPHA)
    for t in range(ROWS):
        ours.add(np.full(1, t, np.float32), 0, float(t), np.full(1, t, np.float32), False, False)
    rows = torch.arange(ROWS)
    ours.update_priorities(rows, torch.from_numpy(priorities))
    theirs.update_priority(rows, torch.from_numpy(priorities).float())
    expected = priorities**ALPHA / (priorities**ALPHA).sum() * DRAWS

    batch = ours.sample(DRAWS, torch.Generator().manual_seed(0), beta=BETA)
    drawn = batch["indices"].numpy()
    assert chisquare(np.bincount(drawn, minlength=ROWS), expected).pvalue > 1e-3
    assert chisquare(np.full(ROWS, DRAWS / ROWS), expected).pvalue < 1e-12  # the control: uniform is rejected
    their_rows, their_weights = [], []
    for _ in range(DRAWS // 1000):
        _, info = theirs.sample(return_info=True)
        their_rows.append(info["index"].numpy())
        their_weights.append(np.asarray(info["priority_weight"]))
    their_drawn = np.concatenate(their_rows)
    assert chisquare(np.bincount(their_drawn, minlength=ROWS), expected).pvalue > 1e-3

    ours_by_row = dict(zip(drawn.tolist(), batch["weights"].tolist(), strict=True))
    theirs_by_row = dict(zip(their_drawn.tolist(), np.concatenate(their_weights).tolist(), strict=True))
    common = sorted(set(ours_by_row) & set(theirs_by_row))
    assert len(common) == ROWS
    np.testing.assert_allclose([ours_by_row[r] for r in common], [theirs_by_row[r] for r in common], rtol=1e-5)
