"""Atlas rows on writes through aliases the code did not mean to make, or copies it thought were aliases: a stride-0
``expand``, advanced indexing against slicing, a loader that hands out the same buffer every step, and a DTensor's
local shard against its gathered whole. One test per row of ``docs/copy-atlas.md``, on the 4x6 float32 tensor of
``test_copy_atlas.py`` (N = 96 bytes).

Storage identity by ``untyped_storage().data_ptr()`` (with ``shares_storage`` where a view starts at an offset). Each
test carries its control: the buggy pattern, measured the same way, shows the problem.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from copy_correct.probes import CollectiveProbe, shares_storage
from tests.atlas.test_copy_atlas import COLS, ROWS, audited, make, nbytes
from tests.conftest import DEVICES, child_env
from tests.ports import free_port

OVERLAP = "unsupported operation: more than one element of the written-to tensor refers to a single memory location"


def ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage: what decides sharing here."""
    return t.untyped_storage().data_ptr()


# --------------------------------------------------------------------------------------------------
# rows: expand against repeat
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_expand_writes_every_alias_or_raises(device):
    row = make(device)[0].clone()  # 1..6, storage of its own
    e, audit = audited(lambda: row.expand(ROWS, COLS))
    assert audit.ops == [] and ptr(e) == ptr(row)
    assert e.stride() == (0, 1) and e.untyped_storage().nbytes() == nbytes(row)  # 24 elements over 6 floats
    # a write to one element is a write to the whole column: all four rows are one row
    e[0, 0] = 100.0
    assert row[0].item() == 100.0 and e[:, 0].tolist() == [100.0] * ROWS
    e[1].add_(10)  # one row of the view does not overlap itself: allowed, and every row changes
    assert e[3].tolist() == row.tolist() and row[1].item() == 12.0
    # ops that write without reading (fill_, zero_, a scalar assigned to a slice) go through and write every alias ...
    e.fill_(0.0)
    assert torch.count_nonzero(row).item() == 0
    e[1:2] = 5.0
    assert row.tolist() == [5.0] * COLS and e[3].tolist() == [5.0] * COLS
    # ... an indexed write warns that it is deprecated, and goes through too
    with pytest.warns(UserWarning, match="Use of index_put_ on expanded tensors is deprecated"):
        e[torch.tensor([2], device=device)] = 9.0
    assert row.tolist() == [9.0] * COLS
    # ... and every op that reads what it writes refuses the overlap, the tensor left as it was
    before = row.clone()
    for write in (
        lambda: e.add_(1), lambda: e.mul_(2), lambda: e.clamp_(max=3.0), lambda: e.copy_(make(device)),
        lambda: e.relu_(), lambda: e.__iadd__(1), lambda: torch.add(make(device), 1, out=e),
    ):  # fmt: skip
        with pytest.raises(RuntimeError, match=OVERLAP):
            write()
    assert torch.equal(row, before)
    # the same refusal with autograd recording, through a non-leaf that requires grad
    leaf = make(device)[0].clone().requires_grad_(True)
    grown = (leaf * 1).expand(ROWS, COLS)
    assert type(grown.grad_fn).__name__ == "ExpandBackward0"
    with pytest.raises(RuntimeError, match=OVERLAP):
        grown.add_(1)

    # control: repeat (or a clone of the expanded view) is new, dense storage; a write changes one element only
    r, audit_r = audited(lambda: row.repeat(ROWS, 1))
    assert audit_r.count("repeat", "alloc") == 1 and audit_r.bytes_allocated == nbytes(make(device)), audit_r.summary()
    assert ptr(r) != ptr(row) and r.stride() == (COLS, 1)
    c, audit_c = audited(lambda: row.expand(ROWS, COLS).clone())
    assert audit_c.count("clone", "alloc") == 1 and audit_c.bytes_allocated == nbytes(make(device))
    assert c.stride() == (COLS, 1)  # clone of a stride-0 view comes out dense
    tracked = make(device)[0].clone().requires_grad_(True)
    assert type(tracked.repeat(ROWS, 1).grad_fn).__name__ == "RepeatBackward0"
    assert type(tracked.expand(ROWS, COLS).clone().grad_fn).__name__ == "CloneBackward0"
    for dense in (r, c):
        dense[0, 0] = -1.0
        dense.add_(1)  # reads and writes: fine on dense memory
        assert dense[1, 0].item() == 10.0 and dense[0, 0].item() == 0.0
    assert row.tolist() == [9.0] * COLS  # neither touched the row


