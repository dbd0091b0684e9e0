"""CUDA-only proofs for DevicePrefetcher: pinned sources, safe handover, no host sync, flat memory, overlap."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from copy_correct import DeviceDataLoader, DevicePrefetcher
from tests.conftest import CUDA
from tests.parts.test_prefetch import ToCopyCalls

pytestmark = [pytest.mark.gpu, CUDA]


def test_sources_are_pinned_before_the_copy() -> None:
    source = [(torch.randn(256, 64), torch.arange(256)) for _ in range(4)]
    with ToCopyCalls() as calls:
        list(DevicePrefetcher(source, "cuda"))
    assert len(calls.calls) == 8
    assert all(call["pinned"] and call["non_blocking"] for call in calls.calls)
    # Control: copying the same pageable tensors directly is what the recorder would flag.
    with ToCopyCalls() as calls:
        source[0][0].to("cuda", non_blocking=True)
    assert not calls.calls[0]["pinned"]


def _sums_with_compute_delayed(source: list[tuple[torch.Tensor]]) -> torch.Tensor:
    sums = []
    for (x,) in DevicePrefetcher(source, "cuda"):
        torch.cuda._sleep(20_000_000)  # the compute stream lags far behind the host and the side stream
        sums.append(x.sum())
        del x  # the host is done with the batch long before the compute stream has read it
    torch.cuda.synchronize()
    return torch.stack(sums)


def test_results_equal_the_synchronous_path_while_compute_is_delayed(monkeypatch: pytest.MonkeyPatch) -> None:
    source = [(torch.randn(1 << 20).pin_memory(),) for _ in range(8)]
    expected = torch.stack([t.to("cuda").sum() for (t,) in source])
    assert torch.equal(_sums_with_compute_delayed(source), expected)
    # Control: without record_stream the allocator hands a batch's memory to a later copy while compute still
    # waits to read it, and the sums come out wrong.
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    assert not torch.equal(_sums_with_compute_delayed(source), expected)


def test_no_host_sync_in_steady_state() -> None:
    data = TensorDataset(torch.randn(64, 256), torch.arange(64))
    loader = DeviceDataLoader(data, batch_size=8, pin_memory=True, device="cuda")
    for _ in loader:  # epoch 1 fills the pinned-host and device caches
        pass
    torch.cuda.set_sync_debug_mode("error")
    try:
        for features, labels in loader:
            (features * 2).sum() + labels.sum()
        # Control: the mode is live; a host sync in the loop would have raised.
        with pytest.raises(RuntimeError, match="synchroniz"):
            features.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def _reserved_per_epoch(loader: DeviceDataLoader, new_stream_each_epoch: bool) -> list[int]:
    reserved = []
    for _ in range(5):
        if new_stream_each_epoch:
            loader.prefetcher._stream = None
        for (features,) in loader:
            features.mul(2).sum()
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    return reserved


def test_reserved_memory_is_flat_from_epoch_2_to_5() -> None:
    data = TensorDataset(torch.randn(64, 1 << 18))  # 8 batches of 8 MiB
    torch.cuda.empty_cache()
    reserved = _reserved_per_epoch(DeviceDataLoader(data, batch_size=8, pin_memory=True, device="cuda"), False)
    assert reserved[1:] == [reserved[1]] * 4, reserved
    # Control: a new side stream every epoch (timm's prefetcher) strands each epoch's cached blocks on a dead
    # stream, and reserved memory grows.
    torch.cuda.empty_cache()
    control = _reserved_per_epoch(DeviceDataLoader(data, batch_size=8, pin_memory=True, device="cuda"), True)
    assert control[4] > control[1], control


def _elapsed_ms(fn: object) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()  # type: ignore[operator]
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def test_prefetching_overlaps_copy_and_compute() -> None:
    source = [(torch.randn(16 << 20).pin_memory(),) for _ in range(12)]  # 64 MiB per batch
    copy_ms = min(_elapsed_ms(lambda: source[0][0].to("cuda", non_blocking=True)) for _ in range(5))
    per_million = min(_elapsed_ms(lambda: torch.cuda._sleep(1_000_000)) for _ in range(5))
    cycles = int(copy_ms / per_million * 1e6)  # compute as long as one batch's copy

    def copy_then_compute() -> None:
        for (batch,) in source:
            batch.to("cuda", non_blocking=True)
            torch.cuda._sleep(cycles)

    prefetcher = DevicePrefetcher(source, "cuda")  # one side stream for every run: its cached blocks are reused

    def prefetched() -> None:
        for _ in prefetcher:
            torch.cuda._sleep(cycles)

    copy_then_compute(), prefetched()  # warm the caches: no cudaMalloc inside the timed runs
    serial = min(_elapsed_ms(copy_then_compute) for _ in range(3))
    overlapped = min(_elapsed_ms(prefetched) for _ in range(3))
    assert overlapped <= 0.65 * serial, (overlapped, serial, copy_ms)


class _Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, target = batch
        return (self.layer(features) - target).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_lightning_fit_copies_each_batch_once() -> None:
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = DeviceDataLoader(data, batch_size=8, pin_memory=True, device=torch.device("cuda", 0))
    with ToCopyCalls() as calls:
        trainer.fit(_Linear(), loader)
    host_to_device = [c for c in calls.calls if c["pinned"] and c.get("device", torch.device("cpu")).type == "cuda"]
    assert len(host_to_device) == 2 * len(loader), len(host_to_device)
