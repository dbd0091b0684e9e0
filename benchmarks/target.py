"""Benchmark target-network updates against stable-baselines3's and TorchRL's, as installed and called the way
their own DQN code calls them, in one process; write the table to docs/benchmarks.md.

    pip install -e ".[bench]"                       # the peers (see benchmarks/peers.py)
    python -m benchmarks.target                  # CPU; two RL MLPs and a ~24M-parameter conv net
    python -m benchmarks.target --device cuda    # the same on a GPU
    python -m benchmarks.target --quick --output /tmp/b.md   # smoke run
    python -m benchmarks.target --threads 1      # one torch thread: for cores that other processes share

Hard copy: ``copy_correct.hard_update``; stable-baselines3's ``polyak_update`` with ``tau=1.0`` on the parameters
and again on the BatchNorm running statistics (``get_parameters_by_name(q_net, ["running_"])``), which is what
SB3's ``DQN`` runs at each target update; TorchRL's ``HardUpdate(DQNLoss(QValueActor(net), delay_value=True),
value_network_update_interval=0).step()`` (an interval of 0 copies on every call; a user's 1000 makes 999 of
1000 calls walk the parameters without copying); ``target.load_state_dict(online.state_dict())`` (Lightning's
DQN example, PyTorch's DQN tutorial); a bare ``_foreach_copy_`` per dtype over prebuilt lists (the same calls
as ours, without our bookkeeping), and one ``_foreach_copy_`` over a list that mixes dtypes.

Both with ``skip_nonfinite=True`` too: the update skipped when an online value is NaN or Inf, decided on the host
before writing for a CPU target, on the device for a GPU one (its ``time / ours`` is the guard's cost).

Soft (Polyak, tau = 0.005): ``copy_correct.soft_update``; SB3's ``polyak_update(params, target_params, tau)`` and
the running statistics copied with ``tau=1.0``, as SB3's ``DQN`` does; TorchRL's ``SoftUpdate(loss, tau=tau)
.step()``; CleanRL's ``dqn.py`` line ``t.data.copy_(tau * q.data + (1 - tau) * t.data)`` (CleanRL is
single-file scripts, not a package: the line is quoted); a bare ``_foreach_lerp_``; and ``lerp_`` on one flat
tensor of the floating elements (one kernel where a CPU's foreach call runs one per tensor). Plus a plain copy of the
same bytes (from a written source: ``torch.empty``'s untouched pages all read as one zero page, from cache).

Bandwidth. Effective GB/s counts STREAM's way, the bytes each contender names: 8 per element for a copy, 12 for a
soft update, over the whole state (the peers that update parameters and running statistics only move a little
less). Each table's rounds also time STREAM copy and triad and STREAM2's DAXPY on arrays of 4x the caches
(``benchmarks.stream``), and each row is stated in bytes moved against the kernel with its access pattern: on a CPU
a copy also reads each target line before writing it (write-allocate: 12 bytes) and is held to STREAM copy; an
update in place writes lines it has read (12) and is held to DAXPY (``a += q*b``, in place).

The mixed-dtype row explains a number: on CUDA a foreach call takes its fused path only when every tensor in
its lists has one dtype; float weights and BatchNorm's int64 ``num_batches_tracked`` in one list send the
whole call down the fallback, one ``copy_`` (and one launch) per tensor: 8.4x slower than ``hard_update`` on
the conv net on an H200. On a CPU every foreach call is that loop, so the rows agree there.

Rows marked "candidate" are other ways to do ``hard_update``'s and ``soft_update``'s work on large networks,
measured to choose between them on a GPU: large tensors (>= 2M elements) one kernel each, which runs at a
plain copy's speed but costs one launch per tensor, the rest in one foreach call; and (hard only) one
``torch.cat(..., out=)`` into a flat buffer, what a target whose tensors were views of one buffer would cost.

Models: CleanRL's own CartPole Q-network (4-120-84-2, 11K elements: per-call overhead dominates), the
``dqn`` recipe's wider one (4-256-256-2, 68K elements: the work is already a few hundred KB, so cache
bandwidth weighs as much as overhead) and a ~24M-element conv net (memory-bandwidth-bound).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.ema import FLAT_LERP, conv_net, large_model
from benchmarks.peers import Missing, label, load
from benchmarks.report import bandwidth_table, command_line, measured_on, median_ms, parse_args, write_section
from benchmarks.stream import in_rounds
from copy_correct import hard_update, make_target, soft_update
from recipes.dqn import QNetwork

ROOT = Path(__file__).resolve().parents[1]

TAU = 0.005
COPY = "plain copy of the same bytes"
LARGE = 1 << 21  # elements: a "large" tensor in the candidate rows
FLOOR_SHARE = 85  # percent of STREAM below which the section explains our row


def cleanrl_q_network() -> nn.Module:
    """CleanRL's ``dqn.py`` QNetwork for CartPole: 4 -> 120 -> 84 -> 2."""
    return nn.Sequential(nn.Linear(4, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 2))


