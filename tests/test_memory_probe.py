"""MemoryProbe: peak and net above entry, the CPU ledger and the CUDA allocator agreeing in meaning."""

import pytest
import torch

from components import MemoryProbe
from tests.conftest import DEVICES

MB = 1 << 20


@pytest.mark.parametrize("device", DEVICES)
def test_peak_and_net_of_a_temporary_and_a_kept_tensor(device: str) -> None:
    with MemoryProbe(device) as probe:
        kept = torch.empty(MB, dtype=torch.uint8, device=device)
        temporary = torch.empty(4 * MB, dtype=torch.uint8, device=device)
        del temporary
    assert probe.net_bytes == MB
    assert probe.peak_bytes == 5 * MB
    assert kept.numel() == MB


@pytest.mark.parametrize("device", DEVICES)
def test_a_view_keeps_its_whole_storage_counted(device: str) -> None:
    with MemoryProbe(device) as probe:
        row = torch.empty(1024, 1024, dtype=torch.uint8, device=device)[0]
    assert probe.net_bytes == MB  # 1 KiB visible, 1 MiB alive
    del row


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_work_costs_nothing_and_the_out_of_place_control_does(device: str) -> None:
    a, b = torch.zeros(MB // 4, device=device), torch.ones(MB // 4, device=device)
    with MemoryProbe(device) as in_place:
        a.lerp_(b, 0.5)
    with MemoryProbe(device) as out_of_place:
        a = a * 0.5 + b * 0.5
    assert in_place.peak_bytes == 0 and in_place.net_bytes == 0
    assert out_of_place.peak_bytes >= 2 * MB  # two temporaries alive at once
    assert out_of_place.net_bytes == MB  # the new `a` (the old one is not counted on the ledger)


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


def test_meta_device_uses_the_ledger() -> None:
    with MemoryProbe("meta") as probe:
        x = torch.empty(100, device="meta")
    assert not probe.uses_allocator
    assert probe.net_bytes == 400
    del x


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


class FakeAllocator:
    """Stands in for torch.cuda's counters, so the CUDA path's arithmetic is tested without a GPU."""

    def __init__(self) -> None:
        self.allocated = self.peak = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(
            torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.allocated)
        )


def test_nested_cuda_probes_keep_the_outer_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAllocator()
    fake.install(monkeypatch)
    fake.alloc(100)  # before the probes
    with MemoryProbe("cuda:0") as outer:
        fake.alloc(50)
        fake.free(50)  # outer's peak: +50, then back
        with MemoryProbe("cuda:0") as inner:  # resets the device's peak counter
            fake.alloc(10)
            fake.free(10)
        fake.alloc(5)
    assert (inner.peak_bytes, inner.net_bytes) == (10, 0)
    assert (outer.peak_bytes, outer.net_bytes) == (50, 5)