# --------------------------------------------------------------------------------------------------
# rows: advanced indexing against basic slicing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_advanced_indexing_copies_basic_slicing_views(device):
    x = make(device)
    idx = torch.tensor([1, 2], device=device)
    # basic slicing (ints, slices, None, ...): views, nothing allocated
    for view in (lambda: x[1:3], lambda: x[1], lambda: x[None], lambda: x[..., 2:4], lambda: x[1:3, ::2]):
        v, audit = audited(view)
        assert audit.ops == [] and shares_storage(v, x), audit.summary()
    # a 0-dim integer tensor (on the host) indexes like an int: a view as well
    v = x[torch.tensor(1)]
    assert shares_storage(v, x) and torch.equal(v, x[1])
    # advanced indexing (a tensor or list of indices, a mask, even `True`): a copy, op `index`
    for index, rows in ((idx, 2), ([1, 2], 2), (torch.tensor([False, True, True, False], device=device), 2)):
        c, audit = audited(lambda index=index: x[index])
        assert audit.count("index", "alloc") == 1, audit.summary()
        assert ptr(c) != ptr(x) and c.shape == (rows, COLS) and c.is_contiguous()
        assert sum(e.nbytes for e in audit.ops if e.op == "index") == rows * COLS * x.element_size()
    tracked = make(device, requires_grad=True)
    assert type(tracked[idx].grad_fn).__name__ == "IndexBackward0"
    assert type(tracked[1:3].grad_fn).__name__ == "SliceBackward0"
    whole, audit_whole = audited(lambda: x[True])
    assert whole.shape == (1, ROWS, COLS) and ptr(whole) != ptr(x)
    assert audit_whole.count("index", "alloc") == 1 and not shares_storage(whole, x)
    assert sum(e.nbytes for e in audit_whole.ops if e.op == "index") == nbytes(x)

    # writes: x[idx] = v is index_put_ on x itself, in place, nothing allocated
    _, audit_put = audited(lambda: x.__setitem__(idx, 0.0))
    assert audit_put.count("index_put_", "write") == 1 and audit_put.bytes_allocated == 0, audit_put.summary()
    assert x[1:3].abs().sum().item() == 0.0 and x._version == 1
    x = make(device)
    x[idx, 0] = -1.0  # indices and a column together: still one index_put_ on x
    assert x[1:3, 0].tolist() == [-1.0, -1.0]

    def increment() -> None:
        x[idx] += 100  # reads a copy, adds to it, writes it back with index_put_: the sum reaches x

    _, audit_inc = audited(increment)
    assert x[1:3, 1].tolist() == [108.0, 114.0]
    assert audit_inc.count("index", "alloc") == 1 and audit_inc.bytes_allocated == nbytes(x) // 2, audit_inc.summary()
    assert audit_inc.count("add_", "write") == 1 and audit_inc.count("index_put_", "write") == 1

    # control: x[idx][...] = v writes into the copy x[idx] made, which is dropped at once: x never changes
    x = make(device)
    _, audit_lost = audited(lambda: x[idx].__setitem__((slice(None), 0), -1.0))
    assert audit_lost.count("index", "alloc") == 1 and audit_lost.count("fill_", "write") == 1, audit_lost.summary()
    assert torch.equal(x, make(device)) and x._version == 0
    x[idx].add_(100)  # the same for any in-place op on the copy
    assert torch.equal(x, make(device))
    # the chained write through slices works: each step is a view
    x[1:3][:, 0] = -1.0
    assert x[1:3, 0].tolist() == [-1.0, -1.0]
    # and so does a slice first, then indices: the last step is index_put_ on a view of x
    x[:, 1][idx] = -2.0
    assert x[1:3, 1].tolist() == [-2.0, -2.0]


# --------------------------------------------------------------------------------------------------
# rows: a loader that reuses its output buffer (NVIDIA DALI #3239)
# --------------------------------------------------------------------------------------------------


def batches(device: str, steps: int = 4) -> list[torch.Tensor]:
    """What a loader should hand out: step ``k``'s batch is ``k`` everywhere."""
    return [torch.full((2, COLS), float(k), device=device) for k in range(steps)]


def reusing_loader(device: str) -> Iterator[torch.Tensor]:
    """A loader that fills one preallocated buffer and yields it every step, as DALI's iterators did."""
    buffer = torch.empty(2, COLS, device=device)
    for batch in batches(device):
        buffer.copy_(batch)
        yield buffer


def fresh_loader(device: str) -> Iterator[torch.Tensor]:
    """The fix on the loader's side: new storage every step."""
    for batch in batches(device):
        yield batch.clone()


def keep(loader: Iterator[torch.Tensor], how) -> tuple[list[torch.Tensor], list[float]]:
    """A training loop that uses each batch at its step (a loss: the batch's mean) and keeps ``how(batch)``."""
    kept, used = [], []
    for batch in loader:
        used.append(batch.mean().item())
        kept.append(how(batch))
    return kept, used


