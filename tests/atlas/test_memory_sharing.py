"""Atlas rows on memory a tensor shares with another owner: a NumPy array, pinned and shared host memory, and a host
tensor that a device-to-host copy is still writing. One test per row of ``docs/copy-atlas.md``, on the 4x6 float32
tensor of ``test_copy_atlas.py`` (N = 96 bytes).

Storage identity by address: ``untyped_storage().data_ptr()`` for a tensor, ``ctypes.data`` for an array (NumPy's
address of its first element; every array here starts at offset 0). Each test carries its control: the operation
that copies where the row's shares (or the reverse), measured the same way.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from copy_correct.probes import shares_storage, storage_key
from tests.atlas.test_copy_atlas import COLS, ROWS, audited, make, nbytes, write_changes_source
from tests.conftest import DEVICES

# Cycles of `torch.cuda._sleep` that keep the stream busy for tens of milliseconds (about 30 ms at 1.7 GHz): far
# longer than the host takes to queue a copy and read its destination.
BUSY_CYCLES = 50_000_000


def ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage: what decides sharing here."""
    return t.untyped_storage().data_ptr()


def host_array() -> np.ndarray:
    """A 4x6 float32 array holding 1..24, owning its memory."""
    return np.arange(1, ROWS * COLS + 1, dtype=np.float32).reshape(ROWS, COLS)


# --------------------------------------------------------------------------------------------------
# rows: NumPy arrays and tensors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_from_numpy_numpy_and_as_tensor_share_memory(device):
    arr = host_array()
    # torch.from_numpy: the array's own memory, on the host whatever the device asked for later
    t, audit = audited(lambda: torch.from_numpy(arr))
    assert audit.ops == [], audit.summary()
    assert ptr(t) == arr.ctypes.data
    assert t.is_leaf and not t.requires_grad and t.grad_fn is None
    arr[0, 0] = -1.0  # a write through the array is seen by the tensor ...
    assert t[0, 0].item() == -1.0
    t[0, 1] = -2.0  # ... and one through the tensor by the array
    assert arr[0, 1] == -2.0
    # the array's strides, in elements: a strided slice of it is a strided view; a negative stride is refused
    gappy = torch.from_numpy(arr[:, ::2])
    assert gappy.stride() == (COLS, 2) and ptr(gappy) == arr.ctypes.data
    with pytest.raises(ValueError, match="negative"):
        torch.from_numpy(arr[:, ::-1])
    # .numpy() of a host tensor: the tensor's memory, no copy
    back, audit_back = audited(lambda: t.numpy())
    assert audit_back.ops == [] and back.ctypes.data == ptr(t)

    # torch.as_tensor: the array's memory where dtype and device allow it, a copy where they do not
    on_device, audit_dev = audited(lambda: torch.as_tensor(arr, device=device))
    arr[0, 2] = -3.0
    if device == "cpu":
        assert audit_dev.ops == [] and ptr(on_device) == arr.ctypes.data
        assert on_device[0, 2].item() == -3.0
    else:
        assert audit_dev.count("_to_copy", "alloc") == 1 and audit_dev.bytes_allocated == nbytes(t), audit_dev.summary()
        assert on_device[0, 2].item() == 3.0  # the copy kept the value it was made with
    # control: a conversion copies on every device, and the array's later writes are not seen
    wide, audit_wide = audited(lambda: torch.as_tensor(arr, dtype=torch.float64, device=device))
    assert audit_wide.count(kind="alloc") == 1 and audit_wide.bytes_allocated == 2 * nbytes(t), audit_wide.summary()
    arr[0, 3] = -4.0
    assert wide[0, 3].item() == 4.0
    # torch.tensor(arr) always copies, even on the host with the array's dtype
    copied, audit_copied = audited(lambda: torch.tensor(arr, device=device))
    assert audit_copied.count("_to_copy", "alloc") == 1 and audit_copied.bytes_allocated == nbytes(t)
    assert ptr(copied) != arr.ctypes.data

    # .numpy() refuses a tensor off the host, and one that requires grad; force=True is detach().cpu().numpy():
    # still the tensor's own memory on the host, a copy only from a device
    if device == "cpu":
        with pytest.raises(RuntimeError, match="Can't call numpy\\(\\) on Tensor that requires grad"):
            make(device, requires_grad=True).numpy()
    else:
        with pytest.raises(TypeError, match="can't convert cuda"):
            make(device).numpy()
    x = make(device, requires_grad=True)
    forced = x.numpy(force=True)
    if device == "cpu":
        assert forced.ctypes.data == ptr(x)
        forced[0, 0] = 100.0  # a write through the "forced" array changes the parameter, outside autograd
        assert x[0, 0].item() == 100.0 and x._version == 0
    else:
        assert forced[0, 0] == 1.0
        forced[0, 0] = 100.0
        assert x[0, 0].item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_torch_tensor_of_a_tensor_copies_and_warns(device):
    x = make(device, requires_grad=True)
    with pytest.warns(UserWarning, match=r"To copy construct from a tensor, it is recommended to use sourceTensor"):
        c, audit = audited(lambda: torch.tensor(x))
    assert audit.count("_to_copy", "alloc") == 1 and audit.bytes_allocated == nbytes(x), audit.summary()
    assert ptr(c) != ptr(x) and not shares_storage(c, x)
    assert torch.equal(c, x.detach()) and c.stride() == x.stride()
    assert c.is_leaf and not c.requires_grad and c.grad_fn is None  # the graph is dropped, as by detach()
    with pytest.warns(UserWarning, match="To copy construct from a tensor"):
        assert torch.tensor(x.t()).stride() == (1, COLS)  # a dense layout is kept, as by to(copy=True)
    assert not write_changes_source(x, c)
    # the spelling the warning asks for: the same copy, without the warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet, audit_quiet = audited(lambda: x.detach().clone())
    assert audit_quiet.bytes_allocated == nbytes(x) and torch.equal(quiet, c)
    # control: torch.as_tensor(x) is x itself, no copy, and a write through it is a write to x
    same, audit_same = audited(lambda: torch.as_tensor(x))
    assert same is x and audit_same.ops == []
    assert write_changes_source(x, same)


