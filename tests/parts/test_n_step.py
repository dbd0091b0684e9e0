"""N-step returns (``ReplayBuffer(..., n_steps, gamma)``): every sampled window is the one a brute-force oracle finds
in the logged episodes, for one env and for vector envs in each autoreset mode, episodes shorter than ``n_steps``,
terminations and truncations, rings that wrap many times, a capacity that is not a multiple of the envs and rings so
small that an env's newest row is overwritten. ``n_steps=1`` is the buffer as it was, bit for bit; states resume.

Controls: a buffer that steps a fixed stride through ``"next_step"`` rows (the reset steps left out shift an env's
next row) and one that reads past an env's newest transition both sample windows the oracle refuses.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import copy_correct.replay.n_step as _n_step
from copy_correct import ReplayBuffer

GAMMA = 0.9


@dataclass
class Logged:
    """What the envs gave, per env stream: each stored transition's number, reward, flags and real next obs."""

    streams: list[list[tuple[int, float, bool, bool, float]]] = field(default_factory=list)
    where: dict[int, tuple[int, int]] = field(default_factory=dict)  # number -> (env, index in its stream)

    def window(self, number: int, n_steps: int) -> tuple[float, float, bool, bool, int]:
        """The oracle: walk the env's stream from the transition, summing in float64, until ``n_steps`` are taken,
        one ended its episode, or the stream has no later transition yet."""
        env, i = self.where[number]
        stream, total, m = self.streams[env], 0.0, 0
        while True:
            _, reward, terminated, truncated, next_obs = stream[i + m]
            total += GAMMA**m * reward
            m += 1
            if m == n_steps or terminated or truncated or i + m == len(stream):
                return total, next_obs, terminated, truncated, m


def play(buffer: ReplayBuffer, mode: str | None, steps: int, seed: int = 1,
         twin: ReplayBuffer | None = None) -> tuple[list[int], list[dict[str, torch.Tensor]]]:  # fmt: skip
    """``steps`` adds of random episodes (1 to 7 transitions, terminated or truncated at random) into ``buffer``
    (and ``twin``), as a loop in ``mode`` gives them (each transition's action is its number); every 9 adds 128
    windows are sampled and held against the oracle of the stream as it is then. Returns the numbers of the wrong
    windows and the batches."""
    rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    envs = buffer.num_envs or 1
    log = Logged([[] for _ in range(envs)])
    left = rng.integers(1, 8, envs)  # transitions to the episode's end
    resetting = np.zeros(envs, dtype=bool)  # next_step: the env's row is its reset step
    wrong, batches = [], []
    for step in range(steps):
        ids = np.arange(step * envs, (step + 1) * envs)
        rewards = rng.normal(size=envs).astype(np.float32)
        left -= ~resetting
        ends = (left == 0) & ~resetting
        cut = rng.random(envs) < 0.4
        terminated, truncated = ends & ~cut, ends & cut
        real_next = (ids + 0.5).astype(np.float32)[:, None]
        given, kwargs = real_next, {}
        if mode == "same_step" and ends.any():  # next_obs: the next episode's first obs; final_obs: the real ones
            given = np.where(ends[:, None], -1.0, real_next).astype(np.float32)
            final = np.empty(envs, dtype=object)  # gymnasium's: None where the env did not end
            for i in np.flatnonzero(ends):
                final[i] = real_next[i]
            kwargs = {"final_obs": final}
        obs = ids.astype(np.float32)[:, None]
        args = (obs, ids, rewards, given, terminated, truncated) if buffer.num_envs else (
            obs[0], int(ids[0]), float(rewards[0]), given[0], bool(terminated[0]), bool(truncated[0])
        )  # fmt: skip
        for into in (buffer, twin) if twin is not None else (buffer,):
            into.add(*args, **kwargs)
        for env in np.flatnonzero(~resetting).tolist():
            stream = log.streams[env]
            log.where[int(ids[env])] = (env, len(stream))
            stream.append((int(ids[env]), float(rewards[env]), bool(terminated[env]), bool(truncated[env]),
                           float(real_next[env, 0])))  # fmt: skip
        started = resetting if mode == "next_step" else ends
        left[started] = rng.integers(1, 8, int(started.sum()))
        resetting = ends if mode == "next_step" else np.zeros(envs, dtype=bool)
        if step % 9 == 8:
            batches.append(buffer.sample(128, generator=generator))
            wrong += wrong_windows(batches[-1], log, buffer.n_steps)
    return wrong, batches


def wrong_windows(batch: dict[str, torch.Tensor], log: Logged, n_steps: int) -> list[int]:
    """The numbers of the sampled transitions whose window is not the oracle's."""
    wrong = []
    for row, number in enumerate(batch["action"].tolist()):
        total, next_obs, terminated, truncated, m = log.window(number, n_steps)
        same = (
            np.isclose(float(batch["reward"][row]), total, rtol=1e-6, atol=1e-6)
            and float(batch["next_obs"][row, 0]) == next_obs
            and bool(batch["terminated"][row]) == terminated
            and bool(batch["truncated"][row]) == truncated
            and np.isclose(float(batch["discounts"][row]), GAMMA**m, rtol=1e-6)
        )
        if not same:
            wrong.append(number)
    return wrong


