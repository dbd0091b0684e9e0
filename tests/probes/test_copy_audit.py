"""CopyAudit: records new storage and in-place writes, and nothing for views."""

import copy

import pytest
import torch

from copy_correct.probes import CopyAudit
from tests.conftest import DEVICES

ALL_DEVICES = [*DEVICES, pytest.param("meta", id="meta")]


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_views_allocate_nothing(device: str) -> None:
    x = torch.empty(4, 6, device=device)
    with CopyAudit() as audit:
        x.view(24), x.t(), x[1:, ::2], x.detach(), x.reshape(2, 12), x.permute(1, 0), x.unsqueeze(0)
    assert audit.ops == [], audit.summary()
    assert audit.bytes_allocated == 0


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_materialising_ops_are_recorded_with_their_bytes(device: str) -> None:
    x = torch.empty(4, 6, device=device)  # 96 bytes
    with CopyAudit() as audit:
        x.clone()
        x.t().contiguous()
        x.t().reshape(24)  # cannot be a view: copies
        x.to(torch.float64)
    assert [(e.op, e.kind, e.nbytes) for e in audit.ops] == [
        ("clone", "alloc", 96),
        ("clone", "alloc", 96),
        ("clone", "alloc", 96),
        ("_to_copy", "alloc", 192),
    ]
    assert audit.bytes_allocated == 480
    assert audit.count("clone") == 3 and audit.count("aten._to_copy") == 1
    assert all(e.device.startswith(device) for e in audit.ops)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_in_place_writes_are_recorded_not_allocated(device: str) -> None:
    a, b = torch.zeros(10, device=device), torch.ones(10, device=device)
    with CopyAudit() as audit:
        a.copy_(b)
        a.lerp_(b, 0.5)
        torch._foreach_lerp_([a, b], [b, a], 0.1)
    assert audit.bytes_allocated == 0
    assert audit.count(kind="write") == 4
    assert audit.count("_foreach_lerp_") == 2  # one record per tensor written
    assert audit.bytes_written == 4 * 40


@pytest.mark.parametrize("device", DEVICES)
def test_articles_ema_loop_allocates_where_lerp_does_not(device: str) -> None:
    """The control: `e.copy_(d * e + (1 - d) * p)` makes three temporaries per tensor; lerp_ makes none."""
    ema, live = torch.zeros(1000, device=device), torch.ones(1000, device=device)
    with CopyAudit() as articles:
        ema.copy_(0.9 * ema + (1 - 0.9) * live)
    with CopyAudit() as in_place:
        ema.lerp_(live, 1 - 0.9)
    assert articles.bytes_allocated == 3 * 4000
    assert articles.count("mul", kind="alloc") == 2 and articles.count("add", kind="alloc") == 1
    assert in_place.bytes_allocated == 0


def test_deepcopy_of_a_module_allocates_every_parameter_and_buffer() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    total = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    with CopyAudit() as audit:
        copy.deepcopy(module)
    assert audit.bytes_allocated == total
    assert audit.count("clone") == 4  # Parameters are deep-copied with clone()
    assert audit.count("deepcopy") == 3  # running_mean, running_var, num_batches_tracked
    assert audit.count(kind="write") == 0


def test_backward_ops_are_seen() -> None:
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    loss = (x @ w).relu().sum()
    with CopyAudit() as audit:
        loss.backward()
    assert audit.bytes_allocated >= w.numel() * 4  # at least the gradient itself
    assert w.grad is not None


def test_trace_names_the_callers_line() -> None:
    x = torch.ones(3)
    with CopyAudit(trace=True) as audit:
        x.clone()
    (event,) = audit.ops
    assert event.where is not None and "test_copy_audit.py" in event.where


def test_records_hold_no_tensor_and_summary_reads_well() -> None:
    x = torch.ones(256)
    with CopyAudit() as audit:
        y = x * 2
        y.add_(1)
    summary = audit.summary()
    assert "1 allocations (1.0 KiB)" in summary and "1 in-place writes (1.0 KiB)" in summary
    assert "mul" in summary and "add_" in summary
    assert not any(isinstance(v, torch.Tensor) for e in audit.ops for v in vars(e).values())


def test_count_rejects_unknown_kind_and_audit_cannot_be_reentered() -> None:
    audit = CopyAudit()
    with pytest.raises(ValueError, match="kind must be"):
        audit.count(kind="copy")
    with audit, pytest.raises(RuntimeError, match="already active"):
        audit.__enter__()


def test_deepcopy_of_a_tensor_counts_its_gradient_too() -> None:
    x = torch.ones(4, 6, requires_grad=True)
    x.grad = torch.ones(4, 6)
    with CopyAudit() as audit:
        y = copy.deepcopy(x)
    assert y.grad is not None and audit.bytes_allocated == 2 * 96
    assert audit.count("deepcopy") == 2
