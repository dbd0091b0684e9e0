"""PowerEMA and post-hoc EMA (EDM2): the arithmetic (sigma_rel <-> gamma, impulse responses, inner products,
coefficients), the reconstruction on a random walk (against a profile tracked directly, and against ema-pytorch 0.8.3's
PostHocEMA), the copy contract (no allocation, no host read, float32 profiles for bf16), update_every's exactness,
resume, atomic snapshots and clear errors. Each test has a control that shows the fault it guards against."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from copy_correct import PowerEMA, synthesis_coefficients, synthesize
from copy_correct.averages.posthoc import SNAPSHOT_PATTERNS, load_snapshot, snapshot_paths, target_step
from copy_correct.averages.power_function import (
    gamma_to_sigma_rel,
    impulse_response,
    power_function_correlation,
    sigma_rel_to_gamma,
    solve_coefficients,
)
from copy_correct.probes import CopyAudit, MemoryProbe, shares_storage
from tests.conftest import DEVICES

SIGMAS = (0.05, 0.10)


def net(device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    return model.to(device=device, dtype=dtype)


def walk(model: nn.Module, step: int, scale: float = 0.01) -> None:
    """One step of a random walk of the parameters, the same for a given ``step`` on every device and in every run."""
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.device, p.dtype), alpha=scale)


def gram(meta: list[tuple[int, float]]) -> np.ndarray:
    steps = np.array([t for t, _ in meta], dtype=np.float64)
    gammas = np.array([sigma_rel_to_gamma(s) for _, s in meta])
    return power_function_correlation(steps[:, None], gammas[:, None], steps[None, :], gammas[None, :])


def unnormalised(meta: list[tuple[int, float]], step: int, sigma_rel: float) -> np.ndarray:
    """The control: the least-squares solution as ema-pytorch 0.8.3 and a literal reading of Algorithm 3 leave it."""
    steps = np.array([t for t, _ in meta], dtype=np.float64)
    gammas = np.array([sigma_rel_to_gamma(s) for _, s in meta])
    target = power_function_correlation(steps, gammas, float(step), sigma_rel_to_gamma(sigma_rel))
    return np.linalg.solve(gram(meta), target)


def max_error(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((state[k].double() - v.cpu().double()).abs().max().item() for k, v in expected.items())


# -- the arithmetic -------------------------------------------------------------------------------------------


def test_sigma_rel_and_gamma_are_edm2s_conversions_both_ways() -> None:
    for sigma_rel in (0.01, 0.05, 0.08, 0.10, 0.20, 0.28):
        t = sigma_rel**-2
        edm2 = np.roots([1, 7, 16 - t, 12 - t]).real.max()  # NVlabs/edm2 training/phema.py: std_to_exp
        assert sigma_rel_to_gamma(sigma_rel) == pytest.approx(edm2, rel=1e-12)
        assert gamma_to_sigma_rel(sigma_rel_to_gamma(sigma_rel)) == pytest.approx(sigma_rel, rel=1e-14)
    assert sigma_rel_to_gamma(0.05) == pytest.approx(16.97, abs=5e-3)  # the paper's values
    assert sigma_rel_to_gamma(0.10) == pytest.approx(6.94, abs=5e-3)
    for bad in (0.0, -0.1, 0.29, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="sigma_rel must be a number in"):
            sigma_rel_to_gamma(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gamma must be"):
        gamma_to_sigma_rel(0.0)


class StepCountBeta(PowerEMA):
    """The control: ema-pytorch 0.8.3's KarrasEMA beta, ``(1 - 1/t) ** (gamma + 1)`` from the count of ``update()``
    calls, applied only on every ``update_every``-th call."""

    def betas(self, step: int, previous: int) -> list[float]:
        return [(1 - 1 / step) ** (gamma + 1) if previous else 0.0 for gamma in self.gammas]


def impulse_run(ema_type: type[PowerEMA], steps: int, sigma_rel: float, update_every: int) -> np.ndarray:
    """Each step's live weights a one-hot vector: the profile after ``steps`` holds each step's weight."""
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(steps, dtype=torch.float64))
    ema = ema_type(model, (sigma_rel,), update_every=update_every)
    for s in range(steps):
        with torch.no_grad():
            model.w.zero_()
            model.w[s] = 1.0
        ema.update()
    return ema.profiles[0]["w"].numpy().copy()


def relative_std(weights: np.ndarray) -> float:
    steps = np.arange(1, len(weights) + 1)
    mean = (weights * steps).sum()
    return float(np.sqrt((weights * (steps - mean) ** 2).sum()) / len(weights))


@pytest.mark.parametrize("update_every", [1, 5])
@pytest.mark.parametrize("sigma_rel", SIGMAS)
def test_a_profiles_impulse_response_is_its_closed_form(sigma_rel: float, update_every: int) -> None:
    steps = 400
    response = impulse_run(PowerEMA, steps, sigma_rel, update_every)
    np.testing.assert_allclose(response, impulse_response(steps, sigma_rel, update_every), rtol=1e-10, atol=1e-16)
    assert response.sum() == pytest.approx(1.0, abs=1e-12)
    assert relative_std(response) == pytest.approx(sigma_rel, rel=0.02)  # sigma_rel is what it is named after

    control = impulse_run(StepCountBeta, steps, sigma_rel, update_every)  # ema-pytorch's beta
    if update_every == 1:
        np.testing.assert_allclose(control, response, rtol=1e-10, atol=1e-16)  # the same per-step EMA...
    else:
        assert relative_std(control) > 2 * sigma_rel  # ...but every 5 steps, an EMA more than twice as long


def test_the_closed_form_inner_product_is_that_of_the_impulse_responses() -> None:
    """The solver's Gram matrix is of the continuous densities; the tracked profiles are their integrals over each
    step, so over a long run the sums of products of impulse responses converge to it."""
    steps = 20_000
    cases = [(steps, 0.05, steps, 0.10), (steps // 2, 0.05, steps, 0.10), (steps, 0.08, steps // 4, 0.05)]
    for t_a, s_a, t_b, s_b in cases:
        a, b = impulse_response(t_a, s_a), impulse_response(t_b, s_b)
        n = min(t_a, t_b)
        discrete = float((a[:n] * b[:n]).sum())
        closed = power_function_correlation(t_a, sigma_rel_to_gamma(s_a), t_b, sigma_rel_to_gamma(s_b))
        assert discrete == pytest.approx(float(closed), rel=2e-3)
        swapped = power_function_correlation(t_b, sigma_rel_to_gamma(s_a), t_a, sigma_rel_to_gamma(s_b))
        if t_a != t_b:  # the control: the steps given to the wrong profiles
            assert discrete != pytest.approx(float(swapped), rel=0.1)


# -- the coefficients ------------------------------------------------------------------------------------------


def test_a_stored_profile_at_its_snapshot_step_is_given_coefficient_one(tmp_path: Path) -> None:
    meta = [(t, s) for t in range(1000, 128_001, 1000) for s in SIGMAS]  # 256 profiles; Gram condition ~1e8
    assert np.linalg.cond(gram(meta)) > 1e7
    worst, worst_float32 = 0.0, 0.0
    a32 = torch.tensor(gram(meta), dtype=torch.float32)  # the control: the solve in float32, as torch would run it
    for i, (t, s) in enumerate(meta[::7]):
        unit = np.zeros(len(meta))
        unit[7 * i] = 1.0
        worst = max(worst, np.abs(solve_coefficients(meta, t, s) - unit).max())
        x32 = torch.linalg.solve(a32, a32[:, 7 * i]).double().numpy()
        worst_float32 = max(worst_float32, np.abs(x32 / x32.sum() - unit).max())
    assert worst < 1e-9
    assert worst_float32 > 1e-3  # measured 0.019

    model = net()  # and through the files: the synthesized state is that snapshot's profile
    ema = PowerEMA(model, SIGMAS, snapshot_every=50, snapshot_dir=tmp_path)
    for step in range(1, 201):
        walk(model, step)
        ema.update()
    stored = load_snapshot(tmp_path / "power-ema-000000100.pt")["profiles"][1]
    assert max_error(synthesize(tmp_path, 0.10, step=100), stored) < 1e-7


def test_coefficients_sum_to_one_so_an_unchanged_weight_comes_back_unchanged(tmp_path: Path) -> None:
    meta = [(t, s) for t in range(125, 1001, 125) for s in SIGMAS]  # 8 snapshots per profile
    for step, sigma_rel in [(1000, 0.08), (1000, 0.15), (700, 0.03), (1000, 0.10)]:
        assert solve_coefficients(meta, step, sigma_rel).sum() == pytest.approx(1.0, abs=1e-12)
    control = unnormalised(meta, 1000, 0.15).sum()
    assert abs(control - 1.0) > 4e-3  # 0.9948, ema-pytorch's coefficients: every synthesized weight scaled by this

    model = net()  # weights that never change: every profile holds them, and so must any reconstruction
    ema = PowerEMA(model, SIGMAS, snapshot_every=125, snapshot_dir=tmp_path)
    for _ in range(1000):
        ema.update()
    synthesized = synthesize(tmp_path, 0.15)
    assert max_error(synthesized, model.state_dict()) < 1e-6
    floating = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    shrunk = {k: v * control for k, v in floating.items()}  # the control
    assert max_error(shrunk, floating) > 1e-4


def implied_response(meta: list[tuple[int, float]], coefficients: np.ndarray, steps: int) -> np.ndarray:
    """The weight each step's live weights get in a combination of stored profiles."""
    total = np.zeros(steps)
    for (t, sigma_rel), c in zip(meta, coefficients, strict=True):
        total[:t] += c * impulse_response(t, sigma_rel)
    return total


