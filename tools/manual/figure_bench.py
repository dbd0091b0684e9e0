"""Charts of the benchmark tables: every ratio column of a section of ``docs/benchmarks.md``, drawn from the table as
the bench script wrote it, into the figure block beside it.

A benchmark redraws its section's chart when it rewrites the section (``benchmarks.report.write_section``);
``python -m tools.manual.figures benchmarks`` redraws them all. The block records a digest of the tables it was drawn
from, so a test can tell a chart that no longer matches its table.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from tools.manual.figure_pages import figure_blocks, save_figure

if TYPE_CHECKING:
    from tools.manual.figures import Context

Tables = dict[str, dict[str, dict[str, str]]]  # {caption: {row label: {column: cell}}}
_SECTION = re.compile(r"<!-- (?P<key>[\w-]+):start -->\n## (?P<title>[^\n]+)\n(?P<body>.*?)<!-- (?P=key):end -->", re.S)
_RATIO_COLUMN = re.compile(r"/ (ours|bare loader|prefetcher)$|\(/ N=1\)$")
OURS, PEER, FLOOR = "#4c72b0", "#dd8452", "#a0a0a0"
COLUMN_COLOURS = ("#dd8452", "#55a868", "#8172b3", "#c44e52")
_FLOORS = ("bare ", "plain copy", "floor", "list of ready", "candidate", "one _foreach")
_OURS = ("copy_correct.", "ours", "DevicePrefetcher", "DeviceDataLoader")


def chart_name(key: str) -> str:
    return f"bench-{key}"


def sections(markdown: str) -> dict[str, tuple[str, str]]:
    """The sections a bench script wrote: {key: (title, body)}."""
    return {m["key"]: (m["title"], m["body"]) for m in _SECTION.finditer(markdown)}


def read_section_tables(markdown: str, key: str) -> tuple[str, Tables]:
    """Section ``key``'s text (its paragraphs that are no table, no table caption and no figure) and its tables. A
    table without a bold caption before it takes the section's title; a row whose first cell repeats in its table is
    labelled by its first two cells."""
    title, body = sections(markdown)[key]
    body = re.sub(r"<!-- figure:.*?:end -->", "", body, flags=re.S)
    paragraphs = [p.strip() for p in body.split("\n\n") if p.strip()]
    text = "\n\n".join(p for p in paragraphs if not p.startswith(("|", "**")))
    tables: Tables = {}
    caption = title
    for paragraph in paragraphs:
        if paragraph.startswith("**") and "**" in paragraph[2:]:
            caption = paragraph[2 : paragraph.index("**", 2)]
        if "\n|" not in "\n" + paragraph:
            continue
        lines = [line for line in paragraph.splitlines() if line.startswith("|")]
        columns = [cell.strip() for cell in lines[0].strip("|").split("|")]
        rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
        firsts = [row[0] for row in rows]
        table = tables.setdefault(caption, {})
        for row in rows:
            second = f"{columns[1]}={row[1]}" if len(columns[1]) <= 3 else row[1]  # "N=2", or the cell itself
            label = row[0] if firsts.count(row[0]) == 1 else f"{row[0]}, {second}"
            table[label] = dict(zip(columns, row, strict=True))
        caption = title
    return text, tables


def digest(tables: Tables) -> str:
    return hashlib.sha1(repr(sorted((k, sorted(v.items())) for k, v in tables.items())).encode()).hexdigest()[:12]


def recorded_digest(markdown: str, key: str) -> str | None:
    """The digest of the tables that section ``key``'s chart was drawn from, as its block records it."""
    found = re.search(r"<!-- tables ([0-9a-f]+) -->", figure_blocks(markdown).get(chart_name(key), ""))
    return found[1] if found else None


def _ratio(cell: str, column: str) -> float | None:
    found = re.search(r"\(([\d.]+)\)", cell) if column.endswith("(/ N=1)") else re.match(r"([\d.,]+)x?$", cell)
    return float(found[1].replace(",", "")) if found else None


def _colour(label: str) -> str:
    if label.startswith(_OURS) or ": ours" in label or ", ours" in label:
        return OURS
    return FLOOR if any(word in label for word in _FLOORS) else PEER


