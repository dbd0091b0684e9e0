"""A measured atlas of PyTorch copy operations: one test per row of ``docs/copy-atlas.md``.

Each row measures, for a small 4x6 float32 tensor (N = 96 bytes):

* storage: new or shared (``shares_storage`` / ``storage_key``, never ``data_ptr()``);
* cost: allocations and in-place writes with op names and bytes (``CopyAudit``);
* autograd: ``grad_fn``, ``requires_grad``, ``is_leaf``, ``_version`` where it matters;
* layout: ``is_contiguous()`` and ``stride()``;
* aliasing: whether an in-place write to the result changes the source.

Tests named ``test_article_claim_*`` each disprove (or pin down) one claim of the source articles.
CUDA rows run under the ``cuda`` parameter (marked ``gpu``) and are skipped without a GPU.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from copy_correct.probes import CopyAudit, MemoryProbe, shares_storage, storage_key
from tests.conftest import DEVICES

CUDA_ONLY = [DEVICES[1]]

ROWS, COLS = 4, 6


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def make(device: str, *, requires_grad: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A deterministic 4x6 tensor (values 1..24) with storage of its own: a leaf, not a view."""
    t = torch.arange(1, ROWS * COLS + 1, dtype=dtype, device=device).reshape(ROWS, COLS).clone()
    assert t._base is None
    return t.requires_grad_(requires_grad)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def audited(fn):
    """Run ``fn`` inside a CopyAudit; return (result, audit)."""
    with CopyAudit() as audit:
        out = fn()
    return out, audit


def write_changes_source(source: torch.Tensor, result: torch.Tensor) -> bool:
    """Write into ``result`` in place (outside autograd) and report whether ``source`` changed."""
    before = source.detach().clone()
    with torch.no_grad():
        result.add_(1000)
    changed = not torch.equal(source.detach(), before)
    with torch.no_grad():  # undo, so the caller can keep using both
        result.sub_(1000)
    return changed


def assert_no_copy(audit: CopyAudit, source: torch.Tensor, result: torch.Tensor) -> None:
    """No storage was created and the result lives in the source's storage."""
    assert audit.bytes_allocated == 0, audit.summary()
    assert audit.count(kind="alloc") == 0, audit.summary()
    assert shares_storage(source, result)
    assert storage_key(source) == storage_key(result)


def assert_one_copy(audit: CopyAudit, op: str, source: torch.Tensor, result: torch.Tensor, n: int) -> None:
    """Exactly one allocation, by ``op``, of ``n`` bytes, and the result shares nothing with the source."""
    assert audit.count(kind="alloc") == 1, audit.summary()
    assert audit.count(op, "alloc") == 1, audit.summary()
    assert audit.bytes_allocated == n, audit.summary()
    assert not shares_storage(source, result)
    assert storage_key(source) != storage_key(result)


def small_model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(COLS, ROWS), nn.BatchNorm1d(ROWS)).to(device)


def state_bytes(model: nn.Module) -> int:
    return sum(nbytes(t) for t in [*model.parameters(), *model.buffers()])


# --------------------------------------------------------------------------------------------------
# rows: aliases and views (no copy)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_assignment(device):
    x = make(device)
    with CopyAudit() as audit:
        y = x
    assert y is x
    assert_no_copy(audit, x, y)
    assert audit.ops == []
    v0 = x._version
    y[0, 0] = -1.0  # a write through the other name is a write to the same object
    assert x[0, 0].item() == -1.0
    assert x._version == y._version == v0 + 1


@pytest.mark.parametrize("device", DEVICES)
def test_view(device):
    x = make(device, requires_grad=True)
    v, audit = audited(lambda: x.view(2, 12))
    assert_no_copy(audit, x, v)
    assert audit.ops == []
    assert v._base is x and v.data_ptr() == x.data_ptr()
    assert v.is_contiguous() and v.stride() == (12, 1)
    assert type(v.grad_fn).__name__ == "ViewBackward0" and not v.is_leaf
    assert write_changes_source(x, v)
    # view() never copies: it refuses a layout it cannot express
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        x.t().view(ROWS * COLS)


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_contiguous(device):
    x = make(device, requires_grad=True)
    r, audit = audited(lambda: x.reshape(ROWS * COLS))
    assert_no_copy(audit, x, r)
    assert r._base is x
    assert r.is_contiguous() and r.stride() == (1,)
    assert type(r.grad_fn).__name__ == "ViewBackward0"
    assert write_changes_source(x, r)


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_noncontiguous(device):
    x = make(device, requires_grad=True)
    t = x.t()
    assert not t.is_contiguous()
    r, audit = audited(lambda: t.reshape(ROWS * COLS))
    # silently a full copy, reported by the dispatcher as a clone
    assert_one_copy(audit, "clone", x, r, nbytes(x))
    assert r._base is None
    assert r.is_contiguous() and r.stride() == (1,)
    assert type(r.grad_fn).__name__ == "UnsafeViewBackward0" and r.requires_grad
    assert not write_changes_source(x, r)


