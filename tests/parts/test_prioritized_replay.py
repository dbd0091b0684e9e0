"""Prioritized sampling in both buffers (``prioritized=True``; ``copy_correct.replay.priorities``), with OpenAI
baselines' definitions: row ``i`` drawn with probability ``p_i^alpha / sum_k p_k^alpha`` (a chi-square test over many
draws; control: uniform draws fail it), weights ``(N P(i))^-beta`` over the largest (the formula, to 1e-5), a new row
at the largest priority so far, an overwritten row reset, every refusal with nothing changed. It composes with n-step
windows (the index is the window's first transition), vector envs in every autoreset mode and frames stored once and
compressed (a row is drawable exactly when it holds a priority, after every add; every drawn transition the env's),
``SampleAhead`` (one sample stale, as synchronous calls in that order; control: the loop without the lag differs),
``sample(device=)`` and ``state_dict`` (a resumed buffer draws what the original draws, sharing nothing)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from copy_correct import FrameReplayBuffer, ReplayBuffer, SampleAhead
from copy_correct.replay import priorities
from copy_correct.replay.priorities import Priorities
from tests.parts.test_frame_replay import play, same_as_stored
from tests.parts.test_replay_copies import shared

ALPHA, ROWS = 0.6, 40
PRIORITIES = np.linspace(0.05, 3.0, ROWS)  # one per row, a 60-fold range


def numbered(kind: str, capacity: int = ROWS, **options: Any) -> ReplayBuffer | FrameReplayBuffer:
    """``capacity`` transitions of one episode, transition ``t`` numbered ``t`` in its reward (and its obs)."""
    if kind == "FrameReplayBuffer":
        buffer = FrameReplayBuffer(capacity + 8, (2, 1), prioritized=True, alpha=ALPHA, **options)
        frames = [np.full(1, max(t, 0), np.uint8) for t in range(-1, capacity + 2)]
        for t in range(capacity):
            buffer.add(np.stack(frames[t : t + 2]), 0, float(t), np.stack(frames[t + 1 : t + 3]), False, False)
        return buffer
    buffer = ReplayBuffer(capacity, (1,), prioritized=True, alpha=ALPHA, **options)
    for t in range(capacity):
        buffer.add(np.full(1, t, np.float32), 0, float(t), np.full(1, t + 1, np.float32), False, False)
    return buffer


def given_priorities(buffer: ReplayBuffer | FrameReplayBuffer) -> np.ndarray:
    """Each transition's row (found by a draw of every row) given ``PRIORITIES[t]``; the rows, by number."""
    rows = np.empty(ROWS, np.int64)
    batch = buffer.sample(4000, torch.Generator().manual_seed(1))
    rows[batch["reward"].long().numpy()] = batch["indices"].numpy()
    buffer.update_priorities(torch.from_numpy(rows), torch.from_numpy(PRIORITIES))
    return rows


BOTH = pytest.mark.parametrize("kind", ["ReplayBuffer", "FrameReplayBuffer"])


PATHS = pytest.mark.parametrize("path", ["rejection", "tree"])


