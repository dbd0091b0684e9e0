"""The power-function EMA's arithmetic (EDM2: Karras et al. 2024, "Analyzing and Improving the Training Dynamics of
Diffusion Models", appendix C.3-C.4): ``sigma_rel`` <-> ``gamma``, a profile's impulse response, the inner product of
two profiles, and the post-hoc reconstruction coefficients.

Copy contract: host arithmetic on Python floats and float64 numpy arrays; no tensor is read, written or allocated.

A power-function EMA with exponent ``gamma`` averages the live weights of optimizer steps ``1..t`` with weights
proportional to ``s ** gamma``: the per-step update ``ema = beta_t * ema + (1 - beta_t) * live`` with
``beta_t = (1 - 1 / t) ** (gamma + 1)`` (``t`` 1-based, so the first update copies) gives step ``s`` the weight
``(s ** (gamma + 1) - (s - 1) ** (gamma + 1)) / t ** (gamma + 1)``, exactly the integral over ``[s - 1, s]`` of the
density ``p(u) = (gamma + 1) u ** gamma / t ** (gamma + 1)`` on ``[0, t]``. ``sigma_rel`` is that density's standard
deviation relative to ``t``, which is what stays meaningful as training grows longer.

Post-hoc reconstruction (the paper's Algorithm 3): the profile ``(t, gamma)`` of any target is approximated by a
linear combination of stored profiles ``(t_i, gamma_i)``; the least-squares coefficients solve the normal equations
``A x = b`` with ``A_ij = <p_i, p_j>`` and ``b_i = <p_i, p_target>``, inner products of the densities in closed form.
The Gram matrix of two profiles snapshotted 256 times each has a condition number of 4.6e8, so the solve runs in
float64. The coefficients are then divided by their sum, so that a weight that never changed is reconstructed exactly:
with 8 snapshots of each of 0.05 and 0.10, the unnormalised coefficients of the targets 0.03, 0.08 and 0.15 sum to
0.990, 1.001 and 0.995, scaling every synthesized weight by that much. A snapshot taken after the target step holds
weights from after it and is given coefficient 0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

__all__ = [
    "SIGMA_REL_MAX",
    "gamma_to_sigma_rel",
    "impulse_response",
    "power_function_correlation",
    "sigma_rel_to_gamma",
    "solve_coefficients",
]

SIGMA_REL_MAX = 1 / math.sqrt(12)  # sigma_rel of gamma = 0 (a uniform average); larger ones have gamma < 0


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent ``gamma`` of the power function whose relative standard deviation is ``sigma_rel``: the largest
    real root of ``gamma^3 + 7 gamma^2 + (16 - sigma_rel^-2) gamma + (12 - sigma_rel^-2)`` (the paper's equation
    126 and Algorithm 2), polished by Newton's method in float64. ``sigma_rel`` must be in ``(0, SIGMA_REL_MAX)``:
    0.05 gives 16.97, 0.10 gives 6.94."""
    _check_sigma_rel(sigma_rel)
    t = float(sigma_rel) ** -2
    coefficients = (1.0, 7.0, 16.0 - t, 12.0 - t)
    roots = np.roots(coefficients)
    gamma = float(max(r.real for r in roots if abs(r.imag) <= 1e-9 * max(1.0, abs(r))))
    for _ in range(3):  # the companion-matrix roots are good to ~1e-13 relative; Newton makes them exact in float64
        value = ((gamma + 7.0) * gamma + 16.0 - t) * gamma + 12.0 - t
        slope = (3.0 * gamma + 14.0) * gamma + 16.0 - t
        if slope == 0.0:
            break
        gamma -= value / slope
    return gamma


def gamma_to_sigma_rel(gamma: float) -> float:
    """The relative standard deviation of the power function with exponent ``gamma > 0`` (the paper's equation 123):
    ``sqrt((gamma + 1) / ((gamma + 2) ** 2 (gamma + 3)))``."""
    if not (isinstance(gamma, numbers.Real) and math.isfinite(gamma) and gamma > 0):
        raise ValueError(f"gamma must be a finite number > 0, got {gamma!r}")
    gamma = float(gamma)
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def impulse_response(step: int, sigma_rel: float, update_every: int = 1) -> np.ndarray:
    """The weights (float64, summing to 1) that the profile ``sigma_rel`` gives the live weights of optimizer steps
    ``1..step`` when it is updated every ``update_every`` steps (``PowerEMA``'s ``beta``): an update at step ``s``
    whose previous update was at ``p`` gets ``(s ** (gamma + 1) - p ** (gamma + 1)) / T ** (gamma + 1)``, ``T`` the
    last update at or before ``step``; steps that are not updated get 0. Exact (no approximation), up to rounding."""
    if step < 1 or update_every < 1:
        raise ValueError(f"step and update_every must be >= 1, got step={step}, update_every={update_every}")
    exponent = sigma_rel_to_gamma(sigma_rel) + 1
    last = step - step % update_every
    if last == 0:
        raise ValueError(f"no update at or before step {step} with update_every={update_every}")
    weights = np.zeros(step, dtype=np.float64)
    updates = np.arange(update_every, last + 1, update_every, dtype=np.float64)
    reached = (updates / last) ** exponent  # the share of the profile that steps 1..s hold, after step `last`
    weights[updates.astype(np.int64) - 1] = reached - ((updates - update_every) / last) ** exponent
    return weights


