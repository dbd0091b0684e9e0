"""MkDocs hooks (``mkdocs.yml``): the docs link to the code, and the site shows it.

A page links to a file of the repository the way GitHub follows it, by its relative path
(``../tests/parts/test_ema.py``, ``../../recipes/gan.py``), and to one test or class by its name after ``#``:
``../tests/parts/test_ema.py#test_x`` is ``tests/parts/test_ema.py``'s ``test_x``.
The site has only the docs, so each file linked to gets a generated page, ``source/PATH.md``: the file with line
numbers, a Python file cut into one section per top-level definition whose anchor is the definition's name. The
hook rewrites each link to that page, so the build's link and anchor checks see a file that was removed and a test
that was renamed (a warning each, which ``mkdocs build --strict`` turns into a failed build).
"""

from __future__ import annotations

import ast
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

SOURCE = "source"
_LINK = re.compile(r"\]\((?P<target>[^)\s#]+)(?P<fragment>#[^)\s]*)?\)")
_LANGUAGES = {".py": "python", ".yaml": "yaml", ".sh": "bash", ".toml": "toml", ".md": "markdown"}


def _repository_path(page_uri: str, target: str, config: Any) -> str | None:
    """The path from the repository root of a relative link that leaves the docs for the repository, else None."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    docs_dir, root = Path(config["docs_dir"]).resolve(), Path(config["config_file_path"]).resolve().parent
    path = Path(posixpath.normpath(posixpath.join(docs_dir.as_posix(), posixpath.dirname(page_uri), target)))
    if path.is_relative_to(docs_dir) or not path.is_relative_to(root):
        return None
    return path.relative_to(root).as_posix()


def _fence(text: str, language: str, first_line: int) -> str:
    ticks = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
    return f'{ticks}{language} linenums="{first_line}"\n{text}\n{ticks}\n'


def source_page(path: str, text: str) -> str:
    """The generated page of one repository file."""
    suffix = Path(path).suffix
    page = [f"# `{path}`\n"]
    if suffix != ".py":
        return "\n".join([*page, _fence(text.rstrip("\n"), _LANGUAGES.get(suffix, "text"), 1)])
    lines = text.splitlines()
    definitions = [
        (node.name, min([node.lineno, *(d.lineno for d in node.decorator_list)]))
        for node in ast.parse(text).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    starts = [1, *(start for _, start in definitions), len(lines) + 1]
    names = [None, *(name for name, _ in definitions)]
    for name, start, end in zip(names, starts[:-1], starts[1:], strict=True):
        block, first = lines[start - 1 : end - 1], start
        while block and not block[-1].strip():
            block.pop()
        while block and not block[0].strip():
            block.pop(0)
            first += 1
        if name is not None:
            page.append(f"## `{name}` {{#{name}}}\n")
        if block:
            page.append(_fence("\n".join(block), "python", first))
    return "\n".join(page)


def on_files(files: Files, config: Any) -> Files:
    """Add a generated page for every repository file a page of the docs links to."""
    root = Path(config["config_file_path"]).resolve().parent
    linked: set[str] = set()
    for file in files.documentation_pages():
        for match in _LINK.finditer(file.content_string):
            path = _repository_path(file.src_uri, match["target"], config)
            if path is not None and (root / path).is_file():
                linked.add(path)
    for path in sorted(linked):
        content = source_page(path, (root / path).read_text())
        files.append(
            File.generated(config, f"{SOURCE}/{path}.md", content=content, inclusion=InclusionLevel.NOT_IN_NAV)
        )
    return files


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    """Point each link to a repository file at its generated page. A link to a file that does not exist is left as
    it is, for the build's own link check to report."""
    root = Path(config["config_file_path"]).resolve().parent

    def rewrite(match: re.Match[str]) -> str:
        path = _repository_path(page.file.src_uri, match["target"], config)
        if path is None or not (root / path).is_file():
            return match[0]
        generated = posixpath.relpath(f"{SOURCE}/{path}.md", posixpath.dirname(page.file.src_uri) or ".")
        return f"]({generated}{match['fragment'] or ''})"

    return _LINK.sub(rewrite, markdown)