def forced(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Every draw by rejection (any share kept is enough) or by the tree (none is)."""
    monkeypatch.setattr(priorities, "MIN_KEPT", 0.0 if path == "rejection" else np.inf)


@BOTH
@PATHS
def test_rows_are_drawn_in_proportion_to_their_priority_to_the_alpha(
    kind: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    forced(monkeypatch, path)
    buffer = numbered(kind)
    given_priorities(buffer)
    drawn = buffer.sample(200_000, torch.Generator().manual_seed(0))["reward"].long().numpy()
    expected = PRIORITIES**ALPHA / (PRIORITIES**ALPHA).sum() * len(drawn)
    assert chisquare(np.bincount(drawn, minlength=ROWS), expected).pvalue > 1e-3
    uniform = torch.randint(ROWS, (len(drawn),), generator=torch.Generator().manual_seed(0)).numpy()
    assert chisquare(np.bincount(uniform, minlength=ROWS), expected).pvalue < 1e-12  # the control


@BOTH
def test_weights_are_n_p_to_the_minus_beta_over_the_largest(kind: str) -> None:
    buffer = numbered(kind)
    given_priorities(buffer)
    for beta in (0.0, 0.4, 1.0):
        batch = buffer.sample(256, torch.Generator().manual_seed(2), beta=beta)
        probability = PRIORITIES**ALPHA / (PRIORITIES**ALPHA).sum()
        weights = (ROWS * probability) ** -beta / (ROWS * probability.min()) ** -beta
        assert batch["weights"].dtype == torch.float32 and batch["indices"].dtype == torch.int64
        np.testing.assert_allclose(batch["weights"].numpy(), weights[batch["reward"].long().numpy()], rtol=1e-5)


def test_a_new_row_gets_the_largest_priority_so_far_and_an_overwritten_one_forgets_its_own() -> None:
    buffer = numbered("ReplayBuffer", capacity=ROWS)
    assert np.all(buffer._priorities._leaves[:ROWS] == 1.0)  # 1.0 before any priority is given
    buffer.update_priorities([0, 1], [0.01, 5.0])
    buffer.add(np.zeros(1, np.float32), 0, 0.0, np.zeros(1, np.float32), False, False)  # overwrites row 0
    assert buffer._priorities._leaves[0] == 5.0**ALPHA  # not 0.01's
    buffer.update_priorities([2], [9.0])
    buffer.add(np.zeros(1, np.float32), 0, 0.0, np.zeros(1, np.float32), False, False)
    assert buffer._priorities._leaves[1] == 9.0**ALPHA


def test_a_row_given_twice_keeps_its_last_priority_whatever_the_order() -> None:
    buffer = numbered("ReplayBuffer")
    buffer.update_priorities([3, 7, 3], [1.0, 2.0, 5.0])
    buffer.update_priorities([9, 9], [5.0, 1.0])
    leaves = buffer._priorities._leaves
    assert (leaves[3], leaves[7], leaves[9]) == (5.0**ALPHA, 2.0**ALPHA, 1.0**ALPHA)
    assert buffer._priorities.max_priority == 5.0  # the largest given, superseded or not, as baselines keeps it


REFUSALS = {
    "a zero priority": (([3], [0.0]), "priorities must be positive and finite"),
    "a negative one": (([3], [-1.0]), "priorities must be positive and finite"),
    "NaN": (([3], [float("nan")]), "priorities must be positive and finite"),
    "inf": (([3], [float("inf")]), "priorities must be positive and finite"),
    "a row never written": (([ROWS + 3], [1.0]), "is not a row this ReplayBuffer has written"),
    "a negative row": (([-1], [1.0]), "is not a row this ReplayBuffer has written"),
    "lengths that differ": (([3, 4], [1.0]), "must be 1-D and of one length"),
    "float indices": (([3.0], [1.0]), "indices must be integers"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_bad_update_is_refused_in_one_line_and_changes_nothing(case: str) -> None:
    buffer = ReplayBuffer(ROWS + 8, (1,), prioritized=True)
    for t in range(ROWS):
        buffer.add(np.full(1, t, np.float32), 0, float(t), np.full(1, t, np.float32), False, False)
    buffer.update_priorities([3, 5], [2.0, 0.5])
    before = buffer.state_dict()["priorities"].clone()
    arguments, message = REFUSALS[case]
    with pytest.raises(ValueError, match=rf"^[^\n]*{message}[^\n]*$"):
        buffer.update_priorities(*arguments)
    assert torch.equal(buffer.state_dict()["priorities"], before) and buffer._priorities.max_priority == 2.0


def test_a_uniform_buffer_refuses_beta_and_priorities_and_bad_settings_are_refused() -> None:
    uniform = ReplayBuffer(4, (1,))
    uniform.add(np.zeros(1, np.float32), 0, 0.0, np.zeros(1, np.float32), False, False)
    with pytest.raises(ValueError, match=r"^beta weighs a prioritized buffer's draws"):
        uniform.sample(2, beta=0.4)
    with pytest.raises(ValueError, match=r"^update_priorities needs a prioritized buffer"):
        uniform.update_priorities([0], [1.0])
    assert set(uniform.sample(2)) == {"obs", "action", "reward", "next_obs", "terminated", "truncated"}
    with pytest.raises(ValueError, match=r"^alpha must be a finite number >= 0"):
        ReplayBuffer(4, (1,), prioritized=True, alpha=-1)
    with pytest.raises(TypeError, match=r"^prioritized must be True or False"):
        FrameReplayBuffer(4, (2, 1), prioritized=1)
    with pytest.raises(ValueError, match=r"^beta must be a finite number >= 0"):
        numbered("ReplayBuffer").sample(2, beta=float("nan"))


@BOTH
def test_an_n_step_index_is_its_windows_first_transition(kind: str) -> None:
    """Transition ``t`` is at row ``t`` in both buffers here; its window's reward sums those from ``t`` on."""
    batch = numbered(kind, n_steps=3, gamma=0.5).sample(64, torch.Generator().manual_seed(3))
    first = (batch["obs"][:, -1, 0] if kind == "FrameReplayBuffer" else batch["obs"][:, 0]).long()
    assert batch["indices"].tolist() == first.tolist()
    whole = first < ROWS - 2  # windows the newest transitions have not filled yet are shorter
    sums = first + 0.5 * (first + 1) + 0.25 * (first + 2)
    assert torch.equal(batch["reward"][whole], sums[whole].float())


class Tracked(FrameReplayBuffer):
    """After every add: a slot holds a priority exactly when a transition can be drawn from it, and they number len."""

    def add(self, *args: Any, **kwargs: Any) -> None:
        super().add(*args, **kwargs)
        tree = self._priorities
        drawable = self._drawable(np.arange(tree.rows))
        assert np.array_equal(drawable, tree.drawable(np.arange(tree.rows))) and drawable.sum() == len(self)


@pytest.mark.parametrize("mode", ["next_step", "same_step", "disabled"])
@pytest.mark.parametrize(("capacity", "envs"), [(16, 2), (30, 3), (200, 3), (50, 1)])
def test_every_frame_slot_is_drawable_exactly_when_it_has_a_priority_and_every_draw_is_the_envs(
    mode: str, capacity: int, envs: int
) -> None:
    _, stacks, batches = play(mode, 150, capacity, envs, kind=functools.partial(Tracked, prioritized=True))
    assert all(same_as_stored(batch, stacks) == [] and "weights" in batch for batch in batches)


def test_the_control_a_slot_left_with_its_priority_is_drawn_and_is_not_the_envs() -> None:
    class Untracked(FrameReplayBuffer):  # new rows get a priority, none is ever taken away
        def _with_priorities(self, add: Any, priorities: Any) -> Any:
            def add_kept(buffer: Any, *fields: Any) -> None:
                add(buffer, *fields)
                priorities.set_new(np.arange(priorities.rows)[buffer._written_slots()])

            return add_kept

        def _written_slots(self) -> np.ndarray:
            return (np.arange(self._length)[None] < self._written[:, None]).reshape(-1)

    _, stacks, batches = play("next_step", 150, 30, 3, kind=functools.partial(Untracked, prioritized=True))
    assert any(same_as_stored(batch, stacks) for batch in batches)


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_compressed_frames_draw_the_same_prioritized_batches(codec: str) -> None:
    pytest.importorskip({"zstd": "zstandard", "lz4": "lz4"}[codec], reason="the compress extra")
    _, _, one = play("same_step", 120, 60, 2, kind=functools.partial(FrameReplayBuffer, prioritized=True))
    _, _, two = play("same_step", 120, 60, 2, kind=functools.partial(FrameReplayBuffer, prioritized=True,
                                                                          compress=codec))  # fmt: skip
    assert all(torch.equal(a[k], b[k]) for a, b in zip(one, two, strict=True) for k in a)


def loop(buffer: ReplayBuffer, draw: Any, update: Any, steps: int) -> list[dict[str, torch.Tensor]]:
    """A loop's cadence: add, draw, set the drawn rows' priorities from the batch (its rewards + 1)."""
    batches = []
    for t in range(ROWS, ROWS + steps):
        buffer.add(np.full(1, t, np.float32), 0, float(t % 7), np.full(1, t, np.float32), False, False)
        batches.append(draw())
        update(batches[-1]["indices"], batches[-1]["reward"] + 1.0)
    return batches


def test_sample_ahead_draws_each_batch_before_the_last_batchs_priorities_as_synchronous_calls_in_that_order() -> None:
    ahead_buffer = numbered("ReplayBuffer", capacity=64)
    with SampleAhead(ahead_buffer, 16, generator=torch.Generator().manual_seed(4)) as ahead:
        by_ahead = loop(ahead_buffer, lambda: ahead.sample(beta=0.5), ahead.update_priorities, 30)
    sync = numbered("ReplayBuffer", capacity=64)
    generator, pending = torch.Generator().manual_seed(4), []

    def drawn_one_call_ahead() -> dict[str, torch.Tensor]:  # batch k + 1 drawn at call k, before update k
        if not pending:
            pending.append(sync.sample(16, generator, beta=0.5))
        pending.append(sync.sample(16, generator, beta=0.5))
        return pending.pop(0)

    by_sync = loop(sync, drawn_one_call_ahead, sync.update_priorities, 30)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(by_ahead, by_sync, strict=True) for k in a)
    plain = numbered("ReplayBuffer", capacity=64)  # the control: each batch drawn after the last one's priorities
    generator = torch.Generator().manual_seed(4)
    by_plain = loop(plain, lambda: plain.sample(16, generator, beta=0.5), plain.update_priorities, 30)
    assert not all(torch.equal(a["indices"], b["indices"]) for a, b in zip(by_ahead, by_plain, strict=True))


