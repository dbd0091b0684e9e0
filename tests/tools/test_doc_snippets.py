"""Every ```python block of the README and the manual (``docs/**/*.md``) compiles, uses only names it defines, and runs
where it stands alone. An HTML comment on the line before the fence says otherwise (several: ``; ``):

* ``<!-- fragment -->``: an excerpt of a larger program (``buffer``, ``model`` come from the prose): compiled only.
* ``<!-- continues -->``: one program with the page's previous python block, whose names it may use.
* ``<!-- run by tests/PATH.py -->``: that test runs it against what it needs (a recipe's trained run, the peers
  installed); here it is compiled and its names checked, and PATH must exist.

A name is defined when the block (or the program so far) imports or assigns it, defines it with ``def``/``class``, or
it is a builtin (``ast``'s ``symtable``: a function's globals too). The rest run in one subprocess, each program in a
fresh copy of a folder holding a real run of a plain Lightning ``Trainer`` (a small ``MyModule`` in ``my_project.py``
with ``PostHocEMASnapshots``: ``lightning_logs/version_0/``); the API page's post-hoc snippet is checked against
``synthesize`` and the command there. Blocks quoted from files (``--8<--``) are those files' own. The controls: the
post-hoc snippet as it was (``synthesize`` and ``torch`` never imported) fails the name check and, run, raises
``NameError``; a syntax error, an unknown marker, a missing ``run by`` file and a ``continues`` with nothing before it
are reported."""

from __future__ import annotations

import builtins
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import symtable
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from copy_correct import synthesize
from copy_correct.cli import main

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,})\s*(?P<info>.*)$")
PYTHON = re.compile(r"^(?:python|py)\b|\{[^}]*\.(?:python|py)\b")
COMMENT = re.compile(r"^\s*<!--\s*(?P<text>.*?)\s*-->\s*$")
RUN_BY = "run by "
BUILTINS = set(dir(builtins)) | {"__name__", "__file__"}
# The API page's post-hoc snippet as it was: what the control checks and runs.
OLD_POSTHOC = """from copy_correct import load_checked

checkpoint = load_checked("RUN_DIR/checkpoints/last.ckpt")  # digests checked, then torch.load(weights_only=True)
checkpoint["state_dict"].update(synthesize("RUN_DIR", sigma_rel=0.08))  # the averaged entries
torch.save(checkpoint, "ema.ckpt")
model = MyModule.load_from_checkpoint("ema.ckpt")
"""
MY_PROJECT = '''"""A user's LightningModule, as the docs' ``from my_project import MyModule`` means it."""

import lightning.pytorch as pl
import torch
from torch import nn


class MyModule(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)
'''
STEPS = 10  # 2 epochs of 5 batches: snapshots at steps 4 and 8, and the fit's final one at 10
LAST = f"epoch=1-step={STEPS}.ckpt"  # what Lightning's default ModelCheckpoint keeps


@dataclass(frozen=True)
class Block:
    page: str  # relative to the root
    line: int  # the opening fence's, from 1
    source: str
    markers: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def run_by(self) -> str | None:
        return next((m.removeprefix(RUN_BY) for m in self.markers if m.startswith(RUN_BY)), None)


Ran = tuple[list[list[Block]], list[dict[str, str]], Path]  # the programs run, their outcomes, the workspace


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def blocks_of(page: Path, root: Path) -> list[Block]:
    """The page's python blocks, in order, with the markers of the comment on the line before each."""
    lines, found, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        close = re.compile(rf"^{fence['indent']}{fence['ticks']}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), len(lines))
        body = [line[len(fence["indent"]) :] for line in lines[i + 1 : end]]
        quoted = bool(body) and body[0].startswith("--8<--")
        if PYTHON.search(fence["info"]) and not quoted:
            comment = COMMENT.match(lines[i - 1]) if i else None
            markers = tuple(m.strip() for m in comment["text"].split(";")) if comment else ()
            found.append(Block(str(page.relative_to(root)), i + 1, "\n".join(body) + "\n", markers))
        i = end + 1
    return found


def programs(blocks: list[Block]) -> list[list[Block]]:
    """The blocks grouped into programs: a ``continues`` block joins the one before it on its page."""
    grouped: list[list[Block]] = []
    for block in blocks:
        if "continues" in block.markers and grouped and grouped[-1][-1].page == block.page:
            grouped[-1].append(block)
        else:
            grouped.append([block])
    return grouped


def bound_names(source: str) -> set[str]:
    """The names a module-level program binds: imports, assignments, ``def`` and ``class``."""
    table = symtable.symtable(source, "<block>", "exec")
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}


