"""find_graph_refs: every graph-carrying tensor, by the path a person would type; detached ones are the control.
graph_bytes: the storage a graph keeps alive, to the byte what MemoryProbe sees; a graph that keeps nothing is the
control."""

import sys
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from torchmetrics.classification import MulticlassAUROC

from copy_correct.core.torch_internals import READS_PACKED
from copy_correct.probes import MemoryProbe, find_graph_refs, graph_bytes, graph_refs
from tests.conftest import DEVICES


def _graph(device: str = "cpu") -> torch.Tensor:
    w = torch.ones(3, requires_grad=True, device=device)
    return w * 2


@pytest.mark.parametrize("device", DEVICES)
def test_containers_report_only_graph_tensors(device: str) -> None:
    y = _graph(device)
    outputs = {"loss": y.sum().detach(), "aux": y, "nested": [1, (y.detach(), y + 1)]}
    assert find_graph_refs(outputs, name="outputs") == ["outputs['aux']", "outputs['nested'][1][1]"]


def test_leaves_and_no_grad_results_are_not_graphs() -> None:
    w = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        y = w * 2
    assert find_graph_refs({"param": w, "nograd": y, "detached": (w * 2).detach()}) == []


def test_module_attributes_and_metric_list_states() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(3, 4)
            self.auroc = MulticlassAUROC(4, thresholds=None)
            self.history: list[torch.Tensor] = []

    net = Net()
    probs = net.fc(torch.randn(5, 3)).softmax(-1)
    target = torch.tensor([0, 1, 2, 3, 0])
    net.auroc.update(probs.detach(), target)  # control: detached input leaves no graph
    assert find_graph_refs(net, name="module") == []
    net.auroc.update(probs, target)
    net.history.append(probs.sum())
    # torchmetrics updates under no_grad: the stored view has no grad_fn, but its base holds the graph
    assert net.auroc.preds[1].grad_fn is None
    assert find_graph_refs(net, name="module") == ["module.history[0]", "module.auroc.preds[1]._base"]


def test_a_no_grad_view_of_a_graph_tensor_is_reported_through_its_base() -> None:
    y = _graph()
    with torch.no_grad():
        view = y[1:]
    assert view.grad_fn is None and view._base is y
    assert find_graph_refs([view], name="kept") == ["kept[0]._base"]
    assert find_graph_refs([y.detach()[1:]], name="kept") == []  # control: a view of a detached tensor


def test_plain_objects_dataclasses_and_slots() -> None:
    @dataclass
    class Record:
        value: torch.Tensor

    class Slotted:
        __slots__ = ("cache",)

        def __init__(self, cache: torch.Tensor) -> None:
            self.cache = cache

    y = _graph()
    assert find_graph_refs([Record(y), Slotted(y + 1)], name="items") == ["items[0].value", "items[1].cache"]


def test_cycles_and_shared_references_report_each_tensor_once() -> None:
    y = _graph()
    a: dict = {"y": y}
    b: dict = {"a": a, "y_again": y}
    a["b"] = b
    assert find_graph_refs(a, name="a") == ["a['y']"]