def torchrl_updaters(online: nn.Module) -> tuple[Any, Any] | Missing:
    """TorchRL's ``HardUpdate`` and ``SoftUpdate`` on a ``DQNLoss`` whose value network is a copy of ``online`` in a
    ``QValueActor``, as TorchRL's DQN users build them. The loss keeps its own target (a ``TensorDictParams``); the
    copy keeps TorchRL's wrapping off the network the other contenders update."""
    modules = load("torchrl.modules", "torchrl")
    if isinstance(modules, Missing):
        return modules
    from torchrl.data import OneHot
    from torchrl.objectives import DQNLoss, HardUpdate, SoftUpdate

    spec = OneHot(2)  # the action spec plays no part in a target update (the conv net has no Q-value head)
    actor = modules.QValueActor(copy.deepcopy(online), in_keys=["observation"], spec=spec)
    loss = DQNLoss(actor, action_space="one-hot", delay_value=True)
    hard = HardUpdate(loss, value_network_update_interval=0)
    return hard, SoftUpdate(loss, tau=TAU)


Contenders = dict[str, Callable[[], object]]


def contenders(online: nn.Module) -> tuple[Contenders, Contenders, dict[str, str]]:
    target = make_target(online)
    pairs = list(
        zip(target.state_dict(keep_vars=True).values(), online.state_dict(keep_vars=True).values(), strict=True)
    )
    t_all, q_all = [t for t, _ in pairs], [q for _, q in pairs]
    t_float, q_float = [t for t, _ in pairs if t.is_floating_point()], [q for _, q in pairs if q.is_floating_point()]
    t_int, q_int = (
        [t for t, _ in pairs if not t.is_floating_point()],
        [q for _, q in pairs if not q.is_floating_point()],
    )
    t_params, q_params = list(target.parameters()), list(online.parameters())
    elements = sum(q.numel() for q in q_all)
    flat_source = torch.randn(elements, device=q_all[0].device)  # written: torch.empty's pages would read as zeros
    flat_target = torch.empty_like(flat_source)

    def bare_copy() -> None:  # the same work as hard_update: one call per dtype
        with torch.no_grad():
            torch._foreach_copy_(t_float, q_float)
            if t_int:
                torch._foreach_copy_(t_int, q_int)

    def mixed_copy() -> None:
        with torch.no_grad():
            torch._foreach_copy_(t_all, q_all)

    large = [(t, q) for t, q in zip(t_float, q_float, strict=True) if q.numel() >= LARGE]
    t_rest = [t for t, q in zip(t_float, q_float, strict=True) if q.numel() < LARGE]
    q_rest = [q for q in q_float if q.numel() < LARGE]

    def split_copy() -> None:
        with torch.no_grad():
            for t, q in large:
                t.copy_(q)
            torch._foreach_copy_(t_rest, q_rest)
            if t_int:
                torch._foreach_copy_(t_int, q_int)

    def split_lerp() -> None:
        with torch.no_grad():
            for t, q in large:
                t.lerp_(q, TAU)
            torch._foreach_lerp_(t_rest, q_rest, TAU)
            if t_int:
                torch._foreach_copy_(t_int, q_int)

    flat_target_float = torch.empty(sum(q.numel() for q in q_float), device=q_float[0].device)
    flat_source_float = torch.randn_like(flat_target_float)
    q_float_flat = [q.reshape(-1) for q in q_float]  # views: the weights are contiguous

    def cat_copy() -> None:
        with torch.no_grad():
            torch.cat(q_float_flat, out=flat_target_float)
            if t_int:
                torch._foreach_copy_(t_int, q_int)

    def cleanrl() -> None:
        for t, q in zip(t_params, q_params, strict=True):
            t.data.copy_(TAU * q.data + (1.0 - TAU) * t.data)

    def bare_lerp() -> None:  # the same work as soft_update: floating state averaged, integer buffers copied
        with torch.no_grad():
            torch._foreach_lerp_(t_float, q_float, TAU)
            if t_int:
                torch._foreach_copy_(t_int, q_int)

    hard: dict[str, Callable[[], object]] = {
        "copy_correct.hard_update": lambda: hard_update(target, online),
        "copy_correct.hard_update, skip_nonfinite=True": lambda: hard_update(target, online, skip_nonfinite=True),
    }
    soft: dict[str, Callable[[], object]] = {
        "copy_correct.soft_update": lambda: soft_update(target, online, TAU),
        "copy_correct.soft_update, skip_nonfinite=True": lambda: soft_update(target, online, TAU, skip_nonfinite=True),
    }
    not_run: dict[str, str] = {}
    sb3 = load("stable_baselines3.common.utils", "stable-baselines3")
    sb3_hard, sb3_soft = (
        label("stable-baselines3", f"polyak_update (tau={tau}), as DQN calls it") for tau in (1.0, TAU)
    )
    if isinstance(sb3, Missing):
        not_run |= {sb3_hard: sb3, sb3_soft: sb3}
    else:
        stats, stats_target = (sb3.get_parameters_by_name(net, ["running_"]) for net in (online, target))

        def sb3_update(tau: float) -> None:
            sb3.polyak_update(online.parameters(), target.parameters(), tau)
            sb3.polyak_update(stats, stats_target, 1.0)

        hard[sb3_hard], soft[sb3_soft] = partial(sb3_update, 1.0), partial(sb3_update, TAU)
    torchrl_hard, torchrl_soft = (
        label("torchrl", "HardUpdate.step() (interval 0)"),
        label("torchrl", "SoftUpdate.step()"),
    )
    torchrl = torchrl_updaters(online)
    if isinstance(torchrl, Missing):
        not_run |= {torchrl_hard: torchrl, torchrl_soft: torchrl}
    else:
        hard[torchrl_hard], soft[torchrl_soft] = torchrl[0].step, torchrl[1].step
    hard |= {
        "load_state_dict(state_dict()) (Lightning's and PyTorch's DQN examples)": lambda: target.load_state_dict(
            online.state_dict()
        ),
        "bare _foreach_copy_ per dtype, prebuilt lists": bare_copy,
        "one _foreach_copy_ over mixed dtypes": mixed_copy,
        "candidate: copy_ per large tensor, foreach for the rest": split_copy,
        "candidate: torch.cat into a flat target": cat_copy,
        COPY: lambda: flat_target.copy_(flat_source),
    }
    soft |= {
        "CleanRL dqn.py's line: copy_(tau*q + (1-tau)*t) per parameter": cleanrl,
        "bare _foreach_lerp_, prebuilt lists": bare_lerp,
        "candidate: lerp_ per large tensor, foreach for the rest": split_lerp,
        FLAT_LERP: lambda: flat_target_float.lerp_(flat_source_float, TAU),
    }
    return hard, soft, not_run


