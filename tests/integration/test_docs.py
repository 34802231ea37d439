"""The documentation builds with no warning or broken reference, every page renders in
full (the Markdown pages through MyST, the notebooks with their outputs), and its
examples run.

Runs the two builds CI runs (``sphinx-build -W -n --keep-going``: html, then the
doctest builder on the same doctrees) into a temporary folder, in subprocesses so
that the examples' JAX settings stay out of the test process.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys

import pytest

import parallel_backend as pb

#: Slow: the site is built (Sphinx, the notebooks with their outputs); CI's slow lane builds it
#: on both stacks.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")

#: The public names of the API contract (../shared/API.md); each needs an API entry
#: once it exists.
CONTRACT = ["reduce_sum", "SerialExecutor", "ThreadExecutor", "DaskExecutor", "DeviceExecutor",
            "use_executor", "set_default_executor", "factor", "sample", "to_arviz", "profile"]

#: The plots of the Performance page (docs/_static/, drawn by benchmarks/plots.py).
PLOTS = ["speedup_rows_hmm.png", "speedup_cores_16.png"]

#: The notebooks of examples/ and the plots each shows in its committed outputs.
NOTEBOOKS = {"diagnostics": 3, "dask_cluster": 2}

pytest.importorskip("sphinx")


def sphinx(builder, out, doctrees):
    cmd = [sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-q", "-b", builder,
           "-d", str(doctrees), DOCS, str(out)]
    return subprocess.run(cmd, capture_output=True, check=False, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    doctrees = tmp / "doctrees"
    html = sphinx("html", tmp / "html", doctrees)
    doctest = sphinx("doctest", tmp / "doctest", doctrees)
    return tmp, html, doctest


@pytest.mark.slow
def test_html_build_has_no_warnings(built):
    tmp, html, _ = built
    assert html.returncode == 0, html.stdout + html.stderr
    assert "WARNING" not in html.stderr, html.stderr
    pages = {p for p in os.listdir(tmp / "html") if p.endswith(".html")}
    assert {"index.html", "getting_started.html", "how_it_works.html", "executors.html",
            "numpyro.html", "compatibility.html", "checkpoints.html", "performance.html",
            "cluster.html", "api.html", "troubleshooting.html"} <= pages


def test_doctests_in_the_pages_pass(built):
    tmp, _, doctest = built
    assert doctest.returncode == 0, doctest.stdout + doctest.stderr
    with open(tmp / "doctest" / "output.txt", encoding="utf-8") as fh:
        summary = fh.read()
    ran = sum(int(n) for n in re.findall(r"^\s*(\d+) tests", summary, flags=re.MULTILINE))
    assert ran >= 10, summary
    assert "0 failures in tests" in summary and "0 failures in setup code" in summary, summary


def test_performance_page_shows_the_benchmark_tables_and_plots(built):
    tmp, _, _ = built
    with open(tmp / "html" / "performance.html", encoding="utf-8") as fh:
        page = fh.read()
    with open(os.path.join(DOCS, "performance.md"), encoding="utf-8") as fh:
        markdown = fh.read()
    # Every table row of performance.md appears (first cell of each data row).
    first_cells = {line.split("|")[1].strip() for line in markdown.splitlines()
                   if line.startswith("| ") and not line.startswith("|---")}
    for cell in first_cells:
        assert cell.replace("`", "") in page, cell
    assert page.count("<table") == markdown.count("\n|---")
    # The two plots (rows, cores), drawn by benchmarks/plots.py into docs/_static/: shown on
    # the built page and referenced from performance.md, so GitHub shows them too.
    for png in PLOTS:
        assert f"](_static/{png})" in markdown, png
        assert f'src="_images/{png}"' in page, png
        assert os.path.exists(tmp / "html" / "_images" / png), png


def words(text) -> str:
    """The words and numbers of ``text``, space-separated: markup and punctuation aside."""
    return " ".join(re.findall(r"[A-Za-z0-9]+", text))


@pytest.mark.parametrize("name", ["performance", "compatibility", "cluster"])
def test_markdown_pages_render_in_full(built, name):
    """Every heading and the first words of every paragraph of a Markdown page reach its
    HTML page (MyST renders the page, not only its tables)."""
    tmp, _, _ = built
    with open(tmp / "html" / f"{name}.html", encoding="utf-8") as fh:
        page = words(html.unescape(re.sub(r"<[^>]+>", " ", fh.read())))
    with open(os.path.join(DOCS, f"{name}.md"), encoding="utf-8") as fh:
        text = re.sub(r"```.*?```", "", fh.read(), flags=re.DOTALL)
    text = re.sub(r"\]\([^)]*\)", "]", text)  # a link's text is shown, not its target
    checked = 0
    for block in text.split("\n\n"):
        block = block.strip()
        if not block or block.startswith(("|", "![", "**gradients**", "**scaling**",
                                          "**device**", "**nuts**")):
            continue  # tables: test_performance_page_shows_the_benchmark_tables_and_plots
        block = re.sub(r"^(?:\d+\.|[-*+])\s+", "", block)  # a list item's marker is not text
        first = " ".join(words(block).split()[:8])
        assert first in page, f"{name}.md: {first!r} is not on the page"
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebooks_are_shown_with_their_outputs(built, name):
    tmp, _, _ = built
    with open(tmp / "html" / "notebooks" / f"{name}.html", encoding="utf-8") as fh:
        page = fh.read()
    images = re.findall(r'<img [^>]*src="\.\./_images/([^"]+\.png)"', page)
    assert len(images) >= NOTEBOOKS[name], images
    for png in images:
        assert os.path.exists(tmp / "html" / "_images" / png), png
    # the outputs as Jupyter shows them: the progress bar's last state, then the results
    assert page.count("sample: 100%") == 1 and "r_hat" in page


def test_api_reference_documents_every_public_name_that_exists(built):
    tmp, _, _ = built
    with open(tmp / "html" / "api.html", encoding="utf-8") as fh:
        page = fh.read()
    missing = []
    for name in CONTRACT:
        try:
            getattr(pb, name)
        except (ImportError, AttributeError):
            continue  # not built yet: nothing to document
        if f'id="parallel_backend.{name}"' not in page:
            missing.append(name)
    assert not missing, f"docs/api.rst lacks an entry for {missing}"
