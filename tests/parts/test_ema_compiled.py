"""``EMA(model, traceable=True)``: ``ema.update(model)`` inside a ``torch.compile(..., fullgraph=True)`` training step
(``copy_correct.averages.device_clock``). One compile for every step, warm-up included (the counters and the decay are
tensors), the average equal to the host-counted EMA's bit for bit when the graph runs torch's kernels (torch 2.13 on;
within float32 rounding on torch 2.10), and within
float32 rounding of it under inductor, which generates its own ``lerp`` and allocates nothing per step. Controls: an
update that reads a Python counter and decay compiles again at every step; an EMA built without ``traceable`` is
refused as the step is traced, naming the argument."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from copy_correct import EMA
from tests.compiling import Counting, close, inductor_builds, same_or_close

SETTINGS = {
    "power warm-up": {},
    "start_step and update_every": {"start_step": 5, "update_every": 3},
    "half-life": {"warmup": "half_life", "half_life": 0.1},
    "constant decay": {"warmup": False, "decay": 0.9},
}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test starts with no compile cached: its step functions share code objects with the other tests'."""
    torch._dynamo.reset()


def network(device: str | torch.device = "cpu") -> nn.Module:
    """A small network with a BatchNorm: floating buffers averaged, an integer one copied."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def training(model: nn.Module, ema: EMA) -> Callable[[], None]:
    """The step after ``backward``: plain SGD on the gradients, then the EMA, as one function."""

    def step() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)
        ema.update(model)

    return step


def backward(model: nn.Module, step: int) -> None:
    torch.manual_seed(100 + step)
    model.zero_grad(set_to_none=False)
    model(torch.randn(32, 8).to(next(model.parameters()).device)).square().mean().backward()


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_the_update_compiles_once_into_the_step_and_is_the_host_counted_ema_bit_for_bit(
    settings: dict, device: torch.device
) -> None:
    """On CUDA within float32 rounding: the host's ``foreach_lerp_`` there is a fused kernel of its own, and a CUDA
    ``pow`` may differ from the host's in a double's last bit (``DecaySchedule.write_weight``)."""
    model = network(device)
    ema, twin = EMA(model, traceable=True, **settings), EMA(model, **settings)
    backend = Counting()
    compiled = torch.compile(training(model, ema), fullgraph=True, backend=backend)  # a graph break raises
    for step in range(40):  # past the warm-up's copy, start_step and several update_every periods
        backward(model, step)
        compiled()
        twin.update(model)
        if device.type == "cpu":
            assert same_or_close(ema.shadow, twin.shadow), step
        else:
            close(ema.shadow, twin.shadow)
            twin.load_state_dict(ema.state_dict())  # one update compared at a time
    assert backend.compiles == 1
    assert (ema.step, ema.num_updates) == (twin.step, twin.num_updates) == (40, twin.num_updates)
    if "update_every" not in settings:
        assert ema.shadow["1.num_batches_tracked"].item() == 40  # the integer buffer copied at every update


def test_the_control_an_update_of_a_python_counter_and_decay_compiles_again_at_every_step() -> None:
    """What every peer's update does: the decay a Python float of a Python counter, a constant of the graph."""
    model, backend = network(), Counting()
    shadows = [p.detach().clone() for p in model.parameters()]
    counter = [0]

    def update() -> None:
        counter[0] += 1
        with torch.no_grad():
            torch._foreach_lerp_(shadows, list(model.parameters()), (1 + counter[0]) ** (-2 / 3))

    compiled = torch.compile(update, fullgraph=True, backend=backend)
    for _ in range(6):
        compiled()
    assert backend.compiles > 1


def test_without_fullgraph_an_ema_built_without_traceable_still_updates_eagerly_at_a_graph_break() -> None:
    """What a compiled loop with the default ``EMA`` did before ``traceable`` existed still works: Dynamo stops its
    graph at the update, which then runs eagerly with its checks, the average the eager one's bit for bit (torch 2.13
    on; torch 2.10's Dynamo traces part of it, within float32 rounding)."""
    model = network()
    ema, twin = EMA(model), EMA(model)
    compiled = torch.compile(training(model, ema), backend=Counting())
    for step in range(5):
        backward(model, step)
        compiled()
        twin.update(model)
    assert ema.step == 5 and same_or_close(ema.shadow, twin.shadow)


def test_an_ema_built_without_traceable_is_refused_inside_a_compiled_step_naming_it() -> None:
    model = network()
    backward(model, 0)
    compiled = torch.compile(training(model, EMA(model)), fullgraph=True, backend=Counting())
    with pytest.raises(Exception, match=r"EMA.update inside torch.compile needs EMA\(model, ..., traceable=True\)"):
        compiled()