# --------------------------------------------------------------------------------------------------
# rows: pinned and shared host memory
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_pin_memory(device):
    x = make("cpu")  # only host memory is pinned; `device` is where the pinned copy is bound for
    if not torch.cuda.is_available():
        # no accelerator to pin for: refused (the message is the CPU build's, or the CUDA build's without a driver)
        refused = r"Cannot access accelerator device when none is available|Found no NVIDIA driver"
        with pytest.raises(RuntimeError, match=refused):
            x.pin_memory()
        assert not x.is_pinned()
        return
    pinned, audit = audited(lambda: x.pin_memory())
    assert pinned.is_pinned() and not x.is_pinned()
    assert audit.count(kind="alloc") == 1 and audit.bytes_allocated == nbytes(x), audit.summary()
    assert ptr(pinned) != ptr(x) and not shares_storage(pinned, x)  # a copy, in new storage
    assert torch.equal(pinned, x) and pinned.stride() == x.stride()
    assert not write_changes_source(x, pinned)
    # control: pinning what is pinned already is free, the same tensor
    again, audit_again = audited(lambda: pinned.pin_memory())
    assert again is pinned and audit_again.ops == []
    if device == "cuda":
        with pytest.raises(RuntimeError, match=r"(?i)only dense CPU tensors can be pinned"):
            x.to(device).pin_memory()


