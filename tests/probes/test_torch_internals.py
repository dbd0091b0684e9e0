"""torch's private and version-dependent surfaces (``copy_correct._torch_internals``): ``increment_versions`` raises
each tensor's version by one, in one call or, where torch takes one tensor at a time, one per tensor; a torch without
the dispatch-mode modules still imports the package, and its probes refuse to be entered, in one line naming the torch
version. Each with its control."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from copy_correct import _torch_internals
from copy_correct._torch_internals import increment_versions
from copy_correct.probes import CollectiveProbe, CopyAudit


@pytest.mark.parametrize("takes_lists", [True, False], ids=["one call", "one per tensor"])
def test_increment_versions_raises_each_listed_tensor_by_one(
    takes_lists: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_torch_internals, "_TAKES_LISTS", takes_lists)
    listed, other = [torch.zeros(2), torch.ones(3)], torch.zeros(2)
    before = [t._version for t in listed]
    increment_versions(listed)
    assert [t._version for t in listed] == [v + 1 for v in before]
    assert other._version == 0  # the control: a tensor not listed keeps its version


def test_the_torch_installed_takes_a_list_in_one_call() -> None:
    assert _torch_internals._TAKES_LISTS is (tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5))


def test_without_torchs_dispatch_mode_the_package_imports_and_its_probes_refuse_in_one_line() -> None:
    script = textwrap.dedent(
        """
        import sys
        import torch
        sys.modules["torch.utils._python_dispatch"] = None  # a torch without it
        import copy_correct
        from copy_correct.probes import CollectiveProbe, CopyAudit
        model = torch.nn.Linear(2, 2)
        copy_correct.EMA(model).update(model)
        for probe in (CollectiveProbe, CopyAudit):
            try:
                with probe():
                    pass
            except RuntimeError as err:
                print(err)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    expected = (
        "copy_correct's probes need torch.utils._python_dispatch.TorchDispatchMode and torch.utils._pytree, which "
        f"torch {torch.__version__} installed does not have: use a torch they were checked on (2.13)"
    )
    assert done.stdout.splitlines() == [expected, expected]
    with CollectiveProbe(), CopyAudit():  # the control: with it, both are entered
        torch.ones(2).add_(1)