def zeroed(state: Mapping[str, Any]) -> dict[str, Any]:
    """A snapshot state of the same steps and widths whose profiles hold zeros."""
    return {**state, "profiles": [{k: torch.zeros_like(v) for k, v in p.items()} for p in state["profiles"]]}


def test_snapshots_after_the_target_step_get_coefficient_zero(tmp_path: Path) -> None:
    """EDM2 reconstructs at a snapshot's step, where the exact least squares gives later snapshots 0 anyway; between
    two snapshots (step 210 here) a later one holds weights of steps after the target, which must not leak in."""
    model = net(dtype=torch.float64)
    ema = PowerEMA(model, SIGMAS, snapshot_every=20, snapshot_dir=tmp_path)
    direct = PowerEMA(model, (0.08,))
    for step in range(1, 401):
        walk(model, step)
        ema.update()
        direct.update()
        if step == 200:
            expected = {k: v.clone() for k, v in direct.profiles[0].items() if v.is_floating_point()}
    meta = [(t, s) for t in range(20, 401, 20) for s in SIGMAS]
    later = [i for i, (t, _) in enumerate(meta) if t > 210]
    coefficients = solve_coefficients(meta, 210, 0.08)
    assert not coefficients[later].any()
    assert not implied_response(meta, coefficients, 400)[210:].any()  # nothing of the steps after 210
    synthesized = synthesize(tmp_path, 0.08, step=210)
    later_zeroed = [zeroed(s) if s["step"] > 210 else s for s in map(load_snapshot, snapshot_paths(tmp_path))]
    earlier = synthesize(later_zeroed, 0.08, step=210)  # the later snapshots' tensors are not read
    assert all(torch.equal(synthesized[k], earlier[k]) for k in earlier)
    assert max_error(synthesize(tmp_path, 0.08, step=200), expected) < 2e-3 * max_error(ema.profiles[1], expected)

    everything = unnormalised(meta, 210, 0.08)  # the control: later snapshots in the least squares, as ema-pytorch
    assert np.abs(everything[later]).max() > 1e-2
    assert np.abs(implied_response(meta, everything, 400)[210:]).sum() > 1e-2  # weights of steps after 210