def test_a_resumed_buffer_draws_what_the_original_draws_and_shares_nothing_with_it() -> None:
    for kind in ("ReplayBuffer", "FrameReplayBuffer"):
        original = numbered(kind)
        given_priorities(original)
        state = original.state_dict()
        resumed = numbered(kind)
        resumed.load_state_dict(state)
        assert not shared(resumed, original)
        saved, loaded = state["priorities"].numpy(), resumed._priorities._leaves
        assert np.shares_memory(saved, original._priorities._leaves)  # the control: the state shares the original's
        assert not np.shares_memory(saved, loaded)
        a, b = (buffer.sample(64, torch.Generator().manual_seed(6), beta=0.7) for buffer in (original, resumed))
        assert all(torch.equal(a[k], b[k]) for k in a)
        with pytest.raises(ValueError, match=r"^saved buffer is prioritized, this one is not"):
            _uniform(kind).load_state_dict(state)


def _uniform(kind: str) -> ReplayBuffer | FrameReplayBuffer:
    return FrameReplayBuffer(ROWS + 8, (2, 1)) if kind == "FrameReplayBuffer" else ReplayBuffer(ROWS, (1,))


def test_a_batch_goes_to_the_device_asked_for(device: torch.device) -> None:
    batch = numbered("ReplayBuffer").sample(8, torch.Generator().manual_seed(0), device=device)
    assert batch["indices"].device.type == batch["weights"].device.type == device.type