def test_bounds_warn_when_the_search_is_partial() -> None:
    deep = current = {}
    for _ in range(50):
        current["next"] = {}
        current = current["next"]
    current["y"] = _graph()
    assert find_graph_refs(deep, max_depth=10) == []  # below the depth bound: not reached
    assert find_graph_refs(deep, max_depth=60) == ["obj" + "['next']" * 50 + "['y']"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        find_graph_refs([[i] for i in range(100)], max_nodes=10)
    assert any("partial" in str(w.message) for w in caught)


def test_skip_types_and_attrs() -> None:
    class Owner:
        def __init__(self) -> None:
            self.mine = _graph()
            self._trainer = {"theirs": _graph()}

    assert find_graph_refs(Owner(), name="o") == ["o.mine", "o._trainer['theirs']"]
    assert find_graph_refs(Owner(), name="o", skip_attrs=["_trainer"]) == ["o.mine"]
    assert find_graph_refs(Owner(), name="o", skip_types=(dict,)) == ["o.mine"]


def test_bad_bounds_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        find_graph_refs([], max_depth=-1)


# --- graph_bytes: the storage a graph keeps alive, measured against MemoryProbe ----------------------------------


@pytest.fixture(
    params=[
        pytest.param(True, id="packed", marks=pytest.mark.skipif(not READS_PACKED, reason="no SavedTensor.data")),
        pytest.param(False, id="unpacked"),
    ]
)
def reads_packed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways of reading saved tensors: as stored (newer torch) and unpacked (the only way on older torch)."""
    monkeypatch.setattr(graph_refs, "_READS_PACKED", request.param)
    return request.param


def dcgan_generator(nz: int = 8, ngf: int = 8) -> torch.nn.Sequential:
    """DCGAN's generator, small: noise of shape (n, nz, 1, 1) -> images of shape (n, 1, 16, 16)."""
    nn = torch.nn
    return nn.Sequential(
        nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False),
        nn.BatchNorm2d(ngf * 2),
        nn.ReLU(True),
        nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
        nn.BatchNorm2d(ngf),
        nn.ReLU(True),
        nn.ConvTranspose2d(ngf, 1, 4, 2, 1, bias=False),
        nn.Tanh(),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_graph_bytes_of_a_kept_generator_output_is_what_memory_probe_sees(device: str, reads_packed: bool) -> None:
    """An undetached generator output keeps every activation its graph saved (and the noise). MemoryProbe, measuring
    the statement that keeps it, agrees to the byte (tolerance 0): both count whole storages, each once, and nothing
    else the forward creates outlives it. The BatchNorm running statistics the graph also saved are held by the
    module: ``exclude`` leaves them out, as MemoryProbe does (they existed before the block)."""
    torch.manual_seed(0)
    netG = dcgan_generator().to(device)
    with MemoryProbe(device) as probe:
        fake = netG(torch.randn(16, 8, 1, 1, device=device))
    own = fake.untyped_storage().nbytes()
    kept = graph_bytes(fake, exclude=list(netG.buffers()))
    print(f"graph_bytes {kept} B, MemoryProbe {probe.net_bytes} B - the output's own {own} B")
    assert kept == probe.net_bytes - own
    assert kept > 4 * own  # the activations, not the output, are what a kept graph costs
    stats = sum(b.untyped_storage().nbytes() for name, b in netG.named_buffers() if name.endswith(("_mean", "_var")))
    assert graph_bytes(fake) == kept + stats

    # control: the same statement under no_grad keeps the output alone, and there is no graph to weigh
    with MemoryProbe(device) as control, torch.no_grad():
        fake = netG(torch.randn(16, 8, 1, 1, device=device))
    assert control.net_bytes == own
    assert graph_bytes(fake) == 0


def test_graph_bytes_counts_each_storage_once_and_not_parameters_or_the_tensor_itself(reads_packed: bool) -> None:
    w = torch.nn.Parameter(torch.ones(1000))
    x = torch.randn(1000)  # no grad: saved by the product, kept alive by the graph
    h = x * w  # saves x and w (a parameter: alive anyway)
    out = h[:10].sin().sum() + h.cos().sum()  # the slice saves a view of h: all of h's storage, counted once
    assert graph_bytes(out) == 4000 + 4000  # x and h, each once; not w, not out
    exp = h.exp()  # ExpBackward saves its result, which is exp itself: .detach() would keep it
    assert exp.grad_fn._saved_result.untyped_storage()._cdata == exp.untyped_storage()._cdata
    assert graph_bytes(exp) == 4000  # x: exp saved only itself, not h
    linear = torch.nn.Linear(1000, 10)
    y = linear(h.unsqueeze(0))  # addmm saves weight.t(): a view of a parameter, not counted
    assert y.grad_fn._saved_mat2 is not None
    assert graph_bytes(y) == 8000
    assert graph_bytes(y, exclude=[x]) == 4000
    assert graph_bytes(w) == graph_bytes(x) == 0  # a leaf and a tensor without grad carry no graph


def test_graph_bytes_after_backward_is_zero_but_the_graph_stays(reads_packed: bool) -> None:
    w = torch.nn.Parameter(torch.ones(1000))
    loss = (torch.randn(1000) * w).sin().sum()
    assert graph_bytes(loss) == 8000
    loss.backward(retain_graph=True)  # control: a retained graph keeps what it saved
    assert graph_bytes(loss) == 8000
    loss.backward()
    assert graph_bytes(loss) == 0
    assert loss.grad_fn is not None and find_graph_refs([loss]) == ["obj[0]"]  # the nodes are still there


def test_graph_bytes_of_a_no_grad_view_is_its_base_graph(reads_packed: bool) -> None:
    y = torch.randn(100, requires_grad=True).clone().sin()  # saves the clone: 400 B
    with torch.no_grad():
        view = y[1:]
    assert view.grad_fn is None
    assert graph_bytes(view) == graph_bytes(y) == 400
    assert graph_bytes(y.detach()[1:]) == 0  # control: a view of a detached tensor


def test_graph_bytes_counts_what_a_custom_function_saved_and_set_on_ctx(reads_packed: bool) -> None:
    weight = torch.nn.Parameter(torch.ones(100))  # not an input of the Function: no AccumulateGrad node names it

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a)
            ctx.b = b  # a tensor set on ctx: backward never frees it
            ctx.weight = weight  # a parameter, alive anyway: not counted
            return a * b

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return grad * ctx.b, None

    a = torch.randn(100, requires_grad=True).clone()  # not a leaf: counted
    out = Scale.apply(a, torch.randn(100))
    assert graph_bytes(out) == 400 + 400
    out.sum().backward()
    assert graph_bytes(out) == 400  # saved_tensors freed; ctx.b is not