def tables(
    title: str, online: nn.Module, device: torch.device, budget: float, quick: bool = False
) -> tuple[str, list[str]]:
    """The model's hard and soft tables, and a note for each of our two rows below ``FLOOR_SHARE`` of STREAM."""
    hard, soft, not_run = contenders(online)
    stream, limit_of = in_rounds(device, quick)
    hard_times = median_ms(hard | stream, device, budget / 2)
    hard_limit = limit_of(hard_times)
    soft_times = median_ms(soft | {COPY: hard[COPY]} | stream, device, budget / 2)  # each table its own rounds
    soft_limit = limit_of(soft_times)
    elements = sum(t.numel() for t in online.state_dict().values())
    floats = sum(t.numel() for t in online.state_dict().values() if t.is_floating_point())
    tensors = len(online.state_dict())
    soft_times[COPY] *= floats / elements
    hard_caption = (
        f"**{title}, hard update**: {elements / 1e6:.3f}M elements in {tensors} tensors; {hard_limit.sentence()}"
    )
    soft_caption = (
        f"**{title}, soft update (tau={TAU})**: {floats / 1e6:.3f}M floating elements (CleanRL's line updates "
        f"parameters only); {soft_limit.sentence()}"
    )
    soft_bytes = {name: 8 if name == COPY else 12 for name in soft_times}
    low = []
    for ours, ms, moved, limit, kernel in [
        ("hard_update", hard_times["copy_correct.hard_update"], 8 + 4 * hard_limit.write_allocate, hard_limit, "copy"),
        ("soft_update", soft_times["copy_correct.soft_update"], 12, soft_limit, "daxpy"),
    ]:
        share = 100 * moved * (elements if ours == "hard_update" else floats) / (ms * 1e-3) / 1e9 / limit.moved(kernel)
        if share < FLOOR_SHARE:
            low.append(f"`{ours}` on the {title} at {share:.0f}% of {'STREAM copy' if kernel == 'copy' else 'DAXPY'}")
    hard_not_run = {name: why for name, why in not_run.items() if "tau=1.0" in name or "Hard" in name}
    soft_not_run = {name: why for name, why in not_run.items() if name not in hard_not_run}
    return "\n\n".join(
        [
            bandwidth_table(hard_caption, elements, hard_times, dict.fromkeys(hard_times, 8),
                            "copy_correct.hard_update", COPY, hard_not_run, limit=hard_limit),
            bandwidth_table(soft_caption, floats, soft_times, soft_bytes, "copy_correct.soft_update", COPY,
                            soft_not_run, limit=soft_limit),
        ]
    ), low  # fmt: skip