def ratio_panels(tables: Tables) -> list[tuple[str, list[str], dict[str, list[float | None]]]]:
    """Per table with ratio columns: (caption, row labels, {column: value per row})."""
    panels = []
    for caption, rows in tables.items():
        columns = [c for c in next(iter(rows.values()), {}) if _RATIO_COLUMN.search(c)]
        if columns:
            labels = list(rows)
            panels.append((caption, labels, {c: [_ratio(rows[label][c], c) for label in labels] for c in columns}))
    return panels


def draw_section_chart(docs: Path, page: str, key: str, made_by: str) -> Path | None:
    """Chart section ``key`` of ``docs/PAGE`` into its figure block; ``None`` when its tables have no ratio column.
    ``made_by`` is the provenance sentence for the caption."""
    markdown = (docs / page).read_text()
    title, _ = sections(markdown)[key]
    _, tables = read_section_tables(markdown, key)
    panels = ratio_panels(tables)
    if not panels:
        return None
    heights = [0.9 + 0.24 * len(labels) * (1 + 0.6 * (len(values) - 1)) for _, labels, values in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8.5, sum(heights)), height_ratios=heights, squeeze=False)
    for ax, (caption, labels, values) in zip(axes[:, 0], panels, strict=True):
        _panel(ax, caption, labels, values)
    fig.tight_layout()
    columns = sorted({c for _, _, values in panels for c in values})
    return save_figure(
        fig, docs, page, chart_name(key),
        f"Chart of the ratio columns of the {title} tables",
        f"The tables' ratio columns ({', '.join(f'`{c}`' for c in columns)}) as bars, on a log scale; the line at 1 is "
        "the reference of each column. Dark: ours; orange and other colours: peers; grey: floors and candidates. "
        + made_by,
        extra=f"<!-- tables {digest(tables)} -->\n",
    )  # fmt: skip


def _panel(ax: plt.Axes, caption: str, labels: list[str], values: dict[str, list[float | None]]) -> None:
    many = len(values) > 1
    height = 0.8 / len(values)
    found = [v for column in values.values() for v in column if v]
    for i, (column, column_values) in enumerate(values.items()):
        for row, (label, value) in enumerate(zip(labels, column_values, strict=True)):
            if value is None:
                continue
            y = row + (i - (len(values) - 1) / 2) * height
            colour = COLUMN_COLOURS[i % len(COLUMN_COLOURS)] if many else _colour(label)
            ax.barh(y, value, height=height * 0.9, color=colour, label=column if many and row == 0 else None)
            ax.text(value * 1.04, y, f"{value:.2f}x", va="center", fontsize=7)
    ax.set_xscale("log")
    low, high = min([*found, 1.0]), max([*found, 1.0])
    ax.set_xlim(low / 1.5, high * 2.2)  # room for the value beside the longest bar
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(labels)), [label if len(label) <= 60 else label[:57] + "..." for label in labels])
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7.5)
    ax.grid(axis="y", visible=False)
    ax.set_title(caption, loc="left", fontsize=9)
    if many:  # below the axis, where no bar can be
        ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(0, -0.12), ncol=len(values), frameon=False)
    else:
        ax.set_xlabel(f"{next(iter(values))} (log scale)")


DQN_LOOP = "dqn-loop-cpu"  # the section of benchmarks.md the DQN page's chart is drawn from
DQN_LOOP_COLUMNS = {  # the tables' ratio columns, as the chart names them
    "loop: stable-baselines3 / ours": "the loop's steps/s",
    "add: stable-baselines3 / ours": "add",
    "add after a forward: stable-baselines3 / ours": "add after a forward",
    "sample: stable-baselines3 / ours": "sample(32)",
}