def test_a_mass_rounded_past_the_last_priority_is_drawn_again_never_landing_on_an_empty_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forced(monkeypatch, "tree")
    tree = Priorities(100, ALPHA)
    tree.set_new(np.arange(10))  # rows 10 to 99: no transition
    tree._flush()
    assert tree._leaves[tree._descend(np.array([10.0]))[0]] == 0  # the control: the whole mass lands past them
    masses = iter([np.array([10.0, 2.5]), np.array([5.0])])
    monkeypatch.setattr(tree, "_masses", lambda count, generator: next(masses))
    rows = tree.draw(2, None)
    assert rows.tolist() == [5, 2]  # the first drawn again at half the mass; the second kept


def test_a_draw_is_by_rejection_while_enough_candidates_are_kept_and_by_the_tree_past_that() -> None:
    """Rejection while a uniform candidate is kept with probability ``total / (rows * max p)`` of at least
    ``MIN_KEPT``; the control: one priority far above the rest keeps too few, and the tree draws."""
    tree = Priorities(4096, ALPHA)
    tree.set_new(np.arange(4000))
    tree.update(np.arange(4000), np.linspace(0.5, 2.0, 4000))
    tree._flush()
    assert tree._high == 4000 and tree._run_sums[-1] / (tree._high * tree._max) >= priorities.MIN_KEPT
    tree._masses = None  # the tree's masses: not used by rejection
    assert tree.draw(64, torch.Generator().manual_seed(0)).shape == (64,)
    tree.update(np.array([7]), np.array([1e6]))  # the control
    tree._flush()
    assert tree._run_sums[-1] / (tree._high * tree._max) < priorities.MIN_KEPT
    with pytest.raises(TypeError):  # the tree asks for masses
        tree.draw(64, torch.Generator().manual_seed(0))