def test_a_step_past_the_last_snapshot_or_before_the_first_is_refused_naming_both_steps(tmp_path: Path) -> None:
    """A post-hoc EMA at a step past the last snapshot would hold none of the steps after it (the run may never have
    reached the step); before the first, there is nothing to combine. Between two snapshots is the best fit from those
    before it (``test_snapshots_after_the_target_step_get_coefficient_zero``)."""
    model = net()
    ema = PowerEMA(model, SIGMAS, snapshot_every=50, snapshot_dir=tmp_path)
    for step in range(1, 201):
        walk(model, step)
        ema.update()
    states = [load_snapshot(p) for p in snapshot_paths(tmp_path)]  # steps 50, 100, 150, 200
    past = "step 100000 is past the last snapshot, of step 200: no snapshot holds the steps after it"
    past += " (give a step up to 200)"
    before = "step 10 is before the first snapshot, of step 50: no snapshot holds the steps up to it"
    before += " (give a step from 50 to 200)"
    for call in (lambda s: synthesize(tmp_path, 0.08, step=s), lambda s: synthesis_coefficients(states, 0.08, s)):
        for step, message in ((100_000, past), (10, before)):
            with pytest.raises(ValueError) as raised:
                call(step)
            assert str(raised.value) == message
    assert target_step([50, 100, 150, 200]) == 200 and target_step([50, 200], 120) == 120  # the range, both ends in
    assert target_step([50, 200], 50) == 50 and target_step([50, 200], 200) == 200

    # The control: the maths alone solves for step 100000 from profiles of steps up to 200, so the old synthesize
    # returned an average labelled 100000 that holds only the first 200 steps, where that profile holds almost none.
    meta = [(t, s) for t in (50, 100, 150, 200) for s in SIGMAS]
    coefficients = solve_coefficients(meta, 100_000, 0.08)
    assert implied_response(meta, coefficients, 200).sum() == pytest.approx(1.0)  # all of it on steps 1..200
    assert impulse_response(100_000, 0.08)[:200].sum() < 1e-3  # the profile at step 100000: almost none there


