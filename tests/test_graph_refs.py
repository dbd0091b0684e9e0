"""find_graph_refs: every graph-carrying tensor, by the path a person would type; detached ones are the control."""

import warnings
from dataclasses import dataclass

import pytest
import torch
from torchmetrics.classification import MulticlassAUROC

from components import find_graph_refs
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
