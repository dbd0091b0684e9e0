"""shares_storage / storage_key: storage-level aliasing, with data_ptr() as the control that gets it wrong."""

import numpy as np
import pytest
import torch

from copy_correct.probes import shares_storage, storage_key
from tests.conftest import DEVICES


@pytest.mark.parametrize("device", DEVICES)
def test_slice_at_offset_shares_storage_though_data_ptr_differs(device: str) -> None:
    x = torch.arange(12.0, device=device)
    tail = x[4:]
    assert tail.data_ptr() != x.data_ptr()  # control: the data_ptr() test says "not shared"
    assert shares_storage(x, tail)
    tail.zero_()
    assert x[4:].eq(0).all()  # ...and the write proves they are shared


@pytest.mark.parametrize("device", DEVICES)
def test_clone_does_not_share(device: str) -> None:
    x = torch.arange(12.0, device=device)
    assert not shares_storage(x, x.clone())
    assert shares_storage(x, x.view(3, 4).t())
    assert shares_storage(x, x.detach())
    assert storage_key(x) == storage_key(x.detach()) != storage_key(x.clone())


def test_meta_tensors_report_data_ptr_zero_but_do_not_share() -> None:
    a, b = torch.empty(4, device="meta"), torch.empty(4, device="meta")
    assert a.data_ptr() == b.data_ptr() == 0  # control: data_ptr() equality would say "shared"
    assert not shares_storage(a, b)
    assert shares_storage(a, a[1:])


def test_two_wrappers_of_one_numpy_array_share() -> None:
    array = np.zeros(8, dtype=np.float32)
    a, b = torch.from_numpy(array), torch.from_numpy(array[2:])
    assert storage_key(a) != storage_key(b)
    assert shares_storage(a, b)
    assert not shares_storage(a, torch.from_numpy(np.zeros(8, dtype=np.float32)))


def test_different_devices_never_share() -> None:
    assert not shares_storage(torch.zeros(2), torch.zeros(2, device="meta"))


def test_sparse_tensor_is_a_clear_error() -> None:
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match="no single storage"):
        storage_key(sparse)