def used_globals(source: str) -> set[str]:
    """Every global name the program reads: at module level, and in its functions, classes and comprehensions."""
    used, tables = set(), [symtable.symtable(source, "<block>", "exec")]
    while tables:
        table = tables.pop()
        top = table.get_type() == "module"
        used |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and (top or s.is_global())}
        tables += table.get_children()
    return used


def problems(root: Path) -> list[str]:
    """What is wrong with the python blocks of the pages under ``root`` (module docstring), one line each."""
    found = []
    for page in pages(root):
        for program in programs(blocks_of(page, root)):
            defined = set(BUILTINS)
            for index, block in enumerate(program):
                unknown = [m for m in block.markers if m not in ("fragment", "continues") and not m.startswith(RUN_BY)]
                if unknown:
                    found.append(f"{block.where}: unknown marker {unknown[0]!r}")
                if "continues" in block.markers and index == 0:
                    found.append(f"{block.where}: marked continues, with no python block before it on the page")
                if block.run_by is not None and not (root / block.run_by).is_file():
                    found.append(f"{block.where}: run by {block.run_by}, which does not exist")
                try:
                    compile(block.source, block.where, "exec")
                except SyntaxError as error:
                    found.append(f"{block.where}: does not compile: {error.msg} (its line {error.lineno})")
                    continue
                if "fragment" not in block.markers:
                    missing = sorted(used_globals(block.source) - defined - bound_names(block.source))
                    if missing:
                        found.append(f"{block.where}: uses {', '.join(missing)}, which it neither imports nor assigns")
                defined |= bound_names(block.source)
    return found


def runs_here(program: list[Block]) -> bool:
    return not any("fragment" in b.markers or b.run_by is not None for b in program)


def test_every_block_compiles_and_uses_only_names_it_defines() -> None:
    assert problems(ROOT) == []


def test_control_an_undefined_name_a_syntax_error_and_bad_markers_are_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    fence = "```"
    (tmp_path / "README.md").write_text(f"Text.\n\n{fence}python\n{OLD_POSTHOC}{fence}\n")
    (tmp_path / "docs" / "page.md").write_text(
        f"<!-- fragment -->\n{fence}python\nbuffer.add(obs)\n{fence}\n\n"  # an excerpt: names not checked
        f'{fence} {{ .python title="a.py" }}\nimport torch\ndef f():\n    return torch.ones(2) + numpy\n{fence}\n\n'
        f"<!-- continues -->\n{fence}python\ny = f() + torch.zeros(2)\n{fence}\n\n"  # names of the block before
        f"<!-- run by tests/nowhere.py; fragmant -->\n{fence}python\nx = (\n{fence}\n"
    )
    (tmp_path / "docs" / "first.md").write_text(f"<!-- continues -->\n{fence}python\nz = 1\n{fence}\n")
    assert problems(tmp_path) == [
        "README.md:3: uses MyModule, synthesize, torch, which it neither imports nor assigns",
        "docs/first.md:2: marked continues, with no python block before it on the page",
        "docs/page.md:6: uses numpy, which it neither imports nor assigns",
        "docs/page.md:18: unknown marker 'fragmant'",
        "docs/page.md:18: run by tests/nowhere.py, which does not exist",
        "docs/page.md:18: does not compile: '(' was never closed (its line 1)",
    ]


def run_programs(plan: Path, results: Path) -> None:
    """The subprocess: build the workspace (a plain ``Trainer``'s run), then run each program of ``plan`` in a fresh
    copy of it, writing each one's outcome (``ok``, or the error's last line) to ``results``."""
    spec = json.loads(plan.read_text())
    workspace = Path(spec["workspace"])
    make_workspace(workspace)
    outcomes = []
    for index, program in enumerate(spec["programs"]):
        folder = Path(spec["runs"]) / f"{index:02d}"
        shutil.copytree(workspace, folder)
        for source, target in program.get("copies", []):  # what the program expects beside the run
            copy = shutil.copytree if (folder / source).is_dir() else shutil.copy2
            copy(folder / source, folder / target)
        os.chdir(folder)
        names: dict[str, object] = {"__name__": "__main__"}
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                for where, source in zip(program["where"], program["sources"], strict=True):
                    exec(compile(source, where, "exec"), names)
            outcomes.append({"folder": str(folder), "outcome": "ok"})
        except Exception as error:  # the block's own failure, reported as the reader would see it
            frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename in program["where"]]
            at = f"{frames[-1].filename}, its line {frames[-1].lineno}: " if frames else ""
            outcomes.append({"folder": str(folder), "outcome": f"{at}{type(error).__name__}: {error}"})
    results.write_text(json.dumps(outcomes))


