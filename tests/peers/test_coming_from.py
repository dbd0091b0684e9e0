"""The "coming from" page (``docs/guides/coming-from.md``) run as it is shown: its first block, then each peer
section's blocks in order, in one namespace per section, in a fresh directory, with the peers' own code. Each test
then checks what the page says of that section: the peer's average against ours, and the interop both ways (timm's
``load_checkpoint`` of what the page saves, ``from_pretrained`` of the average it writes). Each section skips where
its peer is not installed (a failure under ``COPY_CORRECT_REQUIRE_PEERS=1``: ``conftest.py``).

timm is installed without torchvision here (``benchmarks/peers.py`` says why), so ``import timm`` fails; the page's
``from timm.utils import ...`` and ``from timm.models import ...`` then get stand-ins for those two packages holding
the installed files' own code, each loaded alone: ``utils/model_ema.py``, ``models/_helpers.py`` (``load_checkpoint``)
and ``utils/checkpoint_saver.py``, whose ``from .model import unwrap_model, get_state_dict`` gets those two functions
compiled from ``utils/model.py``'s source (the rest of that file imports torchvision).
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from copy_correct import EMA, soft_update

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guides" / "coming-from.md"
# The page's sections with python blocks, and how many each has: a block added or moved is run by a test below.
SECTIONS = {"timm": 5, "diffusers": 4, "ema-pytorch": 6, "Lightning": 2, "torchtitan": 1, "stable-baselines3": 2}
Namespaces = list[dict[str, Any]]


def page() -> tuple[str, dict[str, list[str]]]:
    """The page's first python block (before any section) and each ``## `` section's python blocks, in order."""
    head, *sections = re.split(r"^## ", PAGE.read_text(), flags=re.MULTILINE)
    (setup,) = re.findall(r"```python\n(.*?)```", head, re.DOTALL)
    blocks = {text.split("\n", 1)[0]: re.findall(r"```python\n(.*?)```", text, re.DOTALL) for text in sections}
    return setup, {name: found for name, found in blocks.items() if found}


def run_section(name: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> Namespaces:
    """Run the first block, then section ``name``'s blocks in order in one namespace, in ``cwd``; the namespace as
    each block left it (a copy per block: later blocks rebind the same names, as a reader running them would)."""
    setup, sections = page()
    monkeypatch.chdir(cwd)
    names: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(setup, str(PAGE), "exec"), names)
    after = []
    for index, block in enumerate(sections[name]):
        exec(compile(block, f"{PAGE}: {name} block {index}", "exec"), names)
        after.append(dict(names))
    return after


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over the floating tensors of ``b``, by name in ``a``."""
    return max((a[k].double() - t.double()).abs().max().item() for k, t in b.items() if t.is_floating_point())