def power_function_correlation(
    step_a: np.ndarray | float, gamma_a: np.ndarray | float, step_b: np.ndarray | float, gamma_b: np.ndarray | float
) -> np.ndarray:
    """``<p_a, p_b>``: the integral over ``[0, min(t_a, t_b)]`` of the product of the two power-function densities
    ``p(u) = (gamma + 1) u ** gamma / t ** (gamma + 1)`` (the paper's equation 151), broadcast over the arguments, in
    float64: ``(gamma_a + 1)(gamma_b + 1) (t_a / t_b) ** e / ((gamma_a + gamma_b + 1) max(t_a, t_b))`` with
    ``e = gamma_b`` where ``t_a < t_b`` and ``-gamma_a`` otherwise."""
    step_a, gamma_a, step_b, gamma_b = (np.asarray(x, dtype=np.float64) for x in (step_a, gamma_a, step_b, gamma_b))
    exponent = np.where(step_a < step_b, gamma_b, -gamma_a)
    numerator = (gamma_a + 1) * (gamma_b + 1) * (step_a / step_b) ** exponent
    return numerator / ((gamma_a + gamma_b + 1) * np.maximum(step_a, step_b))


def solve_coefficients(
    snapshot_meta: Sequence[tuple[int, float]], target_step: int, target_sigma_rel: float
) -> np.ndarray:
    """The float64 coefficients, one per ``(step, sigma_rel)`` of ``snapshot_meta`` (each stored profile of each
    snapshot), whose combination of the stored profiles is the least-squares fit of the profile ``target_sigma_rel``
    at ``target_step``; normalised to sum to 1. Profiles stored after ``target_step`` get 0, and so does a repeat of
    an earlier ``(step, sigma_rel)`` (it adds nothing and would make the system singular). Raises ``ValueError`` for a
    ``sigma_rel`` outside ``(0, SIGMA_REL_MAX)``, a ``target_step`` below 1, or no profile at or before it."""
    if not (isinstance(target_step, (int, np.integer)) and target_step >= 1):
        raise ValueError(f"target_step must be an integer >= 1, got {target_step!r}")
    target_gamma = sigma_rel_to_gamma(target_sigma_rel)
    gammas: dict[float, float] = {}
    usable: list[int] = []
    seen: set[tuple[int, float]] = set()
    for i, (step, sigma_rel) in enumerate(snapshot_meta):
        if sigma_rel not in gammas:
            gammas[sigma_rel] = sigma_rel_to_gamma(sigma_rel)
        if step < 1:
            raise ValueError(f"snapshot {i} has step {step}: a profile holds weights from step 1 on")
        if step <= target_step and (step, sigma_rel) not in seen:
            seen.add((step, sigma_rel))
            usable.append(i)
    if not usable:
        earliest = min((step for step, _ in snapshot_meta), default=None)
        raise ValueError(
            f"no snapshot at or before step {target_step} to reconstruct from (earliest: {earliest}); "
            "pick a later step or snapshot more often"
        )
    steps = np.array([snapshot_meta[i][0] for i in usable], dtype=np.float64)
    stored = np.array([gammas[snapshot_meta[i][1]] for i in usable], dtype=np.float64)
    gram = power_function_correlation(steps[:, None], stored[:, None], steps[None, :], stored[None, :])
    target = power_function_correlation(steps, stored, float(target_step), target_gamma)
    try:
        solution = np.linalg.solve(gram, target)
    except np.linalg.LinAlgError as error:
        raise ValueError(f"the stored profiles are linearly dependent ({error}); drop repeated snapshots") from error
    coefficients = np.zeros(len(snapshot_meta), dtype=np.float64)
    coefficients[usable] = solution / solution.sum()
    return coefficients


def _check_sigma_rel(sigma_rel: float) -> None:
    if not (isinstance(sigma_rel, numbers.Real) and 0 < sigma_rel < SIGMA_REL_MAX):
        raise ValueError(
            f"sigma_rel must be a number in (0, {SIGMA_REL_MAX:.4f}) (gamma > 0; EDM2 uses 0.05 to 0.20), "
            f"got {sigma_rel!r}"
        )
