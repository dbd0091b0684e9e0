"""DevicePrefetcher, DeviceDataLoader and make_loader: one copy per tensor, none on CPU, the source never written."""

from __future__ import annotations

import warnings
from collections import OrderedDict, namedtuple
from collections.abc import Iterator

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from copy_correct import DeviceDataLoader, DevicePrefetcher, make_loader, map_tensors
from copy_correct.probes import CopyAudit

Pair = namedtuple("Pair", ["left", "right"])


class ToCopyCalls(TorchDispatchMode):
    """Records the keyword arguments and source pinning of every ``aten._to_copy`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten._to_copy:
            self.calls.append({**kwargs, "pinned": args[0].device.type == "cpu" and args[0].is_pinned()})
        return func(*args, **kwargs)


def nested_batches(count: int = 3) -> list:
    """Batches mixing a tuple, a dict, a list, a named tuple and non-tensor leaves: 4 tensors each."""
    batches = []
    for i in range(count):
        images = torch.full((4, 1, 8, 8), i, dtype=torch.uint8)
        batches.append(
            (
                images,
                {"labels": torch.arange(4) + i, "ids": [torch.tensor([i]), "tag"]},
                Pair(torch.ones(2) * i, 7),
            )
        )
    return batches


def as_tensors(batch: object) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return found


def as_cpu(batch: object) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t.cpu()), batch)
    return found


def test_meta_target_copies_each_tensor_once_non_blocking() -> None:
    source = nested_batches()
    with ToCopyCalls() as calls, CopyAudit() as audit:
        delivered = list(DevicePrefetcher(source, "meta"))
    assert len(calls.calls) == 4 * len(source) == audit.count("_to_copy")
    assert all(call["non_blocking"] and call["device"] == torch.device("meta") for call in calls.calls)
    assert all(t.device.type == "meta" for batch in delivered for t in as_tensors(batch))


def test_lightning_transfer_copies_nothing_after_prefetch() -> None:
    """Lightning's ``batch_to_device`` finds the prefetched tensors on the device: the same objects, no copy."""
    (prefetched,) = DevicePrefetcher(nested_batches(1), "meta")
    with CopyAudit() as audit:
        moved = move_data_to_device(prefetched, torch.device("meta"))
    assert audit.count("_to_copy") == 0
    assert all(a is b for a, b in zip(as_tensors(moved), as_tensors(prefetched), strict=True))
    # Control: a batch that was not prefetched is copied there, one `_to_copy` per tensor.
    with CopyAudit() as audit:
        move_data_to_device(nested_batches(1)[0], torch.device("meta"))
    assert audit.count("_to_copy") == 4


def test_cpu_target_makes_no_copy_and_no_pin() -> None:
    source = nested_batches()
    with CopyAudit() as audit:
        delivered = list(DevicePrefetcher(source, "cpu"))
    assert audit.ops == []
    for got, expected in zip(delivered, source, strict=True):
        assert all(a is b for a, b in zip(as_tensors(got), as_tensors(expected), strict=True))
        assert not any(t.is_pinned() for t in as_tensors(got))
    # Control: the same audit sees the copies when the target is another device.
    with CopyAudit() as audit:
        list(DevicePrefetcher(source, "meta"))
    assert audit.count("_to_copy") == 12


def test_nested_structures_keep_their_types_and_leaves() -> None:
    batch = OrderedDict(x=torch.ones(2), rest=[Pair(torch.zeros(1), "name"), (3, None)])
    (got,) = DevicePrefetcher([batch], "meta")
    assert type(got) is OrderedDict and list(got) == ["x", "rest"]
    assert type(got["rest"][0]) is Pair and got["rest"][0].right == "name"
    assert got["rest"][1] == (3, None)
    assert got["x"].device.type == "meta" and got["rest"][0].left.device.type == "meta"