def dqn_loop_figure(docs: Path, made_by: str) -> Path | None:
    """The DQN page's chart (block ``dqn-loop`` of ``recipes/dqn.md``): the ratios to stable-baselines3 of section
    ``dqn-loop-cpu`` of ``benchmarks.md`` (``python -m benchmarks.dqn_loop``), a group of bars per buffer; ``None``
    where the manual has no such section or block, or the section no ratio (stable-baselines3 not run)."""
    markdown, page = (docs / "benchmarks.md").read_text(), docs / "recipes" / "dqn.md"
    if DQN_LOOP not in sections(markdown) or not page.is_file() or "dqn-loop" not in figure_blocks(page.read_text()):
        return None
    _, tables = read_section_tables(markdown, DQN_LOOP)
    columns: dict[str, dict[str, float]] = {}
    for caption in tables.values():
        for label, row in caption.items():
            for column, name in DQN_LOOP_COLUMNS.items():
                value = _ratio(row.get(column, ""), column)
                if value is not None:
                    columns.setdefault(name, {})[label] = value
    shown = {label for values in columns.values() for label in values}
    labels = list(dict.fromkeys(label for rows in tables.values() for label in rows if label in shown))
    if not labels:
        return None
    fig, ax = plt.subplots(figsize=(8.5, 0.9 + 0.9 * len(labels)))
    width = 0.84 / len(columns)
    for i, (name, values) in enumerate(columns.items()):
        for row, label in enumerate(labels):
            if label not in values:
                continue
            y = row + (i - (len(columns) - 1) / 2) * width
            ax.barh(y, values[label], height=width * 0.9, label=name if row == 0 else None,
                    color=("#4c72b0", "#dd8452", "#c9a227", "#55a868")[i % 4])  # fmt: skip
            ax.text(values[label] * 1.01, y, f"{values[label]:.2f}x", va="center", fontsize=7)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(0.95, color="#c44e52", lw=0.8, ls="--", label="0.95x (issue 43's floor for the loop)")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("stable-baselines3's time / ours (above 1: faster than stable-baselines3)")
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(0, -0.25), ncol=2, frameon=False)
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    caption = (
        "CleanRL's dqn_atari.py loop on recorded Pong frames with each buffer: its steps a second, and its add and "
        "sample(32) timed alone, each as stable-baselines3's time over its own (the tables of "
        f"benchmarks.md's section {DQN_LOOP}). "
    )
    alt = "The DQN loop's speed, add and sample against stable-baselines3"
    return save_figure(fig, docs, "recipes/dqn.md", "dqn-loop", alt, caption + made_by,
                       extra=f"<!-- tables {digest(tables)} -->\n")  # fmt: skip


# Dopamine's circular replay (TF/JAX, not run here) keeps one frame a transition with an int32 action, a float32
# reward and a uint8 terminal: its bytes per transition are computed from that layout, and said to be.
DOPAMINE_BYTES = 84 * 84 + 4 + 4 + 1
LAYOUTS = {  # the Pong memory table's rows (section frame-replay-cpu), as the chart names them
    "stable-baselines3 2.9.2 ReplayBuffer": "stable-baselines3",
    "stable-baselines3 2.9.2 ReplayBuffer(optimize_memory_usage=True)": "stable-baselines3, optimize_memory_usage",
    "torchrl 0.14.1 ReplayBuffer(LazyTensorStorage)": "TorchRL",
    "copy_correct.FrameReplayBuffer": "ours",
}
LOOP_ROWS = {  # the loop table's rows (section dqn-loop-cpu)
    "stable-baselines3 2.9.2 ReplayBuffer": "stable-baselines3",
    "copy_correct.FrameReplayBuffer": "ours",
    'copy_correct.FrameReplayBuffer(compress="zstd") + SampleAhead': "ours, zstd",  # compressed: sampled ahead
    'copy_correct.FrameReplayBuffer(compress="zstd", prioritized=True) + SampleAhead': "ours, zstd, prioritized",
}
PRIORITIZED_ROWS = {  # the million compressed Pong transitions (section prioritized-cpu)
    'FrameReplayBuffer(compress="zstd")': "ours, zstd",
    'FrameReplayBuffer(compress="zstd", prioritized=True)': "ours, zstd, prioritized",
}


