"""Benchmark target-network updates against their peers, in one process; write the table to docs/benchmarks.md.

    python scripts/bench_target.py                  # CPU; two RL MLPs and a ~24M-parameter conv net
    python scripts/bench_target.py --device cuda    # the same on a GPU
    python scripts/bench_target.py --quick --output /tmp/b.md   # smoke run

Hard copy: ``components.hard_update``, ``target.load_state_dict(online.state_dict())`` (Lightning's DQN
example), a per-tensor ``t.data.copy_(q.data)`` loop, a bare ``_foreach_copy_`` per dtype over prebuilt
lists (the same calls as ours, without our bookkeeping), and one ``_foreach_copy_`` over a list that mixes
dtypes. Soft (Polyak, tau = 0.005): ``components.soft_update``, per-tensor ``mul_`` then ``add(out=)``
(stable-baselines3's way), per-tensor ``t.data.copy_(tau * q.data + (1 - tau) * t.data)`` (CleanRL's
way), a bare ``_foreach_lerp_``. Plus a plain copy of the same bytes as the bandwidth limit. Effective
bandwidth counts 8 bytes per element for a copy and 12 for a soft update.

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

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components import hard_update, make_target, soft_update  # noqa: E402
from recipes.dqn import QNetwork  # noqa: E402
from scripts.bench_ema import conv_net, large_model  # noqa: E402
from scripts.bench_report import bandwidth_table, command_line, measured_on, median_ms, parse_args, write_section  # noqa: E402

TAU = 0.005
LARGE = 1 << 21  # elements: a "large" tensor in the candidate rows


def cleanrl_q_network() -> nn.Module:
    """CleanRL's ``dqn.py`` QNetwork for CartPole: 4 -> 120 -> 84 -> 2."""
    return nn.Sequential(nn.Linear(4, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 2))


def contenders(online: nn.Module) -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[], object]]]:
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
    flat_source = torch.empty(elements, device=q_all[0].device)
    flat_target = torch.empty_like(flat_source)

    def per_tensor_data_copy() -> None:
        for t, q in pairs:
            t.data.copy_(q.data)

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
    q_float_flat = [q.reshape(-1) for q in q_float]  # views: the weights are contiguous

    def cat_copy() -> None:
        with torch.no_grad():
            torch.cat(q_float_flat, out=flat_target_float)
            if t_int:
                torch._foreach_copy_(t_int, q_int)

    def sb3_polyak() -> None:
        with torch.no_grad():
            for q, t in zip(q_params, t_params, strict=True):
                t.data.mul_(1 - TAU)
                torch.add(t.data, q.data, alpha=TAU, out=t.data)

    def cleanrl() -> None:
        for t, q in zip(t_params, q_params, strict=True):
            t.data.copy_(TAU * q.data + (1.0 - TAU) * t.data)

    def bare_lerp() -> None:  # the same work as soft_update: floating state averaged, integer buffers copied
        with torch.no_grad():
            torch._foreach_lerp_(t_float, q_float, TAU)
            if t_int:
                torch._foreach_copy_(t_int, q_int)

    hard = {
        "components.hard_update": lambda: hard_update(target, online),
        "load_state_dict(state_dict())": lambda: target.load_state_dict(online.state_dict()),
        "per-tensor .data.copy_ loop": per_tensor_data_copy,
        "bare _foreach_copy_ per dtype, prebuilt lists": bare_copy,
        "one _foreach_copy_ over mixed dtypes": mixed_copy,
        "candidate: copy_ per large tensor, foreach for the rest": split_copy,
        "candidate: torch.cat into a flat target": cat_copy,
        "plain copy of the same bytes": lambda: flat_target.copy_(flat_source),
    }
    soft = {
        "components.soft_update": lambda: soft_update(target, online, TAU),
        "mul_ + add(out=) per tensor (SB3)": sb3_polyak,
        "copy_(tau*q + (1-tau)*t) per tensor (CleanRL)": cleanrl,
        "bare _foreach_lerp_, prebuilt lists": bare_lerp,
        "candidate: lerp_ per large tensor, foreach for the rest": split_lerp,
    }
    return hard, soft


def tables(title: str, online: nn.Module, device: torch.device, budget: float) -> str:
    hard, soft = contenders(online)
    hard_times = median_ms(hard, device, budget / 2)
    soft_times = median_ms(soft, device, budget / 2)
    elements = sum(t.numel() for t in online.state_dict().values())
    floats = sum(t.numel() for t in online.state_dict().values() if t.is_floating_point())
    tensors = len(online.state_dict())
    copy_ms = hard_times["plain copy of the same bytes"]
    soft_times["plain copy of the same bytes"] = copy_ms * floats / elements
    hard_caption = f"**{title}, hard update**: {elements / 1e6:.3f}M elements in {tensors} tensors"
    soft_caption = (
        f"**{title}, soft update (tau={TAU})**: {floats / 1e6:.3f}M floating elements (SB3's and CleanRL's "
        "ways update parameters only)"
    )
    soft_bytes = {name: 8 if name.startswith("plain") else 12 for name in soft_times}
    return "\n\n".join(
        [
            bandwidth_table(hard_caption, elements, hard_times, dict.fromkeys(hard_times, 8), "components.hard_update",
                            "plain copy of the same bytes"),
            bandwidth_table(soft_caption, floats, soft_times, soft_bytes, "components.soft_update",
                            "plain copy of the same bytes"),
        ]
    )  # fmt: skip


def main(argv: list[str]) -> int:
    args, device, budget = parse_args(__doc__, argv, 16.0, ROOT / "docs" / "benchmarks.md")
    models: dict[str, Callable[[], nn.Module]] = {"small RL MLP (CleanRL's QNetwork, 4-120-84-2)": cleanrl_q_network}
    if args.quick:
        models["medium conv net"] = lambda: conv_net([(32, 2), (64, 2)])
    else:
        models["RL MLP (the dqn recipe's QNetwork, 4-256-256-2)"] = lambda: QNetwork(4, 2, 256)
        models["large conv net"] = large_model
    sections = []
    for title, make in models.items():
        torch.manual_seed(0)
        sections.append(tables(title, make().to(device), device, budget))
        print(sections[-1], end="\n\n", flush=True)
    command = command_line("bench_target.py", args)
    write_section(
        args.output, f"target-{device.type}", f"Target-network updates ({device.type})",
        measured_on(device, command), "\n\n".join(sections),
    )  # fmt: skip
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
