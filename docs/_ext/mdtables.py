"""A directive that shows the pipe tables of a Markdown page on a reStructuredText page.

``.. markdown-tables:: page.md`` renders every pipe table of ``page.md`` as a reST
table, titled by the Markdown heading above it; ``:match: regex`` keeps the tables
whose heading matches. Cell text keeps its inline code and bold; nothing else is
converted. MyST renders Markdown pages in full (``conf.py``), so this is needed only
by a reST page that stands in for a Markdown page of the same name (``conf.py``
leaves such a Markdown page out of the build).
"""

from __future__ import annotations

import os
import re
from typing import ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

__all__ = ["setup"]


def _markdown_tables(text: str):
    """[(heading, header cells, body rows)] of the pipe tables in ``text``."""
    tables, heading, block = [], "", []
    for line in text.splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("|"):
            block.append(stripped)
            continue
        if block:
            rows = [[c.strip() for c in row.strip("|").split("|")] for row in block]
            if len(rows) >= 2 and all(re.fullmatch(r":?-+:?", c) for c in rows[1]):
                tables.append((heading, rows[0], rows[2:]))
            block = []
        if stripped.startswith("#"):
            heading = stripped.lstrip("#").strip()
    return tables


def _cell(text: str) -> str:
    text = re.sub(r"(?<!`)`([^`]+)`(?!`)", r"``\1``", text)
    if not text:
        return ".."  # an empty comment: an empty cell
    if text[0] in "-+*" and (len(text) == 1 or text[1] == " "):
        return "\\" + text  # not a bullet list
    return text


class MarkdownTables(SphinxDirective):
    required_arguments = 1
    option_spec: ClassVar[dict] = {"match": directives.unchanged}

    def run(self):
        path = os.path.join(self.env.srcdir, self.arguments[0])
        self.env.note_dependency(path)
        with open(path, encoding="utf-8") as fh:
            tables = _markdown_tables(fh.read())
        pattern = self.options.get("match")
        if pattern:
            tables = [t for t in tables if re.search(pattern, t[0])]
        if not tables:
            raise self.error(f"no Markdown table in {self.arguments[0]}"
                             + (f" under a heading matching {pattern!r}" if pattern else ""))
        lines = []
        for heading, header, body in tables:
            lines += [f".. list-table:: {heading}", "   :header-rows: 1", ""]
            for row in [header] + body:
                row = (row + [""] * len(header))[: len(header)]
                lines.append(f"   * - {_cell(row[0])}")
                lines += [f"     - {_cell(c)}" for c in row[1:]]
            lines.append("")
        container = nodes.container(classes=["markdown-tables"])
        self.state.nested_parse(StringList(lines, source=path), self.content_offset, container)
        return [container]


def setup(app):
    app.add_directive("markdown-tables", MarkdownTables)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