def make_workspace(folder: Path) -> None:
    """``my_project.py`` and a run of ``MyModule`` by a plain ``Trainer`` (its default logger and checkpointing) with
    ``PostHocEMASnapshots``, in ``folder``: ``lightning_logs/version_0/checkpoints/`` as Lightning lays it out."""
    folder.mkdir(parents=True)
    (folder / "my_project.py").write_text(MY_PROJECT)
    os.chdir(folder)
    sys.path.insert(0, "")  # my_project, from the working directory, as `python` run there finds it
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from copy_correct.lightning import PostHocEMASnapshots

    my_module = importlib.import_module("my_project").MyModule
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, callbacks=[PostHocEMASnapshots(snapshot_every=4)],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(my_module(), DataLoader(data, batch_size=8))


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """Every program that runs here, then the control (the old post-hoc snippet), in one subprocess: the programs,
    their outcomes, and the workspace."""
    base = tmp_path_factory.mktemp("snippets")
    here = [p for page in pages(ROOT) for p in programs(blocks_of(page, ROOT)) if runs_here(p)]
    control = [Block("old-posthoc-snippet", 1, OLD_POSTHOC, ())]
    listed = [{"where": [b.where for b in p], "sources": [b.source for b in p]} for p in [*here, control]]
    version = "lightning_logs/version_0"  # the control's RUN_DIR, laid out as a recipe's: its last.ckpt is there
    listed[-1]["copies"] = [[version, "RUN_DIR"], [f"{version}/checkpoints/{LAST}", "RUN_DIR/checkpoints/last.ckpt"]]
    plan = {"workspace": str(base / "workspace"), "runs": str(base / "runs"), "programs": listed}
    (base / "plan.json").write_text(json.dumps(plan))
    command = [sys.executable, "-m", "tests.tools.test_doc_snippets", str(base / "plan.json"), str(base / "out.json")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [*here, control], json.loads((base / "out.json").read_text()), base / "workspace"


def test_every_block_that_stands_alone_runs(ran: Ran) -> None:
    programs_run, outcomes, _ = ran
    failed = {
        p[0].where: o["outcome"] for p, o in zip(programs_run, outcomes[:-1], strict=False) if o["outcome"] != "ok"
    }
    assert failed == {}
    assert {p[0].page for p in programs_run} >= {"README.md", "docs/api.md", "docs/copy-atlas.md"}  # not vacuous
    # The control: the snippet as it was stops at its first unimported name.
    said = "old-posthoc-snippet:1, its line 4: NameError: name 'synthesize' is not defined"
    assert outcomes[-1]["outcome"] == said


def test_the_api_pages_posthoc_snippet_gives_the_synthesized_weights_of_a_plain_trainers_run(
    ran: Ran, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plain ``Trainer`` lays out ``lightning_logs/version_0/checkpoints/epoch=1-step=10.ckpt`` and the callback's
    snapshots in ``checkpoints/power_ema/``; the snippet's ``ema.ckpt`` holds ``synthesize`` of that directory, and so
    does what the command writes there. The control: the run's own checkpoint holds other (live) weights."""
    programs_run, outcomes, workspace = ran
    (folder,) = [o["folder"] for p, o in zip(programs_run, outcomes, strict=True) if p[0].where.startswith("docs/api")
                 and "ema.ckpt" in p[0].source]  # fmt: skip
    run = workspace / "lightning_logs" / "version_0"
    assert [p.name for p in (run / "checkpoints").glob("*.ckpt")] == [LAST]
    assert sorted(p.name for p in (run / "checkpoints" / "power_ema").iterdir()) == [
        f"power-ema-{step:09d}.pt" for step in (4, 8, STEPS)
    ]
    average = synthesize(run, sigma_rel=0.08)
    snippet = torch.load(Path(folder) / "ema.ckpt", weights_only=True)["state_dict"]
    assert snippet.keys() == average.keys() and all(torch.equal(snippet[k], v) for k, v in average.items())

    assert main(["posthoc", str(run), "--sigma-rel", "0.08"]) == 0  # the command, given the same directory
    (written,) = capsys.readouterr().out.split()
    command = torch.load(written, weights_only=True)["state_dict"]
    assert all(torch.equal(command[k], v) for k, v in average.items())

    live = torch.load(run / "checkpoints" / LAST, weights_only=True)["state_dict"]
    assert not torch.equal(live["net.0.weight"], snippet["net.0.weight"])


if __name__ == "__main__":  # the subprocess of ``ran``
    run_programs(Path(sys.argv[1]), Path(sys.argv[2]))