def replay_layouts_figure(docs: Path, made_by: str) -> Path | None:
    """The DQN page's chart of the Atari replays (block ``replay-layouts`` of ``recipes/dqn.md``): bytes per Pong
    transition (sections ``frame-replay-cpu`` and ``prioritized-cpu`` of ``benchmarks.md``; Dopamine's computed from
    its layout) and CleanRL's loop's steps a second against stable-baselines3's (``dqn-loop-cpu``); ``None`` where a
    section or the block is missing."""
    markdown, page = (docs / "benchmarks.md").read_text(), docs / "recipes" / "dqn.md"
    found = sections(markdown)
    needed = ("frame-replay-cpu", "prioritized-cpu", DQN_LOOP)
    if any(key not in found for key in needed) or "replay-layouts" not in figure_blocks(page.read_text()):
        return None
    memory = read_section_tables(markdown, "frame-replay-cpu")[1].get("Memory per transition", {})
    million = next((t for c, t in read_section_tables(markdown, "prioritized-cpu")[1].items() if "Pong" in c), {})
    loop = next(iter(read_section_tables(markdown, DQN_LOOP)[1].values()), {})
    sizes = {name: _ratio(memory[row]["Pong: bytes per transition"], "") for row, name in LAYOUTS.items()
             if row in memory}  # fmt: skip
    sizes |= {name: _ratio(million[row]["bytes per transition"], "") for row, name in PRIORITIZED_ROWS.items()
              if row in million}  # fmt: skip
    speeds = {name: _ratio(loop[row]["loop: stable-baselines3 / ours"], "") for row, name in LOOP_ROWS.items()
              if row in loop}  # fmt: skip
    if not sizes or not speeds:
        return None
    names = ["stable-baselines3", "stable-baselines3, optimize_memory_usage", "TorchRL", "Dopamine's layout (computed)",
             "ours", "ours, zstd", "ours, zstd, prioritized"]  # fmt: skip
    sizes["Dopamine's layout (computed)"] = float(DOPAMINE_BYTES)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, values, title in ((left, sizes, "bytes per Pong transition (log scale)"),
                              (right, speeds, "CleanRL's loop: steps a second, over stable-baselines3's")):  # fmt: skip
        for row, name in enumerate(names):
            value = values.get(name)
            if value is None:
                ax.text(0.02, row, "not run", va="center", fontsize=7, transform=ax.get_yaxis_transform())
                continue
            computed = "computed" in name
            ax.barh(row, value, color=FLOOR if computed else (OURS if name.startswith("ours") else PEER),
                    hatch="//" if computed else None)  # fmt: skip
            ax.text(value * 1.03, row, f"{value:,.0f}" if ax is left else f"{value:.3f}x", va="center", fontsize=7)
        ax.set_title(title, fontsize=9)
    left.set_xscale("log")
    left.set_xlim(100, 400_000)
    right.set_xlim(0, 1.25)
    right.axvline(0.9, color="#c44e52", lw=0.8, ls="--", label="0.9x (issue 54's floor, prioritized)")
    right.axvline(1.0, color="black", lw=0.8)
    right.legend(fontsize=7, loc="center right", frameon=False)  # beside the rows not run
    left.set_yticks(range(len(names)), names)
    left.invert_yaxis()
    fig.tight_layout()
    caption = (
        "The Atari replays: bytes per Pong transition (benchmarks.md's frame-replay-cpu memory table, buffers of "
        "50,000; ours compressed from its prioritized-cpu table, a million; Dopamine's computed from its layout, one "
        "84x84 frame, an int32 action, a float32 reward and a uint8 terminal, as it cannot run here) and CleanRL's "
        f"dqn_atari.py loop's steps a second over stable-baselines3's ({DQN_LOOP}: ours compressed sampled ahead with "
        "SampleAhead; TorchRL and Dopamine not run in it). "
    )
    tables = {"memory": memory, "million": million, "loop": loop}
    return save_figure(fig, docs, "recipes/dqn.md", "replay-layouts", "Bytes per transition and loop speed of the "
                       "Atari replays", caption + made_by, extra=f"<!-- tables {digest(tables)} -->\n")  # fmt: skip


def benchmark_figures(ctx: Context) -> None:
    """Every section of ``docs/benchmarks.md`` with a ratio column, charted beside its tables; and the DQN page's
    charts of the DQN loop's section (``dqn_loop_figure``) and of the Atari replays (``replay_layouts_figure``)."""
    page = "benchmarks.md"
    for key in sections((ctx.docs / page).read_text()):
        draw_section_chart(ctx.docs, page, key, ctx.provenance.sentence(ctx.command))
    dqn_loop_figure(ctx.docs, ctx.provenance.sentence(ctx.command))
    replay_layouts_figure(ctx.docs, ctx.provenance.sentence(ctx.command))