def test_graph_bytes_walks_a_deep_graph_without_recursion() -> None:
    depth = 3 * sys.getrecursionlimit()  # a recursive walk would raise RecursionError
    y = torch.randn(10, requires_grad=True)
    for _ in range(depth):
        y = y.sin()  # each saves its input; the first input is a leaf that requires grad
    assert graph_bytes(y) == (depth - 1) * 40


def test_graph_bytes_skips_tensors_without_a_single_storage() -> None:
    sparse = torch.eye(3).to_sparse()
    y = torch.sparse.mm(sparse, torch.randn(3, 2, requires_grad=True).clone())
    assert y.grad_fn._saved_mat1.layout == torch.sparse_coo  # saved, but it has no single storage to weigh
    assert graph_bytes(y) == 0
    assert graph_bytes(sparse.requires_grad_().clone()) == 0  # nor a sparse graph tensor's own


def test_graph_bytes_runs_no_unpack_hook_where_torch_reads_saved_tensors_as_stored(reads_packed: bool) -> None:
    """With ``SavedTensor.data`` a saved tensor is read as packed: the unpack hook never runs, the pack hook's tensors
    are counted, and a checkpointed segment is not recomputed. Control: read unpacked (older torch), both happen."""
    unpacked: list[int] = []

    def unpack(packed: tuple[str, torch.Tensor]) -> torch.Tensor:
        unpacked.append(1)
        return packed[1]

    x = torch.randn(100, requires_grad=True).clone()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: ("packed", t.clone()), unpack):
        y = x.sin().sin()
    assert graph_bytes(y) == 800  # the two packed copies
    assert bool(unpacked) is not reads_packed

    forwards: list[int] = []

    def segment(t: torch.Tensor) -> torch.Tensor:
        forwards.append(1)
        return t.sin().sin()

    out = checkpoint(segment, x, use_reentrant=False)
    assert graph_bytes(out) == (0 if reads_packed else 800)  # unpacking recomputes the segment's activations
    assert (len(forwards) == 1) is reads_packed
