"""One rename, everywhere: no file of the checkout (code, configs, docs, CI) names a module or path that moved when
the package got a name of its own: the ``components`` package, the flat ``tests/test_*.py`` files and
``tests/scripts/``, the tools that were in ``scripts/``, the data modules that were beside the recipes; and the
callbacks named with a ``Callback`` suffix, now named for what they do as Lightning's are. Each old
form is given with the text that replaced it, and the control shows each old form caught in a file of its kind."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

MATHS = "solve_coefficients|sigma_rel_to_gamma|gamma_to_sigma_rel"
# An old name (a regular expression) and what a reader should find instead.
RETIRED = {
    r"\bcomponents[./][A-Za-z_]": "copy_correct (copy_correct.lightning, copy_correct.probes)",
    r"\b(?:from|import)\s+components\b": "copy_correct",
    r"_target_:\s*components\b": "copy_correct",
    r"\bscripts[./](?:bench_|figure|gpu_check|docs_hooks)": "benchmarks/, tools/manual/, tools/gpu_check/",
    r"\btests/(?:test_\w+\.py|scripts/)|\btests\.(?:test_\w+|scripts)\b": "tests/<layer>/test_*.py, tests/workers/",
    r"\brecipes[./](?:digits|image_folder)\b": "recipes/data/",
    r"\b(?:PostHocEMA|EMA|GraphRetention)Callback\b": "PostHocEMASnapshots, EMAWeights, GraphRetentionCheck",
    r"\b(?:posthoc_)?ema_callback\b": "copy_correct/lightning/ema_weights.py, posthoc_ema_snapshots.py",
    # The maths helpers left the top level for their submodule (synthesis_coefficients came up beside synthesize).
    rf"\bcopy_correct\.(?:{MATHS})\b": "copy_correct.averages.power_function",
    rf"\bfrom\s+copy_correct\s+import\s+(?:\([\w\s,]*|[\w ,]*)\b(?:{MATHS})\b": "copy_correct.averages.power_function",
}
TEXT = (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ".js", ".css", ".html")
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()
# The packaging test imports a user's own `components` package on purpose: the name ours must not take.
EXEMPT = {THIS_FILE, "tests/package/test_packaging.py"}


def stale_names(root: Path, files: list[str]) -> list[str]:
    """``path:line: old name (now: new)`` for each retired name found in ``files`` under ``root``."""
    found = []
    for relative in files:
        text = (root / relative).read_text(errors="replace")
        for pattern, now in RETIRED.items():
            for match in re.finditer(pattern, text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{relative}:{line}: {match[0]!r} (now: {now})")
    return found


def tracked_text_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    names = listed.stdout.splitlines()
    return [n for n in names if (n.endswith(TEXT) or "/" not in n or n.startswith(".ci/")) and (ROOT / n).is_file()]


def test_no_file_names_a_retired_module_or_path() -> None:
    files = [f for f in tracked_text_files() if f not in EXEMPT]
    assert {"README.md", "pyproject.toml", "mkdocs.yml", "conf/recipe/ema.yaml", ".ci/run"} <= set(files)
    assert stale_names(ROOT, files) == []


CONTROLS = [
    ("recipes/x.py", "from components import EMA\n"),
    ("tools/x.py", "import components.probes\n"),
    ("conf/recipe/x.yaml", "callbacks:\n  ema:\n    _target_: components.EMAWeights\n"),
    ("docs/x.md", "See [the EMA](../components/ema.py).\n"),
    ("docs/x.md", "Run `python scripts/bench_ema.py`.\n"),
    ("mkdocs.yml", "hooks:\n  - scripts/docs_hooks.py\n"),
    ("docs/x.md", "Proven in [a test](../tests/test_ema.py).\n"),
    ("tests/x.py", 'WORKER = "tests/scripts/ddp_ema.py"\n'),
    ("conf/data/x.yaml", "_target_: recipes.digits.DigitsDataModule\n"),
    ("recipes/x.py", "from copy_correct.lightning import EMACallback\n"),
    ("conf/recipe/x.yaml", "_target_: copy_correct.lightning.GraphRetentionCallback\n"),
    ("docs/x.md", "[the callback](../copy_correct/lightning/posthoc_ema_callback.py)\n"),
    ("tests/x.py", "from copy_correct import PowerEMA, solve_coefficients\n"),
    ("tests/x.py", "from copy_correct import (\n    EMA,\n    sigma_rel_to_gamma,\n)\n"),
    ("docs/x.md", "::: copy_correct.gamma_to_sigma_rel\n"),
]


@pytest.mark.parametrize(("path", "text"), CONTROLS, ids=[text.strip() for _, text in CONTROLS])
def test_control_each_retired_form_is_caught(path: str, text: str, tmp_path: Path) -> None:
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(f"A line about other things: components, tests, recipes.\n{text}")
    found = stale_names(tmp_path, [path])
    assert found and not any(f.startswith(f"{path}:1: ") for f in found)


def test_control_the_new_names_and_the_plain_word_pass(tmp_path: Path) -> None:
    (tmp_path / "x.md").write_text(
        "Small components whose copies are proven. `from copy_correct import EMA`; `recipes/data/digits.py`;\n"
        "`python -m benchmarks.ema`; [a test](tests/parts/test_ema.py); `tests/workers/ddp_ema.py`.\n"
        "`from copy_correct.averages.power_function import sigma_rel_to_gamma, solve_coefficients`; "
        "`synthesis_coefficients`.\n"
    )
    assert stale_names(tmp_path, ["x.md"]) == []