def main(argv: list[str]) -> int:
    args, device, budget = parse_args(__doc__, argv, 16.0, ROOT / "docs" / "benchmarks.md")
    models: dict[str, Callable[[], nn.Module]] = {"small RL MLP (CleanRL's QNetwork, 4-120-84-2)": cleanrl_q_network}
    if args.quick:
        models["medium conv net"] = lambda: conv_net([(32, 2), (64, 2)])
    else:
        models["RL MLP (the dqn recipe's QNetwork, 4-256-256-2)"] = lambda: QNetwork(4, 2, 256)
        models["large conv net"] = large_model
    sections, low = [], []
    for title, make in models.items():
        torch.manual_seed(0)
        table, below = tables(title, make().to(device), device, budget, args.quick)
        sections.append(table)
        low += below
        print(table, end="\n\n", flush=True)
    header = (
        f"{measured_on(device, command_line('benchmarks.target', args))} Each caption gives STREAM copy and triad "
        "and STREAM2's DAXPY timed in that table's own rounds; each row's bytes moved are held to the kernel with its "
        "access pattern, a copy's to STREAM copy, an update's in place to DAXPY (the STREAM section, at the end of "
        "this page, says how they are counted and why). "
        + (
            f"Ours below {FLOOR_SHARE}% of STREAM: {'; '.join(low)}. On the two MLPs the state (44 KB, 272 KB) sits "
            "in cache and a call's fixed cost is most of its time: the share measures overhead, not memory; on the "
            "large conv net, see the STREAM section's notes on many tensors and shared cores."
            if low
            else f"None of ours is below {FLOOR_SHARE}% of STREAM."
        )
        + (
            " One torch thread: this machine's 2 cores are shared with other processes, and with 2 threads every "
            "per-tensor parallel region waits for a thread that is not running (a run with 2 threads on 2026-12-02 "
            "timed `hard_update` on the large conv net at 164 ms, a flat copy of its bytes at 10 ms)."
            if args.threads == 1 and device.type == "cpu"
            else ""
        )
    )
    write_section(args.output, f"target-{device.type}", f"Target-network updates ({device.type})", header,
                  "\n\n".join(sections))  # fmt: skip
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