@pytest.mark.parametrize("device", DEVICES)
def test_transpose_permute_slice(device):
    x = make(device, requires_grad=True)
    (t, p, s), audit = audited(lambda: (x.t(), x.permute(1, 0), x[1:, ::2]))
    assert audit.ops == [], audit.summary()
    assert type(t.grad_fn).__name__ == "TBackward0"
    assert type(p.grad_fn).__name__ == "PermuteBackward0"
    assert type(s.grad_fn).__name__ == "SliceBackward0"
    for view in (t, p, s):
        assert_no_copy(audit, x, view)
        assert not view.is_contiguous()
        assert not view.is_leaf and view.requires_grad
        assert write_changes_source(x, view)
    assert t.stride() == p.stride() == (1, COLS)
    assert s.stride() == (COLS, 2) and s.storage_offset() == COLS
    # the slice shares storage yet starts elsewhere: data_ptr() differs by its offset
    assert s.data_ptr() == x.data_ptr() + COLS * x.element_size()
    # after an in-place write through any alias the views' grad_fn is rebuilt as a generic as_strided
    assert type(t.grad_fn).__name__ == "AsStridedBackward0"


# --------------------------------------------------------------------------------------------------
# rows: clone / detach and their combinations
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_clone(device):
    x = make(device, requires_grad=True)
    c, audit = audited(lambda: x.clone())
    assert_one_copy(audit, "clone", x, c, nbytes(x))
    assert audit.count(kind="write") == 0
    assert torch.equal(c, x)
    assert c.is_contiguous() and c.stride() == x.stride()
    assert c.requires_grad and type(c.grad_fn).__name__ == "CloneBackward0"
    assert not write_changes_source(x, c)

    # strides: kept for a dense layout (transpose), compacted for a strided slice with gaps
    ct, audit_t = audited(lambda: x.t().clone())
    assert audit_t.bytes_allocated == nbytes(x)
    assert ct.stride() == (1, COLS) and not ct.is_contiguous()
    gappy = x[:, ::2]
    cg, audit_g = audited(lambda: gappy.clone())
    assert audit_g.bytes_allocated == nbytes(gappy) == nbytes(x) // 2
    assert cg.is_contiguous() and cg.stride() == (COLS // 2, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_clone_of_leaf_is_not_a_leaf(device):
    x = make(device, requires_grad=True)
    assert x.is_leaf
    c = x.clone()
    assert not c.is_leaf
    assert c.requires_grad
    assert type(c.grad_fn).__name__ == "CloneBackward0"
    # the clone's node points back at the source's gradient accumulator
    (acc, _), *_ = c.grad_fn.next_functions
    assert type(acc).__name__ == "AccumulateGrad" and acc.variable is x
    (c * c).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_detach(device):
    x = make(device, requires_grad=True)
    d, audit = audited(lambda: x.detach())
    assert_no_copy(audit, x, d)
    assert audit.ops == []
    assert d is not x
    assert not d.requires_grad and d.grad_fn is None and d.is_leaf
    assert d.stride() == x.stride() and d.data_ptr() == x.data_ptr()
    # writes go through, and the version counter is shared with the source
    v0 = x._version
    with CopyAudit() as write_audit:
        d.add_(1)
    assert write_audit.count("add_", "write") == 1 and write_audit.bytes_written == nbytes(x)
    assert write_audit.bytes_allocated == 0
    assert x._version == d._version == v0 + 1
    assert torch.equal(x.detach(), make(device) + 1)


@pytest.mark.parametrize("device", DEVICES)
def test_detach_clone(device):
    x = make(device, requires_grad=True)
    c, audit = audited(lambda: x.detach().clone())
    assert_one_copy(audit, "clone", x, c, nbytes(x))
    assert not c.requires_grad and c.grad_fn is None and c.is_leaf
    assert c.stride() == x.stride()
    assert not write_changes_source(x, c)
    assert x._version == 0


@pytest.mark.parametrize("device", DEVICES)
def test_clone_detach(device):
    x = make(device, requires_grad=True)
    c, audit = audited(lambda: x.clone().detach())
    assert_one_copy(audit, "clone", x, c, nbytes(x))
    assert not c.requires_grad and c.grad_fn is None and c.is_leaf
    assert not write_changes_source(x, c)
    # same result and same cost as detach().clone()
    other, audit_other = audited(lambda: x.detach().clone())
    assert torch.equal(c, other) and c.stride() == other.stride()
    assert audit.bytes_allocated == audit_other.bytes_allocated


# --------------------------------------------------------------------------------------------------
# rows: copy_
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_copy_plain(device):
    src = make(device)
    dst = torch.zeros(ROWS, COLS, device=device)
    key, v0 = storage_key(dst), dst._version
    out, audit = audited(lambda: dst.copy_(src))
    assert out is dst
    assert audit.bytes_allocated == 0, audit.summary()
    assert audit.count("copy_", "write") == 1 and audit.bytes_written == nbytes(dst)
    assert storage_key(dst) == key and dst._version == v0 + 1
    assert torch.equal(dst, src)
    assert not shares_storage(dst, src)
    assert not write_changes_source(src, dst)

    # converting and broadcasting copies still allocate nothing: the bytes written are dst's
    wide = torch.zeros(ROWS, COLS, dtype=torch.float64, device=device)
    _, audit_wide = audited(lambda: wide.copy_(src))
    assert audit_wide.bytes_allocated == 0 and audit_wide.bytes_written == 2 * nbytes(src)
    row = make(device)[0]
    _, audit_bcast = audited(lambda: dst.copy_(row))
    assert audit_bcast.bytes_allocated == 0 and audit_bcast.bytes_written == nbytes(dst)
    assert torch.equal(dst, row.expand(ROWS, COLS))


@pytest.mark.parametrize("device", DEVICES)
def test_copy_into_leaf_requiring_grad(device):
    p = nn.Parameter(torch.zeros(ROWS, COLS, device=device))
    src = make(device)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place operation"):
        p.copy_(src)
    assert p._version == 0 and torch.count_nonzero(p).item() == 0

    key, v0 = storage_key(p), p._version
    with torch.no_grad(), CopyAudit() as audit:
        out = p.copy_(src)
    assert out is p
    assert audit.bytes_allocated == 0 and audit.count("copy_", "write") == 1
    assert storage_key(p) == key and p._version == v0 + 1
    assert isinstance(p, nn.Parameter) and p.is_leaf and p.requires_grad and p.grad_fn is None
    assert torch.equal(p.detach(), src)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_under_no_grad(device):
    src = make(device, requires_grad=True)
    # outside no_grad, copy_ from a source that requires grad records a node on the target
    tracked = torch.zeros(ROWS, COLS, device=device)
    tracked.copy_(src)
    assert tracked.requires_grad and type(tracked.grad_fn).__name__ == "CopyBackwards"
    assert not tracked.is_leaf
    # under no_grad it is a plain data write: no node, target stays a leaf without grad
    plain = torch.zeros(ROWS, COLS, device=device)
    key = storage_key(plain)
    with torch.no_grad(), CopyAudit() as audit:
        plain.copy_(src)
    assert audit.bytes_allocated == 0 and audit.count("copy_", "write") == 1
    assert storage_key(plain) == key and plain._version == 1
    assert not plain.requires_grad and plain.grad_fn is None and plain.is_leaf
    assert torch.equal(plain, src.detach())
    assert not shares_storage(plain, src)


# --------------------------------------------------------------------------------------------------
# rows: contiguous / to / cpu
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_contiguous(device):
    x = make(device, requires_grad=True)
    same, audit = audited(lambda: x.contiguous())
    assert same is x
    assert_no_copy(audit, x, same)
    assert audit.ops == []

    t = x.t()
    c, audit_t = audited(lambda: t.contiguous())
    assert_one_copy(audit_t, "clone", x, c, t.numel() * t.element_size())
    assert c.is_contiguous() and c.stride() == (ROWS, 1)
    assert type(c.grad_fn).__name__ == "CloneBackward0"
    assert not write_changes_source(x, c)

    # a strided slice: the copy is the slice's size, not its parent's
    gappy = x[:, ::2]
    g, audit_g = audited(lambda: gappy.contiguous())
    assert audit_g.bytes_allocated == gappy.numel() * gappy.element_size() == nbytes(x) // 2
    assert g.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
def test_to_same_device(device):
    x = make(device, requires_grad=True)
    (a, b, c), audit = audited(lambda: (x.to(device), x.to(torch.device(device)), x.to(device, torch.float32)))
    assert a is x and b is x and c is x
    assert_no_copy(audit, x, a)
    assert audit.ops == []
    # copy=True is the way to force one
    forced, audit_forced = audited(lambda: x.to(device, copy=True))
    assert_one_copy(audit_forced, "_to_copy", x, forced, nbytes(x))
    assert type(forced.grad_fn).__name__ == "ToCopyBackward0"
    assert not write_changes_source(x, forced)


@pytest.mark.parametrize("device", DEVICES)
def test_to_other_device(device):
    x = make(device, requires_grad=True)
    # on a CPU-only machine the meta device stands in for "another device"
    other = "meta" if device == "cpu" else "cpu"
    y, audit = audited(lambda: x.to(other))
    assert y.device.type == other
    assert audit.count(kind="alloc") == 1 and audit.count("_to_copy", "alloc") == 1, audit.summary()
    assert audit.bytes_allocated == nbytes(x)
    assert not shares_storage(x, y)
    assert y.requires_grad and type(y.grad_fn).__name__ == "ToCopyBackward0"
    assert y.stride() == x.stride()
    if device == "cuda":
        assert torch.equal(y.detach(), x.detach().cpu())
        assert not write_changes_source(x, y)
        back, audit_back = audited(lambda: y.detach().to("cuda"))
        assert back.device.type == "cuda"
        assert audit_back.count("_to_copy", "alloc") == 1 and audit_back.bytes_allocated == nbytes(x)
        assert torch.equal(back, x.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_to_dtype(device):
    x = make(device, requires_grad=True)
    d, audit = audited(lambda: x.to(torch.float64))
    assert_one_copy(audit, "_to_copy", x, d, 2 * nbytes(x))
    h, audit_h = audited(lambda: x.to(torch.float16))
    assert_one_copy(audit_h, "_to_copy", x, h, nbytes(x) // 2)
    assert d.requires_grad and type(d.grad_fn).__name__ == "ToCopyBackward0"
    assert torch.equal(d.detach(), x.detach().double())
    assert not write_changes_source(x, d)
    # the default memory format preserves a dense layout
    td = x.t().to(torch.float64)
    assert td.stride() == (1, COLS) and not td.is_contiguous()
    # same dtype: the same object, nothing allocated
    same, audit_same = audited(lambda: x.to(torch.float32))
    assert same is x and audit_same.ops == []


def test_cpu_on_cpu_tensor():
    x = make("cpu", requires_grad=True)
    y, audit = audited(lambda: x.cpu())
    assert y is x
    assert_no_copy(audit, x, y)
    assert audit.ops == []
    # hence on CPU `x.detach().cpu()` is no snapshot: it aliases x
    snap, audit_snap = audited(lambda: x.detach().cpu())
    assert_no_copy(audit_snap, x, snap)
    assert write_changes_source(x, snap)


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_cpu_on_cuda_tensor(device):
    x = make(device, requires_grad=True)
    y, audit = audited(lambda: x.cpu())
    assert y is not x and y.device.type == "cpu"
    assert audit.count(kind="alloc") == 1 and audit.count("_to_copy", "alloc") == 1, audit.summary()
    assert audit.bytes_allocated == nbytes(x)
    assert not shares_storage(x, y)
    assert type(y.grad_fn).__name__ == "ToCopyBackward0"
    assert torch.equal(y.detach(), make("cpu"))
    assert not write_changes_source(x, y)


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_non_blocking_device_to_host(device):
    x = make(device)
    expected = make("cpu")

    # to(): with non_blocking the new host tensor is allocated pinned
    out, audit = audited(lambda: x.to("cpu", non_blocking=True))
    torch.cuda.current_stream().synchronize()  # only now may the host read it
    assert audit.count("_to_copy", "alloc") == 1 and audit.bytes_allocated == nbytes(x)
    assert out.is_pinned()
    assert torch.equal(out, expected)

    # copy_ into a pageable destination
    pageable = torch.zeros(ROWS, COLS)
    assert not pageable.is_pinned()
    _, audit_p = audited(lambda: pageable.copy_(x, non_blocking=True))
    torch.cuda.current_stream().synchronize()
    assert audit_p.bytes_allocated == 0 and audit_p.count("copy_", "write") == 1
    assert torch.equal(pageable, expected)

    # copy_ into a pinned destination, waited on with an event
    pinned = torch.zeros(ROWS, COLS, pin_memory=True)
    assert pinned.is_pinned()
    key = storage_key(pinned)
    _, audit_pin = audited(lambda: pinned.copy_(x, non_blocking=True))
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert audit_pin.bytes_allocated == 0 and storage_key(pinned) == key
    assert torch.equal(pinned, expected)


# --------------------------------------------------------------------------------------------------
# rows: .data, .item()
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_data_attribute(device):
    x = make(device, requires_grad=True)
    d, audit = audited(lambda: x.data)
    assert_no_copy(audit, x, d)
    assert d is not x and not d.requires_grad and d.grad_fn is None and d.is_leaf
    assert write_changes_source(x, d)
    # writes through .data are invisible to x's version counter
    v0 = x._version
    d.add_(1)
    assert x._version == v0

    # consequence: a value saved for backward is changed and backward silently uses it
    w = torch.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    a = torch.tensor([4.0, 5.0, 6.0], device=device, requires_grad=True)
    loss = (w * a).sum()  # saves a for d(loss)/dw
    a.data.add_(10)
    loss.backward()  # no error
    correct = torch.tensor([4.0, 5.0, 6.0], device=device)
    assert torch.equal(w.grad, correct + 10)  # wrong by 10, silently
    assert not torch.equal(w.grad, correct)

    # the same write through detach() is caught at backward
    w2 = torch.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    a2 = torch.tensor([4.0, 5.0, 6.0], device=device, requires_grad=True)
    loss2 = (w2 * a2).sum()
    a2.detach().add_(10)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss2.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_item(device):
    x = make(device, requires_grad=True)
    scalar = x[1, 2]
    if device == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with pytest.warns(UserWarning, match="called a synchronizing CUDA operation"):
                value = scalar.item()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            value = scalar.item()
    assert type(value) is float and value == 9.0
    _, audit = audited(lambda: scalar.item())
    assert audit.bytes_allocated == 0 and audit.ops == []
    with pytest.raises(RuntimeError, match="a Tensor with 24 elements cannot be converted to Scalar"):
        x.item()


# --------------------------------------------------------------------------------------------------
# rows: modules
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_aliases_parameters(device):
    model = small_model(device)
    sd, audit = audited(lambda: model.state_dict())
    assert audit.ops == [] and audit.bytes_allocated == 0
    live = dict(model.named_parameters()) | dict(model.named_buffers())
    assert sd.keys() == live.keys()
    for name, tensor in sd.items():
        assert shares_storage(tensor, live[name]) and storage_key(tensor) == storage_key(live[name])
        assert tensor is not live[name] and not tensor.requires_grad
    # an in-place edit of the state_dict entry edits the model
    sd["0.weight"].fill_(7.0)
    assert torch.all(model[0].weight == 7.0)
    # keep_vars=True hands out the Parameters themselves
    assert model.state_dict(keep_vars=True)["0.weight"] is model[0].weight


@pytest.mark.parametrize("device", DEVICES)
def test_load_state_dict_copies_in_place(device):
    target = small_model(device)
    torch.manual_seed(1)
    source = nn.Sequential(nn.Linear(COLS, ROWS), nn.BatchNorm1d(ROWS)).to(device)
    with torch.no_grad():
        source[1].running_mean.fill_(0.5)
        source[1].num_batches_tracked.fill_(3)
    keys = {name: storage_key(t) for name, t in target.state_dict().items()}
    src_sd = source.state_dict()

    with CopyAudit() as audit:
        target.load_state_dict(src_sd)
    assert audit.bytes_allocated == 0 and audit.count(kind="alloc") == 0, audit.summary()
    assert audit.count("copy_", "write") == len(keys) == audit.count(kind="write")
    assert audit.bytes_written == state_bytes(target)

    after = target.state_dict()
    for name, tensor in after.items():
        assert storage_key(tensor) == keys[name]  # same storage as before the load
        assert torch.equal(tensor, src_sd[name])
        assert not shares_storage(tensor, src_sd[name])
    assert isinstance(target[0].weight, nn.Parameter) and target[0].weight.requires_grad
    # the source is not aliased: editing it leaves the target alone
    with torch.no_grad():
        source[0].weight.add_(1)
    assert not torch.equal(target[0].weight, source[0].weight)


@pytest.mark.parametrize("device", DEVICES)
def test_deepcopy_module(device):
    model = small_model(device)
    model[0].bias.requires_grad_(False)
    model(make(device)).sum().backward()  # gives weight a .grad
    assert model[0].weight.grad is not None

    with CopyAudit() as audit:
        twin = copy.deepcopy(model)
    assert audit.bytes_allocated == state_bytes(model), audit.summary()
    n_params = len(list(model.parameters()))
    n_buffers = len(list(model.buffers()))
    assert audit.count("clone", "alloc") == n_params  # Parameters are cloned
    assert audit.count("deepcopy", "alloc") == n_buffers  # buffers go through Tensor.__deepcopy__

    live = dict(model.named_parameters()) | dict(model.named_buffers())
    copied = dict(twin.named_parameters()) | dict(twin.named_buffers())
    for name, tensor in copied.items():
        assert not shares_storage(tensor, live[name])
        assert torch.equal(tensor, live[name])
    for name, p in twin.named_parameters():
        assert isinstance(p, nn.Parameter) and p.is_leaf
        assert p.requires_grad == live[name].requires_grad
    assert not twin[0].bias.requires_grad and twin[0].weight.requires_grad
    assert twin[0].weight.grad is None  # a module deepcopy does not copy .grad
    with torch.no_grad():
        twin[0].weight.add_(1)
    assert not torch.equal(twin[0].weight, model[0].weight)


# --------------------------------------------------------------------------------------------------
# rows: in-place writes through a detached alias
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_write_through_detached_alias_before_forward(device):
    x = make(device, requires_grad=True)
    x.detach().add_(1)  # before any forward: just a value change
    assert x._version == 1
    loss = (x * x).sum()
    loss.backward()
    assert torch.equal(x.grad, 2 * (make(device) + 1))


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_write_through_detached_alias_after_forward(device):
    # an op that saves its output
    x = make(device, requires_grad=True)
    y = x.sigmoid()
    y.detach().mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    # an op that saves its input
    w = make(device, requires_grad=True)
    x2 = make(device, requires_grad=True)
    z = (w * x2).sum()
    x2.detach().add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()

    # contrast: the same write through .data is not caught and the gradient is silently wrong
    w3 = make(device, requires_grad=True)
    x3 = make(device, requires_grad=True)
    z3 = (w3 * x3).sum()
    x3.data.add_(1)
    z3.backward()
    assert torch.equal(w3.grad, make(device) + 1)


# --------------------------------------------------------------------------------------------------
# corrections of the source articles
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_clone_of_leaf_is_not_a_leaf(device):
    """Claim: clone() of a leaf gives a new leaf node. It gives a non-leaf with CloneBackward0."""
    x = make(device, requires_grad=True)
    c = x.clone()
    assert x.is_leaf and not c.is_leaf
    assert type(c.grad_fn).__name__ == "CloneBackward0"
    c.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # the gradient reaches the source


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_copy_into_leaf_raises_outside_no_grad(device):
    """Claim: target.copy_(src) on a zeros(..., requires_grad=True) leaf works and keeps its graph role."""
    target = torch.zeros(3, 3, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        target.copy_(torch.ones(3, 3, device=device))
    with torch.no_grad():
        target.copy_(torch.ones(3, 3, device=device))
    assert target.is_leaf and target.requires_grad and torch.all(target == 1)


def test_article_claim_data_ptr_is_not_the_sharing_test():
    """Claim: equal data_ptr() means same memory (and by implication unequal means separate)."""
    x = make("cpu")
    s = x[1:]
    assert s.data_ptr() != x.data_ptr()  # different first-element address ...
    assert shares_storage(x, s)  # ... same storage
    s.fill_(0)
    assert torch.count_nonzero(x[1:]).item() == 0  # and writes go through
    a = torch.empty(3, device="meta")
    b = torch.empty(3, device="meta")
    assert a.data_ptr() == b.data_ptr() == 0  # equal addresses ...
    assert not shares_storage(a, b)  # ... nothing shared
    assert storage_key(a) != storage_key(b)


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_copy_records_a_graph_node(device):
    """Claim: copy_() creates no graph node; the target's place in the graph is unchanged."""
    src = make(device, requires_grad=True)
    target = torch.zeros(ROWS, COLS, device=device)
    assert target.is_leaf and target.grad_fn is None
    target.copy_(src)
    assert type(target.grad_fn).__name__ == "CopyBackwards" and not target.is_leaf
    assert target.requires_grad  # a plain target now requires grad
    target.sum().backward()
    assert torch.equal(src.grad, torch.ones_like(src))
    # a target with history: the history is replaced, its inputs get a zero gradient
    x = make(device, requires_grad=True)
    src2 = make(device, requires_grad=True)
    a = x * 2
    assert type(a.grad_fn).__name__ == "MulBackward0"
    a.copy_(src2)
    assert type(a.grad_fn).__name__ == "CopyBackwards" and a._version == 1
    a.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(src2.grad, torch.ones_like(src2))


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_clone_keeps_graph_history(device):
    """Claim: a clone drops the graph history, so clone-then-free-the-original frees the graph."""
    x = make(device, requires_grad=True)
    y = (x / 24).sigmoid()
    c = y.clone()
    del y
    (producer, _), *_ = c.grad_fn.next_functions
    assert type(producer).__name__ == "SigmoidBackward0"  # the clone holds the whole history
    c.sum().backward()
    assert x.grad is not None and torch.all(x.grad > 0)


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_inplace_on_non_leaf_is_allowed(device):
    """Claim: `y = x * 2; y += 1` raises "a leaf Variable ..." so y must be cloned first."""
    x = make(device, requires_grad=True)
    y = x * 2
    y += 1  # y is not a leaf: fine
    assert type(y.grad_fn).__name__ == "AddBackward0"
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    # the error the article quotes is raised only for a leaf
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        x += 1


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_detach_inplace_before_forward_gives_consistent_grad(device):
    """Claim: `b = a.detach(); b.mul_(2); loss = (a**2).sum(); loss.backward()` gives a wrong gradient.

    The write happens before the forward, so the gradient is the right one for the values used;
    a write after the forward raises instead (see the *_after_forward row).
    """
    a = make(device, requires_grad=True)
    b = a.detach()
    b.mul_(2)
    loss = (a**2).sum()
    loss.backward()
    assert torch.equal(a.grad, 2 * a.detach())
    assert torch.equal(a.detach(), 2 * make(device))


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_relu_inplace(device):
    """Claim: `torch.relu(x, inplace=True)` runs in place on a leaf x that requires grad."""
    leaf = make(device, requires_grad=True)
    source = make(device, requires_grad=True)
    x = source - 12.5  # a non-leaf with negative entries
    with pytest.raises(TypeError):
        torch.relu(leaf, inplace=True)  # torch.relu has no such argument
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        F.relu(leaf, inplace=True)
    # on a non-leaf it works and the gradient is right
    out = F.relu(x, inplace=True)
    assert out is x
    out.sum().backward()
    assert torch.equal(source.grad, (source.detach() > 12.5).float())
    # relu saves its output: an in-place write to the output after the forward is caught
    y = F.relu(make(device, requires_grad=True) - 12.5)
    y.detach().add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_clone_strides_and_double_copy(device):
    """Claims: a clone of a non-contiguous tensor is non-contiguous; clone().contiguous() and
    contiguous().clone() are the way to an independent contiguous copy."""
    x = make(device)
    t = x.t()
    assert not t.clone().is_contiguous()  # true for a dense layout ...
    assert x[:, ::2].clone().is_contiguous()  # ... false for a slice with gaps
    # both two-step spellings copy twice; one clone with a memory format copies once
    _, a1 = audited(lambda: t.clone().contiguous())
    _, a2 = audited(lambda: t.contiguous().clone())
    one, a3 = audited(lambda: t.clone(memory_format=torch.contiguous_format))
    assert a1.count("clone", "alloc") == a2.count("clone", "alloc") == 2
    assert a1.bytes_allocated == a2.bytes_allocated == 2 * nbytes(x)
    assert a3.count("clone", "alloc") == 1 and a3.bytes_allocated == nbytes(x)
    assert one.is_contiguous() and not shares_storage(one, x)


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_ema_expression_allocates(device):
    """Claim: `shadow.copy_((1 - d) * param.data + d * shadow)` is all in place and allocates nothing."""
    param = make(device, requires_grad=True)
    shadow = torch.zeros(ROWS, COLS, device=device)
    decay = 0.9
    with CopyAudit() as audit:
        shadow.copy_((1.0 - decay) * param.data + decay * shadow)
    assert audit.count("mul", "alloc") == 2 and audit.count("add", "alloc") == 1, audit.summary()
    assert audit.bytes_allocated == 3 * nbytes(shadow)
    assert audit.count("copy_", "write") == 1
    expected = shadow.clone()
    # the in-place alternative: lerp_ allocates nothing
    shadow.zero_()
    with torch.no_grad(), CopyAudit() as lerp_audit:
        shadow.lerp_(param, 1.0 - decay)
    assert lerp_audit.bytes_allocated == 0 and lerp_audit.count("lerp_", "write") == 1
    torch.testing.assert_close(shadow, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_ema_copy_outside_no_grad_builds_graph(device):
    """Claim: `ema.copy_(decay * ema + (1 - decay) * param)` is a plain data update of the EMA weights."""
    param = nn.Parameter(make(device))
    ema = param.detach().clone()
    ema.copy_(0.9 * ema + 0.1 * param)  # outside no_grad, with the Parameter itself
    assert ema.requires_grad and type(ema.grad_fn).__name__ == "CopyBackwards"  # now linked to param
    # with an EMA that is itself a Parameter the same line raises
    ema_param = nn.Parameter(make(device))
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        ema_param.copy_(0.9 * ema_param + 0.1 * param)
    with torch.no_grad():
        ema_param.copy_(0.9 * ema_param + 0.1 * param)
    assert ema_param.is_leaf and ema_param.grad_fn is None


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_parameter_only_ema_misses_buffers(device):
    """Claim: an EMA over named_parameters() shadows the model's state."""
    model = small_model(device)
    params = dict(model.named_parameters())
    state = model.state_dict()
    missing = sorted(set(state) - set(params))
    assert missing == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_deepcopy_copies_no_graph(device):
    """Claim: deepcopy may copy computation-graph intermediates along with the data."""
    x = make(device, requires_grad=True)
    with pytest.raises(RuntimeError, match="Only Tensors created explicitly by the user"):
        copy.deepcopy(x * 2)  # a tensor with history cannot be deep-copied at all
    model = small_model(device)
    model(make(device)).sum().backward()
    with CopyAudit() as audit:
        copy.deepcopy(model)
    assert audit.bytes_allocated == state_bytes(model)  # parameters and buffers, nothing more
    assert not any(p.grad is not None for p in copy.deepcopy(model).parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_deepcopy_of_leaf_differs_from_clone(device):
    """Claim: for isolating data clone() is always the lighter, safer choice than deepcopy."""
    x = make(device, requires_grad=True)
    x.grad = torch.ones_like(x)
    c = x.clone()
    d = copy.deepcopy(x)
    assert not c.is_leaf and type(c.grad_fn).__name__ == "CloneBackward0"  # attached to x's graph
    assert d.is_leaf and d.requires_grad and d.grad_fn is None  # an independent leaf ...
    assert d.grad is not None and not shares_storage(d.grad, x.grad)  # ... that carries a copy of .grad
    assert not shares_storage(d, x)
    # the copy that isolates data is detach().clone(): no graph, no grad, one allocation
    iso, audit = audited(lambda: x.detach().clone())
    assert_one_copy(audit, "clone", x, iso, nbytes(x))
    assert iso.grad is None and not iso.requires_grad


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_plain_tensor_attribute_is_not_state(device):
    """Claim: `self.buf = torch.randn(10)` is a buffer and load_state_dict(state_dict()) copies the model."""

    class WithAttribute(nn.Module):
        def __init__(self, fill: float) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.full((3,), fill))
            self.persistent_buffer = torch.full((3,), fill)  # plain attribute, not register_buffer

    model = WithAttribute(1.0).to(device)
    assert "persistent_buffer" not in model.state_dict()
    assert model.persistent_buffer.device.type == "cpu"  # .to(device) does not move it either
    other = WithAttribute(2.0)
    other.load_state_dict(model.state_dict())
    assert torch.all(other.weight == 1.0)
    assert torch.all(other.persistent_buffer == 2.0)  # not copied
    assert torch.all(copy.deepcopy(model).persistent_buffer == 1.0)  # deepcopy does copy it


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_cpu_clone_detach_snapshot(device):
    """Claim: `t.cpu().clone().detach()` is the habit for logging from the GPU."""
    x = make(device, requires_grad=True)
    snap, audit = audited(lambda: x.cpu().clone().detach())
    direct, audit_direct = audited(lambda: x.detach().cpu())
    assert torch.equal(snap, direct)
    if device == "cuda":
        # cpu() already copies: the habit pays for two host copies where one does
        assert audit.count(kind="alloc") == 2 and audit.bytes_allocated == 2 * nbytes(x)
        assert audit_direct.count(kind="alloc") == 1 and audit_direct.bytes_allocated == nbytes(x)
        assert not write_changes_source(x, direct)
    else:
        # on CPU cpu() is a no-op: the clone is the only copy, and detach().cpu() aliases
        assert audit.count(kind="alloc") == 1 and audit.bytes_allocated == nbytes(x)
        assert audit_direct.bytes_allocated == 0 and shares_storage(direct, x)


def test_article_claim_repeated_reshape_copy_does_not_accumulate():
    """Claim: a reshape that copies, repeated in a training loop, makes memory grow and grow."""
    x = make("cpu")
    with MemoryProbe("cpu") as probe, CopyAudit() as audit:
        kept = None
        for _ in range(10):
            kept = x.t().reshape(ROWS * COLS)
    assert audit.count("clone", "alloc") == 10  # ten silent copies: time and bandwidth ...
    assert probe.net_bytes == nbytes(x) == nbytes(kept)  # ... but only the last one stays alive
    assert probe.peak_bytes == 2 * nbytes(x)  # old result freed once the new one is bound


def test_article_claim_negative_step_slice():
    """Claim: `aug[:, :, :, ::-1] = aug[:, :, :, ::-1]` flips the last axis (and through aliasing the original)."""
    x = make("cpu").reshape(1, 1, ROWS, COLS)
    with pytest.raises(ValueError, match="step must be greater than zero"):
        x[:, :, :, ::-1]
    flipped, audit = audited(lambda: torch.flip(x, dims=[-1]))
    assert_one_copy(audit, "flip", x, flipped, nbytes(x))  # flip always copies
    assert torch.equal(flipped[0, 0, 0], torch.arange(COLS, 0, -1, dtype=torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_clone_of_batch_builds_no_graph(device):
    """Claim: `x = x.clone()` on input batches hangs the clone on the graph and grows it every step."""
    batch = make(device)
    c = batch.clone()
    assert c.grad_fn is None and not c.requires_grad and c.is_leaf


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_argmax_carries_no_graph(device):
    """Claim: argmax results may still hang on the graph, so detach them before storing."""
    w = make(device, requires_grad=True)
    logits = make(device)[:, :ROWS] @ w[:ROWS]
    assert logits.requires_grad
    pred = logits.argmax(dim=1)
    assert not pred.requires_grad and pred.grad_fn is None
    assert not (logits > 0).requires_grad


@pytest.mark.parametrize("device", DEVICES)
def test_article_claim_no_grad_does_not_clear_requires_grad(device):
    """Claim: under torch.no_grad() every tensor has requires_grad False."""
    p = nn.Parameter(make(device))
    with torch.no_grad():
        assert p.requires_grad  # existing flags are untouched
        assert not (p * 2).requires_grad  # only new results are untracked
        assert not p.clone().requires_grad and p.clone().grad_fn is None


def test_article_claim_size_formula_is_mib():
    """Claim: a [64, 3, 224, 224] float32 batch is 38.5 MB by `numel * bytes / 1024 / 1024`."""
    batch = torch.empty(64, 3, 224, 224, device="meta")  # sizes without allocating
    feats = torch.empty(64, 256, 56, 56, device="meta")
    assert nbytes(batch) == 38_535_168
    assert round(nbytes(batch) / 1e6, 1) == 38.5 and round(nbytes(batch) / 2**20, 1) == 36.8
    assert round(nbytes(feats) / 1e6, 1) == 205.5 and round(nbytes(feats) / 2**20, 1) == 196.0