CASES = {  # num_envs, autoreset mode, capacity
    "one env": (None, None, 50),
    "same_step": (3, "same_step", 60),
    "disabled": (3, "disabled", 61),  # not a multiple of the envs: a stride of 3 wraps around row 60
    "next_step": (3, "next_step", 60),
    "next_step, a ring of 2 steps": (3, "next_step", 7),  # an env's newest row is overwritten before its next
}


def built(case: str, n_steps: int, kind: type[ReplayBuffer] = ReplayBuffer) -> ReplayBuffer:
    num_envs, mode, capacity = CASES[case]
    return kind(capacity, (1,), num_envs=num_envs, autoreset_mode=mode, n_steps=n_steps, gamma=GAMMA)


@pytest.mark.parametrize("n_steps", [3, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_every_sampled_window_is_the_oracles(case: str, n_steps: int) -> None:
    buffer = built(case, n_steps)
    wrong, batches = play(buffer, CASES[case][1], 600)
    assert wrong == []
    # Drawn: every window length, windows cut by an end inside them, and the newest transitions' short ones.
    discounts = torch.cat([b["discounts"] for b in batches])
    longest = n_steps if CASES[case][2] > 20 else 2  # a ring of 7 rows holds two or three transitions an env
    assert len(set(discounts.tolist())) >= longest
    ended = torch.cat([b["terminated"] | b["truncated"] for b in batches])
    assert (ended & (discounts > GAMMA**n_steps * 1.0001)).any()


class Strided(ReplayBuffer):
    """The control: an env's next row always ``num_envs`` rows on, as if every add wrote every env's row."""

    def _window(self, rows: np.ndarray) -> _n_step.Window:
        links, self._next_row = self._next_row, None
        try:
            return super()._window(rows)
        finally:
            self._next_row = links


def past_the_newest(rows: np.ndarray, written: np.ndarray, *args: object) -> _n_step.Window:
    """The control: windows that do not stop at an env's newest transition (the rows after it are older ones)."""
    return windows(rows, np.ones_like(written), *args)


windows = _n_step.windows


def test_the_control_a_fixed_stride_through_next_step_rows_is_caught() -> None:
    wrong, _ = play(built("next_step", 3, Strided), "next_step", 600)
    assert len(wrong) > 50


def test_the_control_windows_past_the_newest_transition_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_n_step, "windows", past_the_newest)
    wrong, _ = play(built("same_step", 3), "same_step", 600)
    assert len(wrong) > 50


@pytest.mark.parametrize("case", list(CASES))
def test_n_steps_1_samples_the_buffer_as_it_was_and_gamma_adds_only_its_discounts(case: str) -> None:
    num_envs, mode, capacity = CASES[case]
    plain = ReplayBuffer(capacity, (1,), num_envs=num_envs, autoreset_mode=mode)
    one = built(case, 1)
    play(one, mode, 200, twin=plain)
    for size in (1, 64):
        batch, as_was = (b.sample(size, generator=torch.Generator().manual_seed(3)) for b in (one, plain))
        assert list(batch) == [*as_was, "discounts"]
        assert all(torch.equal(batch[name], as_was[name]) for name in as_was)
        assert torch.equal(batch["discounts"], torch.full((size,), np.float32(GAMMA)))
    assert one.nbytes == plain.nbytes


@pytest.mark.parametrize("case", ["next_step", "same_step"])
def test_a_state_resumes_the_same_windows_and_one_without_links_is_refused(case: str) -> None:
    buffer, twin = built(case, 3), built(case, 3)
    play(buffer, CASES[case][1], 300, twin=twin)
    saved = io.BytesIO()
    torch.save(buffer.state_dict(), saved)
    saved.seek(0)
    resumed = built(case, 3)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    for into in (twin, resumed):  # one more step after the load, every env going on
        into.add(np.zeros((3, 1), np.float32), np.full(3, -1), np.ones(3, np.float32), np.zeros((3, 1), np.float32),
                 np.zeros(3, bool), np.zeros(3, bool))  # fmt: skip
    batches = [b.sample(512, generator=torch.Generator().manual_seed(5)) for b in (twin, resumed)]
    assert all(torch.equal(batches[0][name], batches[1][name]) for name in batches[0])
    plain = ReplayBuffer(60, (1,), num_envs=3, autoreset_mode=CASES[case][1], gamma=GAMMA)
    play(plain, CASES[case][1], 30)
    if case == "next_step":  # the links a state of n_steps=1 does not hold
        with pytest.raises(ValueError, match=r"no n-step links .* n_steps=3 with 3 envs in next_step mode"):
            built(case, 3).load_state_dict(plain.state_dict())
    else:  # a fixed stride: nothing more to hold
        built(case, 3).load_state_dict(plain.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"n_steps": 0}, ValueError, "n_steps must be >= 1, got 0"),
        ({"n_steps": "3"}, TypeError, "n_steps"),
        ({"n_steps": True, "gamma": 0.9}, TypeError, "n_steps"),
        ({"n_steps": 3}, ValueError, "n_steps=3 needs gamma"),
        ({"n_steps": 3, "gamma": 1.5}, ValueError, r"gamma must be in \[0, 1\], got 1.5"),
        ({"n_steps": 3, "gamma": "0.9"}, TypeError, "gamma must be a number"),
        ({"n_steps": 3, "gamma": 0.9, "device": "cuda"}, ValueError, "n_steps=3 needs the buffer's storage on the CPU"),
    ],
)
def test_bad_settings_are_refused_in_one_line(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ReplayBuffer(10, (1,), **kwargs)
