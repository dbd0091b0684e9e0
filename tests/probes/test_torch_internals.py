"""torch's private and version-dependent surfaces (``copy_correct.core.torch_internals``): ``increment_versions`` raises
each listed tensor's version by one; ``set_grad_enabled`` sets the grad mode as ``torch.no_grad`` does; a torch without
the dispatch-mode modules still imports the package, and its probes refuse to be entered, in one line naming the torch
version. Each with its control."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from copy_correct.core.torch_internals import increment_versions, set_grad_enabled
from copy_correct.probes import CollectiveProbe, CopyAudit


def test_increment_versions_raises_each_listed_tensor_by_one() -> None:
    listed, other = [torch.zeros(2), torch.ones(3)], torch.zeros(2)
    before = [t._version for t in listed]
    increment_versions(listed)
    assert [t._version for t in listed] == [v + 1 for v in before]
    assert other._version == 0  # the control: a tensor not listed keeps its version


def test_set_grad_enabled_sets_the_grad_mode_and_restores_it() -> None:
    weight = torch.ones(2, requires_grad=True)
    set_grad_enabled(False)
    try:
        assert not torch.is_grad_enabled() and (weight * 2).grad_fn is None
    finally:
        set_grad_enabled(True)
    assert torch.is_grad_enabled() and (weight * 2).grad_fn is not None  # the control: grad mode on records a graph


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