def test_the_rows_below_which_every_priority_lies_are_a_function_of_the_leaves() -> None:
    """``_high`` (where rejection's candidates end) follows the last group holding a priority, down as well as up,
    and a tree rebuilt from saved leaves has the same: a resumed buffer keeps the candidates, so the draws."""
    tree = Priorities(512, ALPHA)
    tree.set_new(np.arange(300))
    tree._flush()
    assert tree._high == 320  # the 10th group of 32 holds rows 288 to 299
    tree.clear(np.arange(288, 300))
    tree._flush()
    assert tree._high == 288
    rebuilt = Priorities(512, ALPHA)
    rebuilt.load(tree.state())
    assert rebuilt._high == tree._high and rebuilt._max == tree._max
    seeded = functools.partial(torch.Generator().manual_seed, 3)
    assert np.array_equal(rebuilt.draw(100, seeded()), tree.draw(100, seeded()))


def test_a_buffer_filled_without_a_read_draws_what_one_noting_every_write_draws(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``MAX_NOTED`` writes between two reads the tree recomputes every group instead of noting each write."""

    def filled_and_drawn() -> dict[str, torch.Tensor]:
        buffer = ReplayBuffer(5000, (1,), prioritized=True, alpha=ALPHA)
        for t in range(3000):
            buffer.add(np.full(1, t, np.float32), 0, float(t), np.full(1, t, np.float32), False, False)
            if t == 1500:
                buffer.update_priorities(np.arange(0, 1500, 7), np.linspace(0.1, 9.0, len(range(0, 1500, 7))))
        return buffer.sample(512, torch.Generator().manual_seed(8), beta=0.5)

    collapsed = filled_and_drawn()
    monkeypatch.setattr(priorities, "MAX_NOTED", 10**9)
    noted = filled_and_drawn()
    assert all(torch.equal(collapsed[k], noted[k]) for k in collapsed)


class TrackedRows(ReplayBuffer):
    """After every add: exactly the rows that hold transitions (``0 .. size - 1``) have a priority."""

    def add(self, *args: Any, **kwargs: Any) -> None:
        super().add(*args, **kwargs)
        tree = self._priorities
        assert np.array_equal(tree.drawable(np.arange(tree.rows)), np.arange(tree.rows) < self.size)


def vector_steps(buffer: ReplayBuffer, steps: int) -> None:
    """``steps`` steps of 3 envs whose episodes end at random: in ``"next_step"`` mode an ended env's next row is its
    reset step, which the buffer leaves out."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        obs = rng.normal(size=(3, 1)).astype(np.float32)
        ends = rng.random(3) < 0.3
        buffer.add(obs, rng.integers(0, 2, 3), np.ones(3, np.float32), obs, ends, np.zeros(3, np.bool_))


@pytest.mark.parametrize("mode", ["next_step", "same_step", "disabled"])
def test_a_vector_env_buffer_gives_a_priority_to_every_row_written_and_to_no_reset_step(mode: str) -> None:
    buffer = TrackedRows(40, (1,), num_envs=3, autoreset_mode=mode, prioritized=True)
    vector_steps(buffer, 60)  # the ring wraps
    assert buffer.size == 40


def test_the_control_rows_counted_as_if_every_env_wrote_one_give_a_priority_to_an_empty_row() -> None:
    class EveryEnv(ReplayBuffer):  # forgets that next_step leaves reset steps out
        def _with_priorities(self, add: Any, priorities: Any) -> Any:
            def add_rows(buffer: Any, *fields: Any) -> None:
                pos = buffer.pos
                add(buffer, *fields)
                priorities.set_new((pos + np.arange(3)) % buffer.capacity)

            return add_rows

    buffer = EveryEnv(40, (1,), num_envs=3, autoreset_mode="next_step", prioritized=True)
    vector_steps(buffer, 8)  # not yet full: a row past size is given a priority
    assert buffer.size < 24 and buffer._priorities.drawable(np.arange(40)).sum() > buffer.size