def test_every_python_block_of_the_page_is_in_a_section_run_here() -> None:
    _, sections = page()
    assert {name: len(blocks) for name, blocks in sections.items()} == SECTIONS


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda ema, model: ema.ema_model, AttributeError, r"ema.module"),
        (lambda ema, model: ema.model, AttributeError, r"ema.live_model.*ema.module"),
        (lambda ema, model: ema(torch.ones(2, 8)), TypeError, r"ema.module\(x\)"),
        (lambda ema, model: ema.step(model.parameters()), TypeError, r"ema\.update\(model\)"),
        (lambda ema, model: ema.update(model.parameters()), TypeError, r"must be an nn.Module, got generator"),
        (lambda ema, model: ema.update(model, step=2), ValueError, r"load_average"),
        (lambda ema, model: ema.store(model.parameters()), AttributeError, r"ema.average_weights\(model\)"),
        (lambda ema, model: ema.restore(model.parameters()), AttributeError, r"ema.average_weights\(model\)"),
        (lambda ema, model: ema.copy_to(model.parameters()), TypeError, r"must be an nn.Module, got generator"),
        (lambda ema, model: ema.optimization_step, AttributeError, r"ema.step .*ema.num_updates"),
        (lambda ema, model: ema.get_decay(5), AttributeError, r"ema.decay_at\(k\)"),
    ],
    ids=[
        "ema_model",
        "model",
        "ema(x)",
        "step(parameters)",
        "update(parameters)",
        "step=",
        "store",
        "restore",
        "copy_to",
        "counter",
        "decay",
    ],
)
def test_the_names_table_is_what_each_name_does(call: Any, error: type[Exception], message: str) -> None:
    """Each row of the page's table of names: what the peer's spelling does here, in one line naming ours."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    ema = EMA(model, decay=0.9)
    with pytest.raises(error, match=message) as raised:
        call(ema, model)
    assert "\n" not in str(raised.value)
    ema.update(model, step=1)  # timm's update(model, step=n) while n is ema.step + 1
    assert ema.step == 1


# -- timm -------------------------------------------------------------------------------------------------------


def load_alone(name: str, path: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The installed file ``path`` executed as module ``name`` (registered in ``sys.modules`` for the test)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def package(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    stand_in = ModuleType(name)
    stand_in.__path__ = []
    monkeypatch.setitem(sys.modules, name, stand_in)
    return stand_in


def timm_as_the_page_imports_it(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``timm.models`` (``load_checkpoint``), importable as the page imports it: timm itself where it imports, else
    the stand-ins of the module docstring; skipped where timm is not installed."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("timm not installed (pip install --no-deps timm==1.0.31)")
    try:
        importlib.import_module("timm.utils")
        return importlib.import_module("timm.models")
    except ImportError:  # torchvision missing or not loadable beside this torch
        pass
    base = next(iter(spec.submodule_search_locations))
    package("timm", monkeypatch)
    utils, models = package("timm.utils", monkeypatch), package("timm.models", monkeypatch)
    model_ema = load_alone("timm.utils.model_ema", f"{base}/utils/model_ema.py", monkeypatch)
    helpers = load_alone("timm.models._helpers", f"{base}/models/_helpers.py", monkeypatch)
    source = Path(f"{base}/utils/model.py").read_text()
    wanted = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    wanted = [n for n in wanted if n.name in ("unwrap_model", "get_state_dict")]
    model = package("timm.utils.model", monkeypatch)
    model.ModelEma = model_ema.ModelEma  # the one other name unwrap_model reads
    exec(compile(ast.Module(wanted, type_ignores=[]), f"{base}/utils/model.py", "exec"), model.__dict__)
    saver = load_alone("timm.utils.checkpoint_saver", f"{base}/utils/checkpoint_saver.py", monkeypatch)
    utils.ModelEmaV3, utils.CheckpointSaver = model_ema.ModelEmaV3, saver.CheckpointSaver
    models.load_checkpoint = helpers.load_checkpoint
    return models


def test_timm_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timm_models = timm_as_the_page_imports_it(monkeypatch)
    theirs, ours, saved, resumed, continued = run_section("timm", tmp_path, monkeypatch)
    ema, model = ours["ema"], ours["model"]
    # "equal bit for bit, BatchNorm statistics and num_batches_tracked included"
    assert same(theirs["average"], ours["average"]) and "1.num_batches_tracked" in ours["average"]
    # CheckpointSaver's file: timm's load_checkpoint(..., use_ema=True) loads the average, exactly
    assert same(saved["evaluated"].state_dict(), ema.module.state_dict())
    assert not same(model.state_dict(), ema.module.state_dict())  # not the live weights
    # the plain torch.save: resumed with the average, counters and schedule; timm's load_checkpoint reads it too
    assert same(resumed["resumed"].shadow, ema.shadow) and resumed["resumed"].step == ema.step == 100
    assert resumed["resumed"].num_updates == ema.num_updates
    plain = resumed["make_model"]()
    timm_models.load_checkpoint(plain, "train.pth.tar", use_ema=True)
    assert same(plain.state_dict(), ema.module.state_dict())
    # load_average of timm's average, with its step: what an uninterrupted EMA would hold
    assert same(continued["continued"].shadow, ema.shadow) and continued["continued"].num_updates == ema.num_updates
    # control: what CheckpointSaver saved before ema.module existed (unwrap_model then gave the EMA itself, whose
    # state_dict() went under state_dict_ema) does not load
    torch.save({"state_dict_ema": ema.state_dict()}, "before.pth.tar")
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict"):
        timm_models.load_checkpoint(plain, "before.pth.tar", use_ema=True)


def test_timms_resume_into_ema_module_is_refused_naming_load_average(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timm_models = timm_as_the_page_imports_it(monkeypatch)
    ours, saved = run_section("timm", tmp_path, monkeypatch)[1:3]
    ema_class, schedule, model = ours["EMA"], ours["timm_schedule"], saved["model"]
    fresh = ema_class(model, **schedule(decay=0.99))
    before = {name: t.clone() for name, t in fresh.shadow.items()}
    with pytest.raises(RuntimeError, match=r"^ema.module.load_state_dict would replace the average without its"):
        timm_models.load_checkpoint(fresh.module, "checkpoints/last.pth.tar", use_ema=True)  # timm's train.py resume
    assert same(fresh.shadow, before) and fresh.step == 0
    fresh._module._load_state_dict_pre_hooks.clear()  # the control: the load let through, the counters left at 0
    timm_models.load_checkpoint(fresh.module, "checkpoints/last.pth.tar", use_ema=True)
    assert same(fresh.shadow, saved["ema"].shadow) and fresh.step == 0
    fresh.update(model)  # the warm-up's first update copies the live weights over the average
    assert same(fresh.shadow, model.state_dict())


# -- diffusers --------------------------------------------------------------------------------------------------


def test_diffusers_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("diffusers")
    theirs, ours, continued, exported = run_section("diffusers", tmp_path, monkeypatch)
    model = ours["model"]
    shadow = {name: t for (name, _), t in zip(model.named_parameters(), theirs["ema_model"].shadow_params, strict=True)}
    # "under 1e-6 on this example (1.2e-07 measured)": float32 rounding
    assert 0 < largest_difference(shadow, ours["ema"].shadow) < 1e-6
    assert torch.allclose(theirs["scores"], ours["scores"], rtol=0, atol=1e-6)
    # the diffusers EMA continued here: its average and its count
    ema, unet_ema = continued["ema"], continued["ema_unet"]
    named = {name: t for (name, _), t in zip(continued["unet"].named_parameters(), unet_ema.shadow_params, strict=True)}
    assert same(dict(ema.shadow), named) and (ema.step, ema.num_updates) == (3, 3)
    # save_pretrained of ema.module, from_pretrained: the average bit for bit; ema.export() the same
    average = ema.module.state_dict()
    assert same(exported["average_unet"].state_dict(), average)
    assert not same(continued["unet"].state_dict(), average)  # not the live weights
    ema.export().save_pretrained("unet_export")
    assert same(type(continued["unet"]).from_pretrained("unet_export").state_dict(), average)


# -- ema-pytorch ------------------------------------------------------------------------------------------------


def test_ema_pytorch_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ema_pytorch")
    theirs, ours, loaded, posthoc, power, continued = run_section("ema-pytorch", tmp_path, monkeypatch)
    # "under 1e-5", and num_batches_tracked never written into ema-pytorch's average
    assert largest_difference(theirs["average"], ours["average"]) < 1e-5
    assert theirs["average"]["1.num_batches_tracked"] == 0 < ours["average"]["1.num_batches_tracked"] == 96  # call 95's
    # ema-pytorch's saved state loaded with its step: ema-pytorch's average, as saved
    saved = torch.load(tmp_path / "ema_pytorch.pt", weights_only=True)
    weights = {name: saved[f"ema_model.{name}"] for name in loaded["ema"].shadow}
    assert same(dict(loaded["ema"].shadow), weights) and loaded["ema"].num_updates == ours["ema"].num_updates
    # PowerEMA + synthesize: the average of sigma_rel 0.15 loaded into a model; the snapshots it came from
    assert sorted(p.name for p in (tmp_path / "power_ema").iterdir()) == [
        f"power-ema-{step:09d}.pt" for step in (25, 50, 75, 100)
    ]
    assert same(power["evaluated"].state_dict(), power["average"])
    assert not same(power["average"], power["model"].state_dict())
    # the PostHocEMA state continued here: its profiles, one step later
    profiles = continued["continued"].profiles
    state = posthoc["posthoc_state"]
    for i, profile in enumerate(profiles):
        assert same(dict(profile), {name: state[f"ema_models.{i}.ema_model.{name}"] for name in profile})


# -- Lightning --------------------------------------------------------------------------------------------------


def test_lightning_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning.pytorch")
    _, ours = run_section("Lightning", tmp_path, monkeypatch)
    theirs, mine = ours["theirs"].net.state_dict(), ours["ours"].net.state_dict()
    # both modules end holding their average, within float32 rounding of each other
    assert largest_difference(theirs, mine) < 1e-5
    # Lightning averages the integer counter and truncates it; ours is the live count
    assert theirs["1.num_batches_tracked"] < mine["1.num_batches_tracked"] == 50


# -- torchtitan ---------------------------------------------------------------------------------------------------


def test_torchtitan_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (names,) = run_section("torchtitan", tmp_path, monkeypatch)
    ema, model = names["ema"], names["model"]
    # its decay at firing n is 2 ** (-1 / (0.05 * n)), from the first step, which does not copy
    assert [ema.decay_at(k) for k in range(100)] == [2.0 ** (-1.0 / (0.05 * n)) for n in range(1, 101)]
    # the parameters that require grad, no buffer
    assert sorted(ema.shadow) == sorted(name for name, _ in model.named_parameters())


# -- stable-baselines3 ------------------------------------------------------------------------------------------


def test_stable_baselines3_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("stable_baselines3")
    theirs, ours = run_section("stable-baselines3", tmp_path, monkeypatch)
    q_net, target = ours["q_net"], ours["target"]
    theirs_target = dict(theirs["q_net_target"].named_parameters())
    # "under 1e-6 on this example (8.3e-07 measured)": float32 rounding
    assert 0 < largest_difference(theirs_target, dict(target.named_parameters())) < 1e-6
    # stable-baselines3's order with a target from make_target: refused, nothing written
    before = copy.deepcopy(q_net.state_dict())
    with pytest.raises(ValueError, match=r"the arguments look reversed"):
        soft_update(q_net, target, tau=0.005)
    with pytest.raises(TypeError, match=r"pass the module itself, not its parameters\(\)"):
        soft_update(target.parameters(), q_net.parameters(), tau=0.005)
    assert same(q_net.state_dict(), before)
    # with stable-baselines3's trainable copy as the target, nothing tells the order: the online network is written
    their_q_net = theirs["q_net"]
    assert same(their_q_net.state_dict(), q_net.state_dict())  # the same training on both sides
    soft_update(their_q_net, theirs["q_net_target"], tau=0.005)
    assert not same(their_q_net.state_dict(), q_net.state_dict())