def test_kept_batches_equal_the_source_in_order(device: torch.device) -> None:
    source = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(6)]
    kept = list(DevicePrefetcher(source, device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    for got, expected in zip(kept, source, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(as_cpu(got), expected, strict=True))

    # Control: a loader that reuses one buffer for every batch fails this comparison.
    def reusing() -> Iterator[torch.Tensor]:
        buffer = torch.empty(16, 32)
        for images, _ in source:
            yield buffer.copy_(images)

    reused = list(reusing())
    assert not torch.equal(reused[0], source[0][0])


def test_transform_gets_the_copy_and_never_writes_the_source() -> None:
    source = nested_batches()
    versions = [t._version for batch in source for t in as_tensors(batch)]

    def brighten_in_place(batch: tuple) -> tuple:
        images, rest, pair = batch
        return images.add_(1), rest, pair  # in place: fine on the copy the prefetcher made

    delivered = list(DevicePrefetcher(source, "meta", transform=brighten_in_place))
    assert len(delivered) == 3 and delivered[0][0].device.type == "meta"
    assert [t._version for batch in source for t in as_tensors(batch)] == versions
    assert all(torch.equal(batch[0], torch.full((4, 1, 8, 8), i, dtype=torch.uint8)) for i, batch in enumerate(source))

    # Control: with no copy made (CPU to CPU) the same transform would write into the loader's batch; it is refused.
    with pytest.raises(RuntimeError, match=r"wrote in place into a .* tensor of the loader.s own batch"):
        list(DevicePrefetcher(nested_batches(), "cpu", transform=brighten_in_place))
    # ... and an out-of-place transform is fine there.
    (got,) = DevicePrefetcher(nested_batches(1), "cpu", transform=lambda b: (b[0].float() / 2, *b[1:]))
    assert got[0].dtype == torch.float32


def test_empty_loaders_yield_nothing() -> None:
    assert list(DevicePrefetcher([], "meta")) == [] and len(DevicePrefetcher([], "cpu")) == 0
    empty = TensorDataset(torch.empty(0, 3))
    loader = DeviceDataLoader(empty, batch_size=4, device="cpu")
    assert len(loader) == 0 and list(loader) == [] and list(loader) == []


def test_device_loader_is_a_dataloader_with_the_same_batches_and_length() -> None:
    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    plain = DataLoader(data, batch_size=3)
    prefetching = DeviceDataLoader(data, batch_size=3, device="meta")
    assert isinstance(prefetching, DataLoader) and len(prefetching) == len(plain) == 4
    for epoch in range(2):  # a second epoch iterates again, the same way
        got = list(prefetching)
        assert [b[0].device.type for b in got] == ["meta"] * 4, epoch
        assert [b[0].shape for b in got] == [b[0].shape for b in plain]


def test_make_loader_pins_only_for_an_accelerator() -> None:
    data = TensorDataset(torch.zeros(8, 2))
    assert not make_loader(data, 4, device="cpu").pin_memory
    assert make_loader(data, 4, device="cuda", prefetch=False).pin_memory
    assert make_loader(data, 4, device="cpu", num_workers=2).persistent_workers
    assert isinstance(make_loader(data, 4, device="cpu"), DeviceDataLoader)
    assert type(make_loader(data, 4, device="cpu", prefetch=False)) is DataLoader


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning appears only without an accelerator")
def test_no_pinning_warning_without_an_accelerator() -> None:
    data = TensorDataset(torch.zeros(8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(make_loader(data, 4, device="cpu"))) == 2
        assert len(list(make_loader(data, 4, device="cpu", prefetch=False))) == 2
    # Control: asking a DataLoader to pin on this machine warns.
    with pytest.warns(UserWarning, match="pin_memory"):
        list(DataLoader(data, batch_size=4, pin_memory=True))


def test_bad_arguments_are_refused() -> None:
    data = TensorDataset(torch.zeros(8, 2))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        make_loader(data, 0)
    with pytest.raises(ValueError, match="num_workers must be >= 0"):
        make_loader(data, 4, num_workers=-1)
    with pytest.raises(ValueError, match="needs prefetch=True"):
        make_loader(data, 4, prefetch=False, transform=lambda b: b)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            DevicePrefetcher([], "cuda")