def test_eager_updates_of_a_traceable_ema_are_the_host_counted_ones_and_allocate_no_tensor() -> None:
    """Eager, the decay's arithmetic on the device wraps its Python constants in 8-byte CPU scalars, as any
    ``torch.add(t, 1.0, out=...)`` does: nothing larger is allocated. The control: one ``lerp`` allocates a tensor."""
    model = network()
    ema, twin = EMA(model, traceable=True), EMA(model)
    for step in range(5):
        backward(model, step)
        training(model, ema)()
        twin.update(model)
    assert all(torch.equal(ema.shadow[name], t) for name, t in twin.shadow.items())
    versions = [t._version for t in ema.shadow.values()]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as probe:
        ema.update(model)
    assert max(e.cpu_memory_usage for e in probe.events()) == 8
    assert [t._version for t in ema.shadow.values()] == [v + 1 for v in versions]  # autograd sees every write
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as control:
        torch.lerp(ema.shadow["3.bias"], model[3].bias, 0.5)
    assert max(e.cpu_memory_usage for e in control.events()) == 16


def test_counters_read_save_and_load_across_traceable_and_host_counted_emas() -> None:
    model = network()
    ema = EMA(model, traceable=True, start_step=2)
    for step in range(7):
        backward(model, step)
        training(model, ema)()
    assert (ema.step, ema.num_updates) == (7, 5)
    host = EMA(model, start_step=2)
    host.load_state_dict(ema.state_dict())
    assert (host.step, host.num_updates) == (7, 5)
    again = EMA(model, traceable=True, start_step=2)
    again.load_state_dict(host.state_dict())
    assert (again.step, again.num_updates) == (7, 5)
    copied = pickle.loads(pickle.dumps(ema))
    assert (copied.step, copied.num_updates) == (7, 5) and copied._clock.calls is not ema._clock.calls
    assert "step=7, num_updates=5" in repr(ema)


def test_a_tensor_reshaped_under_a_compiled_step_is_refused_by_name_as_it_is_traced_again() -> None:
    model = network()
    ema = EMA(model, traceable=True)
    compiled = torch.compile(lambda: ema.update(model), fullgraph=True, backend=Counting())
    compiled()
    model[3] = nn.Linear(16, 5)
    with pytest.raises(Exception, match=r"EMA: the model's '3.weight' is missing, reshaped or moved"):
        compiled()


def test_a_head_replaced_by_one_alike_is_followed_as_the_compiled_forward_follows_it() -> None:
    """Dynamo does not guard a module's attributes (``guard_nn_modules=False``): the values are looked up by name at
    every call, so the new head's are averaged, not the old one's; the next eager use refuses the changed model."""
    model = network()
    ema = EMA(model, traceable=True, warmup=False, decay=0.0)  # decay 0: the average is the last values
    compiled = torch.compile(lambda: ema.update(model), fullgraph=True, backend=Counting())
    compiled()
    model[3] = nn.Linear(16, 4)
    compiled()
    assert torch.equal(ema.shadow["3.weight"], model[3].weight)
    with pytest.raises(RuntimeError, match=r"3\.weight"):
        ema.update(model)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [({"skip_nonfinite": True}, "traceable=True and skip_nonfinite=True do not go together"),
     ({"traceable": "yes"}, "traceable must be")],
)  # fmt: skip
def test_traceable_refuses_what_it_cannot_do_in_one_line(arguments: dict, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        EMA(network(), **({"traceable": True} | arguments))


def test_timms_step_argument_is_refused_with_traceable() -> None:
    model = network()
    with pytest.raises(ValueError, match="traceable=True would read the device's count: drop step="):
        EMA(model, traceable=True).update(model, step=1)


@pytest.mark.long  # inductor compiles C++ for the CPU: seconds
@pytest.mark.parametrize("settings", [{}, {"start_step": 5, "update_every": 3}], ids=["every step", "gated"])
def test_under_inductor_the_step_allocates_nothing_and_is_within_float32_rounding_of_eager(settings: dict) -> None:
    if not inductor_builds():
        pytest.skip("inductor cannot build a CPU kernel here (a C++ compiler and Python's headers)")
    model = network()
    ema, twin = EMA(model, traceable=True, **settings), EMA(model, **settings)
    compiled = torch.compile(training(model, ema), fullgraph=True)
    for step in range(12):
        backward(model, step)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as probe:
            compiled()
        twin.update(model)
        if step > 0:  # the first call compiles
            assert [e.name for e in probe.events() if e.cpu_memory_usage > 0] == []
        close(ema.shadow, twin.shadow)
        twin.load_state_dict(ema.state_dict())  # one update compared at a time: the twin goes on from the compiled
    assert (ema.step, ema.num_updates) == (twin.step, twin.num_updates)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as control:
        torch.lerp(twin.shadow["0.weight"], model[0].weight, 0.5)
    assert [e for e in control.events() if e.cpu_memory_usage > 0]  # the control: an op that allocates is seen