@pytest.mark.parametrize("device", DEVICES)
def test_share_memory(device):
    x = make(device)
    rows, t = x[1:3], x.t()
    key, before = storage_key(x), ptr(x)
    out, audit = audited(lambda: x.share_memory_())
    assert out is x and storage_key(x) == key  # in place: the same tensor and the same storage object ...
    assert x.is_shared()
    if device == "cuda":
        # ... and on CUDA nothing else: device memory is shared between processes as it is
        assert ptr(x) == before and audit.ops == []
        return
    # ... whose bytes moved to shared memory: a new address, filled by one copy_ of N, nothing allocated as a tensor
    assert ptr(x) != before
    assert audit.count("copy_", "write") == 1 and audit.bytes_written == nbytes(x) and audit.bytes_allocated == 0
    # views hold the same storage object, so they moved with it and still alias x
    for view in (rows, t):
        assert view.is_shared() and ptr(view) == ptr(x) and storage_key(view) == key
    x[1, 0] = -1.0
    assert rows[0, 0].item() == -1.0 and t[0, 1].item() == -1.0
    # a second call finds it shared and does nothing
    _, audit_again = audited(lambda: x.share_memory_())
    assert audit_again.ops == [] and ptr(x) != before

    # control: memory owned elsewhere stops being shared. A tensor over a NumPy array leaves the array behind ...
    arr = host_array()
    a = torch.from_numpy(arr)
    a.share_memory_()
    assert ptr(a) != arr.ctypes.data
    a.fill_(7.0)
    assert arr[0, 0] == 1.0  # ... which no longer sees the tensor's writes
    # ... and an array taken with .numpy() before the move points at the memory the tensor gave up (never read it)
    b = make("cpu")
    held = b.numpy()
    b.share_memory_()
    assert held.ctypes.data != ptr(b)


def test_resizing_a_tensor_in_shared_memory_kills_the_process(tmp_path):
    """torch's docs: "Tensors in shared memory cannot be resized". Growing one raises nothing: the process dies."""
    code = (
        "import resource, torch\n"
        "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"  # no core file
        "x = torch.arange(24.0)\n"
        "{share}"
        "try:\n"
        "    x.resize_(100)\n"
        "    print('resized', x.shape[0])\n"
        "except RuntimeError as err:\n"
        "    print('raised', err)\n"
    )

    def start(share: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", code.format(share=share)], cwd=tmp_path, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip

    shared, plain = start("x.share_memory_()\n"), start("")  # side by side: each spends its time importing torch
    out, err = shared.communicate(timeout=120)
    assert shared.returncode == -signal.SIGSEGV, (shared.returncode, out, err[-2000:])
    assert out == ""  # neither resized nor raised
    # control: the same resize of memory that is not shared grows the tensor
    out, err = plain.communicate(timeout=120)
    assert plain.returncode == 0 and out.strip() == "resized 100", err[-2000:]


# --------------------------------------------------------------------------------------------------
# rows: a device-to-host copy read before it ends
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_non_blocking_copy_to_host_read_before_it_ends(device):
    x = make(device) * -1  # values no host buffer of this test held before
    expected = make("cpu") * -1
    if device == "cpu":
        # on the host there is nothing to wait for: to() returns x itself, and copy_ has finished when it returns
        same, audit = audited(lambda: x.to("cpu", non_blocking=True))
        assert same is x and audit.ops == []
        dst = torch.zeros(ROWS, COLS)
        dst.copy_(x, non_blocking=True)
        assert torch.equal(dst.clone(), expected)
        return
    stream = torch.cuda.current_stream()
    pinned = torch.zeros(ROWS, COLS, pin_memory=True)  # allocated before the stream is made busy
    stream.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)  # the stream is busy: the copy queued next waits for it
    pinned.copy_(x, non_blocking=True)  # returns at once
    early = pinned.clone()  # the host reads before the copy ran
    stream.synchronize()
    assert torch.equal(early, torch.zeros(ROWS, COLS))  # stale: what the buffer held before
    assert torch.equal(pinned, expected)  # after the wait: the copy
    # control: into pageable memory the same call waits for the copy (CUDA's rule for device-to-pageable copies), so
    # an early read is right, and nothing overlapped
    pageable = torch.zeros(ROWS, COLS)
    torch.cuda._sleep(BUSY_CYCLES)
    pageable.copy_(x, non_blocking=True)
    assert torch.equal(pageable.clone(), expected)
    stream.synchronize()
