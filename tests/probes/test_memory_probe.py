"""MemoryProbe: one definition of peak and net on every device (the same code gives the same figures on CPU,
CUDA and meta), the ledger's mechanics, and clear errors."""

from collections.abc import Callable

import pytest
import torch

from copy_correct.probes import MemoryProbe
from tests.conftest import CUDA, DEVICES

MB = 1 << 20


def in_place(a: torch.Tensor, b: torch.Tensor, before: list[torch.Tensor]) -> object:
    return a.lerp_(b, 0.5)


def out_of_place_rebinding_a_name_made_before(a: torch.Tensor, b: torch.Tensor, before: list[torch.Tensor]) -> object:
    a = a * 0.5 + b * 0.5  # three new MB alive at once (two temporaries and the sum); the old `a` was there before
    return a


def a_view_of_a_big_storage(a: torch.Tensor, b: torch.Tensor, before: list[torch.Tensor]) -> object:
    return torch.empty(1024, 1024, dtype=torch.uint8, device=a.device)[0]  # 1 KiB visible, 1 MiB alive


def freeing_a_tensor_made_before(a: torch.Tensor, b: torch.Tensor, before: list[torch.Tensor]) -> object:
    before.clear()  # the last reference to 1 MB made before the block
    return None


def a_temporary_inside_a_function(a: torch.Tensor, b: torch.Tensor, before: list[torch.Tensor]) -> object:
    def total(x: torch.Tensor) -> torch.Tensor:
        doubled = x * 2  # 1 MB, gone when the function returns
        return doubled.sum()  # 4 bytes, kept

    return total(a)


def a_backward_pass(a: torch.Tensor, b: torch.Tensor, before: list[torch.Tensor]) -> object:
    w = before[0]  # made before the block, requires grad
    loss = (w * b).sum()  # the product (1 MB) dies after the sum; the loss (4 B) is kept
    loss.backward()  # the seed gradient (4 B) and w.grad (1 MB, kept); on CUDA this runs on autograd's own thread
    return loss


def torch_tensor_from_python_data(a: torch.Tensor, b: torch.Tensor, before: list[torch.Tensor]) -> object:
    return torch.tensor([1.0] * 256, device=a.device)  # built below the dispatcher's Python key, seen all the same


# snippet -> (peak_bytes, net_bytes), the same on every device
SNIPPETS: dict[Callable[..., object], tuple[int, int]] = {
    in_place: (0, 0),
    out_of_place_rebinding_a_name_made_before: (3 * MB, MB),
    a_view_of_a_big_storage: (MB, MB),
    freeing_a_tensor_made_before: (0, 0),
    a_temporary_inside_a_function: (MB + 4, 4),
    a_backward_pass: (MB + 8, MB + 4),
    torch_tensor_from_python_data: (1024, 1024),
}
EVERY_DEVICE = [*DEVICES, pytest.param("meta", id="meta")]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("device", EVERY_DEVICE)
def test_the_same_code_gives_the_same_figures_on_every_device(device: str, snippet: Callable[..., object]) -> None:
    a, b = torch.zeros(MB // 4, device=device), torch.ones(MB // 4, device=device)
    before = [torch.zeros(MB // 4, device=device, requires_grad=True)]
    with MemoryProbe(device) as probe:
        kept = snippet(a, b, before)
    assert (probe.peak_bytes, probe.net_bytes) == SNIPPETS[snippet], probe.report()
    del kept


@pytest.mark.gpu
@CUDA
def test_control_the_cuda_allocator_counts_the_same_code_differently() -> None:
    """What the probe read on CUDA before: the allocator's counters also count frees of older tensors (and round
    to 512 bytes), so rebinding a name nets 0 on CUDA where the ledger nets 1 MB on every device."""
    a, b = torch.zeros(MB // 4, device="cuda"), torch.ones(MB // 4, device="cuda")
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    a = out_of_place_rebinding_a_name_made_before(a, b, [])
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - start == 0 != SNIPPETS[out_of_place_rebinding_a_name_made_before][1]
    del a


def test_figures_are_live_inside_the_block() -> None:
    with MemoryProbe("cpu") as probe:
        x = torch.empty(MB, dtype=torch.uint8)
        assert probe.net_bytes == MB
        del x
        assert probe.net_bytes == 0 and probe.peak_bytes == MB


def test_ledger_ignores_other_devices_and_preexisting_storage() -> None:
    before = torch.empty(MB, dtype=torch.uint8)
    with MemoryProbe("cpu") as probe:
        del before  # freed inside, allocated before: not counted
        torch.empty(16, device="meta")
    assert probe.net_bytes == 0 and probe.peak_bytes == 0


def test_survivors_name_what_is_still_alive() -> None:
    with MemoryProbe("cpu", trace=True) as probe:
        leak = torch.zeros(256).clone()
    (event,) = [e for e in probe.survivors if e.op == "clone"]
    assert event.nbytes == 1024 and "test_memory_probe.py" in (event.where or "")
    assert "1 storage(s) created inside are alive" in probe.report()
    del leak


def test_probe_holds_no_tensor_alive() -> None:
    with MemoryProbe("cpu") as probe:
        x = torch.empty(MB, dtype=torch.uint8)
    storage = x.untyped_storage()
    del x
    assert storage.nbytes() == MB  # our own reference; the probe's are weak
    assert probe.net_bytes == MB  # figures are frozen at exit


def test_bad_use_is_a_clear_error() -> None:
    probe = MemoryProbe("cpu")
    with pytest.raises(RuntimeError, match="never entered"):
        probe.net_bytes  # noqa: B018
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            MemoryProbe("cuda")


def test_nested_probes_each_count_what_was_made_inside_them() -> None:
    with MemoryProbe("cpu") as outer:
        kept = torch.empty(50, dtype=torch.uint8)
        with MemoryProbe("cpu") as inner:
            temporary = torch.empty(10, dtype=torch.uint8)
            del temporary
            kept_inner = torch.empty(5, dtype=torch.uint8)
    assert (inner.peak_bytes, inner.net_bytes) == (10, 5)
    assert (outer.peak_bytes, outer.net_bytes) == (60, 55)
    del kept, kept_inner
