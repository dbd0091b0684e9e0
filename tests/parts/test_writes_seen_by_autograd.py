"""Every component that writes tensors in place raises their version counters on every device, so a tensor saved
for backward and then overwritten by it makes ``backward()`` raise instead of computing with the new values.

For each writer: a product ``x * t`` saves ``t`` for ``x``'s gradient, the writer overwrites ``t``, and backward
must raise. Controls: the same write done so that autograd cannot see it (through ``.data``, on every device)
computes silently with the overwritten values; and the writers stay right when the foreach kernels themselves
leave the counters alone, as CUDA's fused ``_foreach_lerp_`` does (simulated on the CPU by kernels that write
through ``.data``, shown for real on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from copy_correct import EMA, GradientAverager, ReplayBuffer, hard_update, make_target, soft_update
from copy_correct.core.foreach_writes import foreach_copy_, foreach_lerp_
from copy_correct.lightning._rank_zero_buffers import RankZeroBuffers
from copy_correct.probes import CopyAudit
from tests.conftest import CUDA

STALE = "modified by an inplace operation"

# A writer: given a device, it returns (the tensor it will overwrite, the write itself).
Writer = Callable[[torch.device], tuple[torch.Tensor, Callable[[], None]]]


def net(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).to(device)


def _moved(model: nn.Module) -> nn.Module:
    """Another network of the same shape with other values, so every write changes something."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model[1].running_mean.add_(1.0)
    return model


def hard(device: torch.device) -> tuple[torch.Tensor, Callable[[], None]]:
    online = net(device)
    target = make_target(online)
    _moved(online)
    return target[0].weight, lambda: hard_update(target, online)


def soft(device: torch.device) -> tuple[torch.Tensor, Callable[[], None]]:
    online = net(device)
    target = make_target(online)
    _moved(online)
    return target[0].weight, lambda: soft_update(target, online, 0.5)


def ema_update(device: torch.device) -> tuple[torch.Tensor, Callable[[], None]]:
    model = net(device)
    ema = EMA(model, decay=0.5)
    _moved(model)
    return ema.shadow["0.weight"], lambda: ema.update(model)


def ema_copy_to(device: torch.device) -> tuple[torch.Tensor, Callable[[], None]]:
    model = net(device)
    ema = EMA(model, decay=0.5)
    _moved(model)
    return model[0].weight, lambda: ema.copy_to(model)


def ema_copy_to_another_model(device: torch.device) -> tuple[torch.Tensor, Callable[[], None]]:
    model = net(device)
    ema = EMA(model, decay=0.5)
    export = _moved(net(device))
    return export[0].weight, lambda: ema.copy_to(export)


def swap_in(device: torch.device) -> tuple[torch.Tensor, Callable[[], None]]:
    model = net(device)
    ema = EMA(model, decay=0.5)
    _moved(model)
    block = ema.average_weights(model)
    return model[0].weight, lambda: block.__enter__()


def swap_back(device: torch.device) -> tuple[torch.Tensor, Callable[[], None]]:
    model = net(device)
    ema = EMA(model, decay=0.5)
    _moved(model)
    block = ema.average_weights(model)
    block.__enter__()  # the saved tensor is the average, in the model inside the block
    return model[0].weight, lambda: block.__exit__(None, None, None)


def replay_add(device: torch.device) -> tuple[torch.Tensor, Callable[[], None]]:
    buffer = ReplayBuffer(4, (3,), device=device)
    obs = torch.ones(3, device=device)
    return buffer.obs, lambda: buffer.add(obs, 1, 1.0, obs, False)


def rank_zero_buffers(device: torch.device) -> tuple[torch.Tensor, Callable[[], None]]:
    model = net(device)
    buffers = RankZeroBuffers()  # what EMAWeights and a sharded PostHocEMASnapshots run before each update
    trainer = SimpleNamespace(world_size=2)  # this process plays rank 1 of two; only the size is read

    def write() -> None:
        with mock.patch.object(dist, "broadcast", _rank_zero_sends_other_statistics):
            buffers.sync(trainer, model)  # type: ignore[arg-type]

    return model[1].running_mean, write


def _rank_zero_sends_other_statistics(tensor: torch.Tensor, src: int) -> None:
    tensor.add_(1.0)


def gradient_average(device: torch.device) -> tuple[torch.Tensor, Callable[[], None]]:
    layer = nn.Linear(4, 2).to(device)
    layer.weight.grad = torch.ones_like(layer.weight)
    averager = GradientAverager(layer.parameters())
    averager.world_size = lambda: 2  # type: ignore[method-assign]  # the one-process group below, averaged as two
    return layer.weight.grad, averager.average


WRITERS: dict[str, Writer] = {
    "hard_update": hard,
    "soft_update": soft,
    "EMA.update": ema_update,
    "EMA.copy_to": ema_copy_to,
    "EMA.copy_to another model": ema_copy_to_another_model,
    "EMA.average_weights, entering": swap_in,
    "EMA.average_weights, leaving": swap_back,
    "ReplayBuffer.add": replay_add,
    "rank 0's buffers (EMAWeights, PostHocEMASnapshots)": rank_zero_buffers,
    "GradientAverager.average": gradient_average,
}