def test_no_usable_snapshot_and_bad_sigma_rel_are_clear_errors(tmp_path: Path) -> None:
    meta = [(100, 0.05), (100, 0.10), (200, 0.05)]
    with pytest.raises(ValueError, match=r"no snapshot at or before step 50 to reconstruct from \(earliest: 100\)"):
        solve_coefficients(meta, 50, 0.08)
    with pytest.raises(ValueError, match="sigma_rel must be a number in"):
        solve_coefficients(meta, 200, 0.5)
    with pytest.raises(ValueError, match="target_step must be an integer >= 1"):
        solve_coefficients(meta, 0, 0.08)
    repeated = solve_coefficients([*meta, (100, 0.05)], 200, 0.08)  # a repeat adds nothing and is given 0
    assert repeated[-1] == 0.0 and np.allclose(repeated[:-1], solve_coefficients(meta, 200, 0.08), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="no PowerEMA snapshots in"):
        synthesize(tmp_path, 0.08)
    with pytest.raises(ValueError, match="snapshots is empty: no snapshot to reconstruct from"):
        synthesize([], 0.08)
    torch.save({"weight": torch.zeros(2)}, tmp_path / "power-ema-000000001.pt")
    with pytest.raises(ValueError, match="is not a PowerEMA snapshot"):
        synthesize(tmp_path, 0.08)
    with pytest.raises(ValueError, match="snapshot_every must be a positive multiple of update_every=4"):
        PowerEMA(net(), update_every=4, snapshot_every=10, snapshot_dir=tmp_path)
    with pytest.raises(RuntimeError, match="before the first update"):
        PowerEMA(net()).snapshot()


def test_synthesize_takes_a_run_directory_or_its_folder_and_names_path_and_patterns_when_none(tmp_path: Path) -> None:
    model = net()
    folder = tmp_path / "run" / "checkpoints" / "power_ema"
    ema = PowerEMA(model, SIGMAS, snapshot_every=2, snapshot_dir=folder)
    for step in range(1, 7):
        walk(model, step)
        ema.update()
    expected = synthesize(snapshot_paths(folder), 0.08)
    for given in (tmp_path / "run", str(folder), tmp_path):  # the run, its folder, any directory above
        found = synthesize(given, 0.08)
        assert found.keys() == expected.keys() and all(torch.equal(found[k], v) for k, v in expected.items())
    for missing, why in ((tmp_path / "run" / "checkpoints" / "nothing", "it does not exist"), (tmp_path / "x", "")):
        if not why:
            missing.mkdir()
        with pytest.raises(ValueError) as error:
            synthesize(missing, 0.08)
        message = str(error.value)
        assert str(missing) in message and why in message and "\n" not in message
        assert all(pattern in message for pattern in SNAPSHOT_PATTERNS)
    other = tmp_path / "run" / "copy"  # the control: a second folder of snapshots under the run is not guessed
    other.mkdir()
    (other / "power-ema-000000002.pt").write_bytes((folder / "power-ema-000000002.pt").read_bytes())
    with pytest.raises(ValueError, match=r"holds 2 folders of snapshots .*: give one"):
        synthesize(tmp_path / "run", 0.08)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ((12345, 0.08), TypeError, "snapshots must be a run's directory, its folder of snapshots, or a list"),
        (({"format": "x"}, 0.08), TypeError, "snapshots must be .* got dict"),
        (([3.5], 0.08), TypeError, r"snapshots\[0\] must be a snapshot file's path or a snapshot state, got float"),
        (([], 0.0), ValueError, r"sigma_rel must be a number in \(0, 0.2887\)"),
        (([], -0.1), ValueError, "sigma_rel must be a number in"),
        (([], 0.5), ValueError, "sigma_rel must be a number in"),
        (([], "0.08"), ValueError, "sigma_rel must be a number in .* got '0.08'"),
        (([], None), ValueError, "sigma_rel must be a number in"),
        (([], 0.08, 0), ValueError, "step must be an integer >= 1"),
        (([], 0.08, 2.5), ValueError, "step must be an integer >= 1 .* got 2.5"),
        (([], 0.08, "4"), ValueError, "step must be an integer >= 1"),
        (([], 0.08, True), ValueError, "step must be an integer >= 1"),
    ],
)
def test_synthesize_refuses_bad_arguments_in_one_line_naming_the_argument(
    tmp_path: Path, arguments: tuple, error: type[Exception], message: str
) -> None:
    snapshots, *rest = arguments
    with pytest.raises(error, match=message) as raised:  # before any file is read: a missing folder is not the error
        synthesize(tmp_path / "missing" if snapshots == [] else snapshots, *rest)
    assert "\n" not in str(raised.value)