@pytest.mark.parametrize("device", DEVICES)
def test_loader_reusing_its_buffer_overwrites_kept_batches(device):
    steps = [0.0, 1.0, 2.0, 3.0]
    # control: each step used the right batch, yet every kept batch is the one buffer, holding the last step's values
    kept, used = keep(reusing_loader(device), lambda b: b)
    assert used == steps
    assert len({ptr(b) for b in kept}) == 1
    assert [b.mean().item() for b in kept] == [3.0] * 4
    # detach() keeps the alias (a view of the buffer); so does cpu() on the host, which is the tensor itself
    kept_detached, _ = keep(reusing_loader(device), lambda b: b.detach())
    assert [b.mean().item() for b in kept_detached] == [3.0] * 4
    kept_cpu, _ = keep(reusing_loader(device), lambda b: b.cpu())
    if device == "cpu":
        assert [b.mean().item() for b in kept_cpu] == [3.0] * 4
    else:
        assert [b.mean().item() for b in kept_cpu] == steps  # from a device, cpu() is a copy: it keeps

    # the fix in the loop: clone what is kept, one copy of the batch per step
    with_clone, audit = audited(lambda: keep(reusing_loader(device), lambda b: b.clone()))
    kept_clones, _ = with_clone
    assert [b.mean().item() for b in kept_clones] == steps
    assert len({ptr(b) for b in kept_clones}) == 4
    assert audit.count("clone", "alloc") == 4
    assert sum(e.nbytes for e in audit.ops if e.op == "clone") == 4 * 2 * COLS * 4
    # the fix in the loader: new storage every step, and the loop may keep what it gets
    kept_fresh, used_fresh = keep(fresh_loader(device), lambda b: b)
    assert used_fresh == steps and [b.mean().item() for b in kept_fresh] == steps
    assert len({ptr(b) for b in kept_fresh}) == 4


# --------------------------------------------------------------------------------------------------
# rows: DTensor to_local / full_tensor
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def group_of_one(request: pytest.FixtureRequest) -> Iterator[None]:
    """A process group of this process alone, in memory (a HashStore: no port), destroyed after the test."""
    device = request.node.callspec.params["device"]
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", DEVICES)
def test_dtensor_to_local_and_full_tensor_on_one_rank(device, group_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(device, (1,))
    x = make(device, requires_grad=True)
    d, audit = audited(lambda: DTensor.from_local(x, mesh, [Shard(0)]))
    assert audit.ops == [] and ptr(d.to_local()) == ptr(x)  # from_local wraps x, no copy
    loc, audit_loc = audited(lambda: d.to_local())
    assert audit_loc.ops == [] and ptr(loc) == ptr(x)  # this rank's shard: a view
    assert loc.requires_grad and type(loc.grad_fn).__name__ == "_ToTorchTensorBackward"
    # with one rank there is nothing to gather: full_tensor is the shard too, no collective, no copy
    with CollectiveProbe() as probe:
        full, audit_full = audited(lambda: d.full_tensor())
    assert probe.count == 0 and audit_full.ops == []
    assert ptr(full) == ptr(x) and full.shape == (ROWS, COLS) and full.is_contiguous()
    assert type(full.grad_fn).__name__ == "_ToTorchTensorBackward"
    with torch.no_grad():
        full[0, 0] = -1.0  # so a write to the "gathered" tensor is a write to the DTensor's shard
    assert d.to_local()[0, 0].item() == -1.0 and x[0, 0].item() == -1.0


def test_dtensor_full_tensor_gathers_into_new_storage_on_two_ranks(tmp_path: Path):
    """Two gloo processes (``tests/atlas/dtensor_ranks.py``): what each rank measured."""
    env = child_env(TEST_PORT=free_port(), WORLD_SIZE="2")
    script = Path(__file__).with_name("dtensor_ranks.py")
    command = [sys.executable, str(script), str(tmp_path)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(rank)}, **pipes) for rank in range(2)]
    for proc in ranks:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        # to_local: this rank's rows, the DTensor's own storage, nothing allocated
        assert got["local_shape"] == [ROWS // 2, COLS] and got["local_is_shard"] and got["local_allocated"] == 0
        assert torch.equal(got["local"], make("cpu")[2 * rank : 2 * rank + 2])
        assert not got["local_shares_source"]  # distribute_tensor scattered copies of the source's rows
        # full_tensor: one all-gather of the shard into new storage of the whole
        assert got["full_shape"] == [ROWS, COLS] and not got["full_shares_local"] and got["full_contiguous"]
        assert got["full_storage_bytes"] == nbytes(make("cpu"))
        assert got["gathers"] == ["_c10d_functional.all_gather_into_tensor"]
        assert got["gathered_bytes"] == nbytes(make("cpu")) // 2  # the shard sent
        assert torch.equal(got["full"], make("cpu"))
        # control: a write to the gathered copy is not seen by the DTensor; one to the local shard is
        assert got["after_full_write"] == make("cpu")[:, 0].tolist()
        assert got["after_local_write"] == [101.0, 107.0, 113.0, 119.0]