@pytest.fixture(autouse=True)
def one_process_group() -> Iterator[None]:
    """A gloo group of one process, in memory (no port), for the two writers that run a collective."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", WRITERS)
def test_a_tensor_saved_for_backward_and_then_written_makes_backward_raise(name: str, device: torch.device) -> None:
    t, write = WRITERS[name](device)
    x = torch.ones_like(t, dtype=torch.float32, requires_grad=True)
    y = (x * t).sum()  # saves t: dy/dx = t
    version = t._version
    write()
    assert t._version == version + 1, f"{name} raised the version by {t._version - version}"
    with pytest.raises(RuntimeError, match=STALE):
        y.backward()
    assert x.grad is None


@pytest.mark.parametrize("name", WRITERS)
def test_control_the_same_write_hidden_from_autograd_computes_with_the_new_values(
    name: str, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each writer's tensor, overwritten through ``.data`` instead: backward runs and uses the new values."""
    t, write = WRITERS[name](device)
    before = t.detach().clone()
    write()  # the real write, to learn the values it leaves ...
    after = t.detach().clone()
    with torch.no_grad():
        t.copy_(before)
    x = torch.ones_like(t, dtype=torch.float32, requires_grad=True)
    y = (x * t).sum()
    t.data.copy_(after)  # ... then the same values written where autograd cannot see
    y.backward()
    assert not torch.equal(before, after), f"{name} changed nothing: the control would show nothing"
    assert torch.equal(x.grad, after.float())  # the gradient silently used the overwritten values


def _unbumped_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.data.copy_(s)


def _unbumped_lerp_(dst: list[torch.Tensor], src: list[torch.Tensor], weight: float) -> None:
    for d, s in zip(dst, src, strict=True):
        d.data.lerp_(s, weight)


@contextmanager
def fused_kernels_that_forget_the_version(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``torch._foreach_copy_`` / ``_foreach_lerp_`` that write in place, allocate nothing and leave every version
    counter as it was: what CUDA's fused ``_foreach_lerp_`` does (measured on an H200, torch 2.11)."""
    with monkeypatch.context() as patch:
        patch.setattr(torch, "_foreach_copy_", _unbumped_copy_)
        patch.setattr(torch, "_foreach_lerp_", _unbumped_lerp_)
        yield


@pytest.mark.parametrize("name", WRITERS)
def test_writers_raise_the_version_when_the_kernel_does_not(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    t, write = WRITERS[name](torch.device("cpu"))
    x = torch.ones_like(t, dtype=torch.float32, requires_grad=True)
    y = (x * t).sum()
    versions = t._version
    with fused_kernels_that_forget_the_version(monkeypatch), CopyAudit() as audit:
        write()
    assert t._version == versions + 1
    with pytest.raises(RuntimeError, match=STALE):
        y.backward()
    if name in ("hard_update", "soft_update", "EMA.update", "EMA.copy_to"):
        assert audit.bytes_allocated == 0, audit.summary()  # raising the counters allocates nothing


def test_control_with_those_kernels_a_bare_foreach_write_goes_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    t, source = torch.zeros(4), torch.ones(4)
    x = torch.ones(4, requires_grad=True)
    y = (x * t).sum()
    with fused_kernels_that_forget_the_version(monkeypatch), torch.no_grad():
        torch._foreach_lerp_([t], [source], 0.5)
    y.backward()
    assert torch.equal(x.grad, torch.full((4,), 0.5))  # computed with the overwritten t, no error


@pytest.mark.gpu
@CUDA
def test_control_on_cuda_the_fused_foreach_lerp_leaves_versions_alone() -> None:
    """The bug on the device where it lives: CUDA's fused ``_foreach_lerp_`` (torch 2.11 on an H200)."""
    targets = [torch.zeros(16, device="cuda") for _ in range(3)]
    sources = [torch.ones(16, device="cuda") for _ in range(3)]
    x = torch.ones(16, device="cuda", requires_grad=True)
    y = (x * targets[0]).sum()
    versions = [t._version for t in targets]
    with torch.no_grad():
        torch._foreach_lerp_(targets, sources, 0.5)
    if [t._version for t in targets] != versions:
        pytest.skip(f"torch {torch.__version__}'s fused _foreach_lerp_ raises the versions itself")
    y.backward()  # no error: autograd never learnt that targets[0] changed
    assert torch.equal(x.grad, torch.full((16,), 0.5, device="cuda"))


def test_inference_tensors_have_no_version_to_raise_and_are_written_all_the_same() -> None:
    with torch.inference_mode():
        dst, src = [torch.zeros(3), torch.zeros(2)], [torch.ones(3), torch.ones(2)]
        foreach_copy_(dst, src)
        foreach_lerp_(dst, [torch.zeros(3), torch.zeros(2)], 0.5)
    assert torch.equal(dst[0], torch.full((3,), 0.5)) and torch.equal(dst[1], torch.full((2,), 0.5))