def test_synthesize_takes_numpy_numbers_for_sigma_rel_and_step(tmp_path: Path) -> None:
    """The control for the argument checks: numbers of other types that are numbers pass."""
    model = net()
    ema = PowerEMA(model, SIGMAS, snapshot_every=2, snapshot_dir=tmp_path)
    for step in range(1, 5):
        walk(model, step)
        ema.update()
    plain = synthesize(tmp_path, 0.08, step=4)
    numpy = synthesize(tmp_path, np.float64(0.08), step=np.int64(4))
    assert all(torch.equal(numpy[k], v) for k, v in plain.items())


# -- reconstruction on a random walk -------------------------------------------------------------------------------


def walk_run(tmp_path: Path, steps: int, every: int, peer: Any = None, update_every: int = 1) -> dict[str, Any]:
    """A random walk of ``net()``'s weights: profiles 0.05 and 0.10 snapshotted every ``every`` steps, 0.08 tracked
    directly; ``peer`` (a factory of ema-pytorch's PostHocEMA) fed the same walk."""
    model = net()
    ema = PowerEMA(model, SIGMAS, update_every=update_every, snapshot_every=every, snapshot_dir=tmp_path / "ours")
    direct = PowerEMA(model, (0.08,), update_every=update_every)
    theirs = peer(model) if peer is not None else None
    for step in range(1, steps + 1):
        walk(model, step)
        ema.update()
        direct.update()
        if theirs is not None:
            theirs.update()
    floating = {k: v for k, v in direct.profiles[0].items() if v.is_floating_point()}
    spread = max_error({k: ema.profiles[0][k] for k in floating}, {k: ema.profiles[1][k] for k in floating})
    return {"ema": ema, "direct": floating, "spread": spread, "peer": theirs}


def test_the_ema_synthesized_at_an_untracked_sigma_rel_matches_one_tracked_directly(tmp_path: Path) -> None:
    run = walk_run(tmp_path, steps=1000, every=50)  # 20 snapshots of each profile
    synthesized = synthesize(tmp_path / "ours", 0.08)
    error = max_error(synthesized, run["direct"])
    assert error < 2e-3 * run["spread"]  # measured 3.5e-4 of the distance between the two stored profiles
    nearest = max_error({k: run["ema"].profiles[1][k] for k in run["direct"]}, run["direct"])  # the control
    assert nearest > 100 * error


@pytest.mark.parametrize("update_every", [1, 10])
def test_the_synthesized_ema_is_closer_to_the_tracked_one_than_ema_pytorchs(tmp_path: Path, update_every: int) -> None:
    ema_pytorch = pytest.importorskip("ema_pytorch")

    def peer(model: nn.Module) -> Any:
        return ema_pytorch.PostHocEMA(
            model, sigma_rels=SIGMAS, update_every=update_every, checkpoint_every_num_steps=50,
            checkpoint_folder=str(tmp_path / "peer"), checkpoint_dtype=torch.float32,
        )  # fmt: skip

    run = walk_run(tmp_path, steps=1000, every=50, peer=peer, update_every=update_every)
    ours = max_error(synthesize(tmp_path / "ours", 0.08), run["direct"])
    theirs = max_error(run["peer"].synthesize_ema_model(sigma_rel=0.08).ema_model.state_dict(), run["direct"])
    assert ours < theirs / {1: 3, 10: 100}[update_every], (ours, theirs)  # measured 4.4x and 18,000x


# -- the copy contract -----------------------------------------------------------------------------------------------


