"""``soft_update`` and ``hard_update`` inside a ``torch.compile(..., fullgraph=True)`` function: traced into the graph
(no graph break), compiled once for every call with the same ``tau``, the target equal to eager updates bit for bit
when the graph runs torch's own kernels (torch 2.13 on; within float32 rounding on torch 2.10), and to float32
rounding under inductor, which generates its own ``lerp`` (one update's difference; and it allocates nothing per call
there). The tensors are looked up by name at every call: a head replaced on the online network is followed without a
new compile. Controls: a ``tau`` that changes at every call compiles again; the eager update of a twin target is what
the compiled one is compared with."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from copy_correct import hard_update, make_target, soft_update
from tests.compiling import Counting, close, inductor_builds, same_or_close


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test starts with no compile cached: its step functions share code objects with the other tests'."""
    torch._dynamo.reset()


def networks() -> tuple[nn.Module, nn.Module, nn.Module]:
    """An online network with a BatchNorm (floating and integer buffers) and two targets of it."""
    torch.manual_seed(0)
    online = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    return online, make_target(online), make_target(online)


def moved(online: nn.Module, step: int) -> None:
    """The online network after an optimizer step: new weights and statistics, one more batch counted."""
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in online.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
        online[1].running_mean.add_(0.3)
        online[1].num_batches_tracked.add_(1)


@pytest.mark.parametrize("update", ["soft", "hard"])
def test_the_update_compiles_once_into_the_graph_and_equals_the_eager_one_bit_for_bit(update: str) -> None:
    online, target, twin = networks()
    call = (lambda t: soft_update(t, online, 0.005)) if update == "soft" else (lambda t: hard_update(t, online))
    backend = Counting()
    compiled = torch.compile(lambda: call(target), fullgraph=True, backend=backend)  # a graph break would raise
    for step in range(20):
        moved(online, step)
        compiled()
        call(twin)
        assert same_or_close(target.state_dict(), twin.state_dict()), step
    assert backend.compiles == 1
    assert target[1].num_batches_tracked.item() == 20  # the integer buffer copied


@pytest.mark.parametrize("update", ["soft", "hard"])
def test_a_head_replaced_on_the_online_network_is_followed_without_a_new_compile(update: str) -> None:
    online, target, _ = networks()
    tau = 0.5 if update == "soft" else 1.0
    backend = Counting()
    compiled = torch.compile(lambda: soft_update(target, online, tau), fullgraph=True, backend=backend)
    compiled()
    before = [p.detach().clone() for p in target[3].parameters()]
    online[3] = nn.Linear(16, 4)  # new Parameter objects under the same names
    compiled()
    for written, start, new in zip(target[3].parameters(), before, online[3].parameters(), strict=True):
        assert torch.equal(written, start.lerp(new.detach(), tau) if tau < 1.0 else new)
    assert backend.compiles == 1


def test_networks_that_differ_are_refused_as_the_update_is_traced() -> None:
    online, target, _ = networks()
    target[3] = nn.Linear(16, 5)
    compiled = torch.compile(lambda: hard_update(target, online), fullgraph=True, backend=Counting())
    with pytest.raises(Exception, match=r"hard_update inside torch\.compile takes two unsharded networks of the same"):
        compiled()


def test_the_control_a_tau_that_changes_at_every_call_compiles_again() -> None:
    online, target, _ = networks()
    backend = Counting()
    compiled = torch.compile(lambda tau: soft_update(target, online, tau), fullgraph=True, backend=backend)
    for step in range(4):
        compiled(0.005 * (step + 1))  # a Python float is a constant of the graph
    assert backend.compiles > 1


def test_skip_nonfinite_inside_a_compiled_function_is_refused_naming_why() -> None:
    online, target, _ = networks()
    compiled = torch.compile(lambda: soft_update(target, online, 0.005, skip_nonfinite=True), fullgraph=True,
                             backend=Counting())  # fmt: skip
    with pytest.raises(Exception, match=r"inside torch\.compile: the skip is decided on the host"):
        compiled()


@pytest.mark.long  # inductor compiles C++ for the CPU: seconds
def test_under_inductor_it_allocates_nothing_per_call_and_stays_within_float32_rounding_of_eager() -> None:
    if not inductor_builds():
        pytest.skip("inductor cannot build a CPU kernel here (a C++ compiler and Python's headers)")
    online, target, twin = networks()
    compiled = torch.compile(lambda: soft_update(target, online, 0.005), fullgraph=True)
    compiled()
    soft_update(twin, online, 0.005)
    for step in range(5):
        moved(online, step)
        with torch.no_grad():  # one update compared at a time: the twin starts from the compiled target's values
            for mine, theirs in zip(twin.state_dict().values(), target.state_dict().values(), strict=True):
                mine.copy_(theirs)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as probe:
            compiled()
        soft_update(twin, online, 0.005)
        assert [e.name for e in probe.events() if e.cpu_memory_usage > 0] == []
        close(target.state_dict(), twin.state_dict())  # float32 rounding of the operands
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as control:
        torch.lerp(twin[0].weight, online[0].weight, 0.5)
    assert [e for e in control.events() if e.cpu_memory_usage > 0]  # the control: an op that allocates is seen
