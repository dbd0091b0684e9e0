"""Storage identity: which tensors share memory.

Copy contract: nothing here copies or allocates; these functions only read tensor metadata.

``a.data_ptr() == b.data_ptr()`` is the usual test for "same memory" and it is wrong both ways:
a slice at an offset (``a[1:]``) has another ``data_ptr()`` yet lives in ``a``'s storage, and two
tensors on the ``meta`` device all report ``data_ptr() == 0`` though they share nothing. The test
that means "writing one can change the other" is whether the underlying storages overlap.
"""

from __future__ import annotations

import torch

__all__ = ["shares_storage", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """An identifier of ``t``'s storage object (the C++ ``StorageImpl``), stable while it lives.

    Views, ``detach()`` and ``state_dict()`` entries return the key of the tensor they alias;
    ``clone()``, ``contiguous()`` on a non-contiguous tensor and ``to()`` that converts return a new one.
    Raises ``TypeError`` for tensors without a storage (sparse, nested).
    """
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError) as err:
        raise TypeError(f"tensor with layout {t.layout} has no single storage to compare") from err


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` live in the same memory, so an in-place write to one may change the other.

    Compares storages, not first-element addresses: ``shares_storage(x, x[1:])`` is True although
    ``x.data_ptr() != x[1:].data_ptr()``, and two distinct ``meta`` tensors do not share although both
    report ``data_ptr() == 0``. Tensors on different devices never share. Two storage objects that wrap
    overlapping memory (``torch.from_numpy`` twice on one array) count as shared.
    """
    if a.device != b.device:
        return False
    if storage_key(a) == storage_key(b):
        return True
    if a.device.type == "meta":
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    pa, pb = sa.data_ptr(), sb.data_ptr()
    na, nb = sa.nbytes(), sb.nbytes()
    if na == 0 or nb == 0:
        return False
    return pa < pb + nb and pb < pa + na