class OpNames(TorchDispatchMode):
    """The ATen ops a block runs, by name: ``.item()`` is ``_local_scalar_dense``, a read back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_update_allocates_nothing_and_reads_nothing_back(device: str, dtype: torch.dtype) -> None:
    model = net(device, dtype)
    ema = PowerEMA(model, SIGMAS)
    walk(model, 1)
    ema.update()
    walk(model, 2)
    with CopyAudit() as audit, MemoryProbe(device) as memory, OpNames() as ops:
        ema.update()
    assert audit.bytes_allocated == 0, audit.summary()
    assert memory.peak_bytes == 0
    assert audit.count("_foreach_lerp_") == 2 * 8  # per profile: 4 weights/biases, BN weight, bias, mean, var
    assert "_local_scalar_dense" not in ops.names
    live = [*model.parameters(), *model.buffers()]
    for profile in ema.profiles:
        for t in profile.values():
            assert not t.requires_grad and not isinstance(t, nn.Parameter)
            assert not any(shares_storage(t, x) for x in live)

    step = torch.tensor(2, device=device)  # the control: ema-pytorch's update, a device step counter read back...
    profile = {k: v.clone() for k, v in ema.profiles[0].items() if v.is_floating_point()}
    with CopyAudit() as control, OpNames() as control_ops, torch.no_grad():
        beta = (1 - 1 / (step.item() + 1)) ** (1 + ema.gammas[0])
        for name, e in profile.items():  # ...and the expression written out, which allocates
            e.copy_(beta * e + (1 - beta) * model.state_dict()[name].to(e.dtype))
    assert "_local_scalar_dense" in control_ops.names
    assert control.bytes_allocated > 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_profile_saved_for_backward_and_then_updated_makes_backward_raise(device: str) -> None:
    """The profiles' versions rise with every update, on every device (``copy_correct.core.foreach_writes``), so a graph
    that used a profile (an evaluation with it, a distillation loss) cannot silently backpropagate its new values."""
    model = net(device)
    ema = PowerEMA(model, SIGMAS)
    ema.update()
    walk(model, 2, scale=1.0)
    profile = ema.profiles[0]["0.weight"]
    x = torch.ones_like(profile, requires_grad=True)
    y = (x * profile).sum()  # saves the profile for x's gradient
    version = profile._version
    ema.update()
    assert profile._version == version + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()

    before = profile.clone()  # the control: the same write hidden from autograd (through .data)
    y = (x * profile).sum()
    walk(model, 3, scale=1.0)
    profile.data.lerp_(model[0].weight.detach(), 0.5)
    y.backward()
    assert torch.equal(x.grad, profile)  # the gradient silently used the overwritten values
    assert not torch.equal(profile, before)


def test_bf16_model_gets_float32_profiles_where_bf16_ones_round_every_update_away() -> None:
    model = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ours = PowerEMA(model, (0.10,))
    control = PowerEMA(model, (0.10,), shadow_dtype=torch.bfloat16)
    assert ours.profiles[0]["weight"].dtype == torch.float32
    late = {"sigma_rels": [0.10], "step": 10_000, "updated_step": 10_000}  # late in training: 1 - beta ~ 8e-4
    ours.load_state_dict({**late, "profiles": [{"weight": torch.ones(64, 64)}]})
    control.load_state_dict({**late, "profiles": [{"weight": torch.ones(64, 64, dtype=torch.bfloat16)}]})
    with torch.no_grad():
        model.weight.fill_(2.0)
    for _ in range(100):
        ours.update()
        control.update()
    kept = (10_000 / 10_100) ** (sigma_rel_to_gamma(0.10) + 1)
    assert ours.profiles[0]["weight"].mean().item() == pytest.approx(2.0 - kept, abs=1e-5)  # about 1.076
    assert control.profiles[0]["weight"].float().mean().item() == 1.0  # every update rounded away


# -- update_every, resume, snapshots -------------------------------------------------------------------------------


@pytest.mark.parametrize("every", [4, 10])
def test_update_every_n_is_the_per_step_power_ema_of_the_weights_sampled_every_n_steps(every: int) -> None:
    """Weights that change on the first step of each block of N and hold: the per-step EMA sees each block's
    weights N times, the one updated every N steps once, with beta for the N steps; the two must agree."""
    model = net(dtype=torch.float64)
    sampled = PowerEMA(model, SIGMAS, update_every=every)
    per_step = PowerEMA(model, SIGMAS)
    control = StepCountBeta(model, SIGMAS, update_every=every)
    for step in range(1, 20 * every + 1):
        if (step - 1) % every == 0:
            walk(model, step, scale=0.1)
        sampled.update()
        per_step.update()
        control.update()
    for ours, reference, theirs in zip(sampled.profiles, per_step.profiles, control.profiles, strict=True):
        assert max_error(ours, reference) < 1e-12
        assert max_error(theirs, reference) > 1e-2  # ema-pytorch's beta: an average of far older weights


def test_resume_from_state_dict_continues_profiles_and_snapshots_bit_for_bit(tmp_path: Path) -> None:
    def make(directory: str) -> tuple[nn.Module, PowerEMA]:
        model = net()
        return model, PowerEMA(model, SIGMAS, update_every=2, snapshot_every=10, snapshot_dir=tmp_path / directory)

    def train(model: nn.Module, ema: PowerEMA, steps: range) -> None:
        for step in steps:
            walk(model, step)
            ema.update()

    model, straight = make("straight")
    train(model, straight, range(1, 61))
    model, first = make("resumed")
    train(model, first, range(1, 32))  # stopped between two updates (update_every=2)
    torch.save({"model": model.state_dict(), "ema": first.state_dict()}, tmp_path / "last.ckpt")
    model, resumed = make("resumed")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["ema"])
    train(model, resumed, range(32, 61))
    model, fresh = make("fresh")  # the control: the model resumed, the PowerEMA not
    model.load_state_dict(checkpoint["model"])
    train(model, fresh, range(32, 61))

    assert all(torch.equal(resumed.profiles[i][k], v) for i, p in enumerate(straight.profiles) for k, v in p.items())
    assert (resumed.step, resumed.updated_step) == (60, 60)
    names = [p.name for p in snapshot_paths(tmp_path / "straight")]
    assert names == [p.name for p in snapshot_paths(tmp_path / "resumed")] == [f"power-ema-{t:09d}.pt" for t in
                                                                               range(10, 61, 10)]  # fmt: skip
    for name in names:
        a, b = load_snapshot(tmp_path / "straight" / name), load_snapshot(tmp_path / "resumed" / name)
        assert (a["step"], a["sigma_rels"], a["gammas"]) == (b["step"], b["sigma_rels"], b["gammas"])
        assert all(torch.equal(b["profiles"][i][k], v) for i, p in enumerate(a["profiles"]) for k, v in p.items())
    assert [p.name for p in snapshot_paths(tmp_path / "fresh")] != names[3:]  # steps counted again from 0
    assert max_error(fresh.profiles[0], straight.profiles[0]) > 1e-3


def test_a_snapshot_holds_copies_and_the_steps_to_reconstruct(tmp_path: Path) -> None:
    model = net()
    ema = PowerEMA(model, SIGMAS, update_every=3)
    for step in range(1, 8):
        walk(model, step)
        ema.update()
    snapshot = ema.snapshot()
    assert snapshot["step"] == 6  # the last averaged step, not the 7 calls
    assert snapshot["sigma_rels"] == list(SIGMAS) and snapshot["gammas"] == list(ema.gammas)
    for profile, own in zip(snapshot["profiles"], ema.profiles, strict=True):
        assert all(torch.equal(profile[k], v) and not shares_storage(profile[k], v) for k, v in own.items())
    path = ema.save_snapshot(tmp_path)
    assert path == tmp_path / "power-ema-000000006.pt"
    assert all(torch.equal(load_snapshot(path)["profiles"][1][k], v) for k, v in ema.profiles[1].items())


def test_tied_weights_share_one_tensor_per_profile_and_in_the_synthesized_state(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    ema = PowerEMA(model, SIGMAS, snapshot_every=5, snapshot_dir=tmp_path)
    for step in range(1, 21):
        walk(model, step)
        ema.update()
    assert all(p["0.weight"] is p["1.weight"] for p in ema.profiles)
    with CopyAudit() as audit:
        ema.update()
    assert audit.count("_foreach_lerp_") == 2  # one tensor per profile, written once
    synthesized = synthesize(tmp_path, 0.08)
    assert synthesized["0.weight"] is synthesized["1.weight"]


def crash_halfway(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.save`` that writes half of its bytes and then fails: a full disk, or a kill between two writes."""
    save = torch.save

    def crashing(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        import io

        buffer = io.BytesIO()
        save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        if isinstance(f, (str, os.PathLike)):
            Path(f).write_bytes(data[: len(data) // 2])
        else:
            f.write(data[: len(data) // 2])
            f.flush()
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", crashing)


def test_a_crash_while_writing_a_snapshot_leaves_no_partial_file_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = net()
    ema = PowerEMA(model, SIGMAS, snapshot_every=10, snapshot_dir=tmp_path)
    for step in range(1, 20):
        walk(model, step)
        ema.update()
    with monkeypatch.context() as patch:
        crash_halfway(patch)
        walk(model, 20)
        with pytest.raises(OSError, match="No space left"):
            ema.update()  # the scheduled snapshot of step 20
    assert sorted(os.listdir(tmp_path)) == ["power-ema-000000010.pt"]  # no partial file, no temporary file
    synthesize(tmp_path, 0.08)  # what is there loads

    with monkeypatch.context() as patch:  # the control: torch.save straight to the final name
        crash_halfway(patch)
        with pytest.raises(OSError, match="No space left"):
            torch.save(ema.snapshot(), tmp_path / "power-ema-000000020.pt")
    with pytest.raises(ValueError, match=r"power-ema-000000020\.pt is not the zip archive torch\.save writes"):
        synthesize(tmp_path, 0.08)  # a partial file under the final name breaks every later reconstruction


def test_synthesize_reads_the_snapshots_memory_mapped_and_holds_about_one_model(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    ema = PowerEMA(model, SIGMAS, snapshot_every=5, snapshot_dir=tmp_path)
    for step in range(1, 41):  # 8 snapshots of 2 profiles: 16 models' worth of files
        walk(model, step)
        ema.update()
    paths = snapshot_paths(tmp_path)
    maps = Path("/proc/self/maps")  # Linux: the files this process has mapped into its memory
    if maps.exists():
        mapped = load_snapshot(paths[0])
        assert str(paths[0]) in maps.read_text()  # its tensors are a view of the file, not a copy
        eager = torch.load(paths[1], weights_only=True)  # the control: a plain load reads the file into memory
        assert str(paths[1]) not in maps.read_text()
        del mapped, eager
    one_model = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    largest = max(t.numel() for t in model.state_dict().values())
    with MemoryProbe("cpu") as memory:
        synthesized = synthesize(paths, 0.08)
    assert memory.net_bytes == one_model  # the result
    assert memory.peak_bytes <= one_model + 8 * largest  # and one float64 accumulator at a time

    states = [load_snapshot(p) for p in paths]  # the control: snapshot by snapshot, a float64 model accumulated
    terms = [(c, profile) for _, _, profile, c in synthesis_coefficients(states, 0.08)]
    with MemoryProbe("cpu") as control:
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in model.state_dict().items()}
        for c, profile in terms:
            for k, v in profile.items():
                total[k].add_(v, alpha=c)
        combined = {k: v.float() for k, v in total.items()}
    assert control.peak_bytes >= 3 * one_model
    assert max_error(combined, synthesized) < 1e-6


def test_snapshots_joined_from_ranks_shards_synthesize_as_the_full_snapshots_bit_for_bit() -> None:
    """``copy-correct posthoc`` reads a sharded run's snapshots through ``joined_snapshot``, whose tensors are joined
    anew at every read: six tensors of one shape, so a freed join's memory is the next one's, and ``synthesize``'s
    check for tied names (by storage) would take one tensor's result for another's if it let the joins go (measured: it
    did, before it kept them). The control: one rank's shards alone are refused, not taken for the model."""
    from copy_correct.averages.posthoc_command import joined_snapshot

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(6)])
    power_ema = PowerEMA(net)
    full, joined = [], []
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        power_ema.update()
        state = power_ema.snapshot()
        spread = dict.fromkeys(state["profiles"][0], "Shard(dim=0) over a mesh of 2 ranks")
        ranks = [
            state | {"rank": r, "world_size": 2, "layout": spread,
                     "profiles": [{n: t.chunk(2)[r].clone() for n, t in p.items()} for p in state["profiles"]]}
            for r in range(2)
        ]  # fmt: skip
        full.append(state)
        joined.append(joined_snapshot(ranks))
    expected, result = synthesize(full, 0.08), synthesize(joined, 0.08)
    assert result.keys() == expected.keys() and all(torch.equal(result[n], expected[n]) for n in expected)
    with pytest.raises(ValueError, match=r"only Shard\(dim=D\) over one mesh of all ranks is joined"):
        synthesize([joined_snapshot([ranks[0]])], 0.08)  # the control
