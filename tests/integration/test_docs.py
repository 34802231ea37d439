"""The documentation builds with no warning or broken reference, and its examples run.

Runs the two builds CI runs (``sphinx-build -W -n --keep-going``: html, then the
doctest builder on the same doctrees) into a temporary folder, in subprocesses so
that the examples' JAX settings stay out of the test process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import parallel_backend as pb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")

#: The public names of the API contract (../shared/API.md); each needs an API entry
#: once it exists.
CONTRACT = ["reduce_sum", "SerialExecutor", "ThreadExecutor", "DaskExecutor", "DeviceExecutor",
            "use_executor", "set_default_executor", "factor", "sample", "to_arviz", "profile"]

#: The plots of the Performance page (docs/_static/, drawn by benchmarks/plots.py).
PLOTS = ["speedup_rows_hmm.png", "speedup_cores_16.png"]

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


def test_html_build_has_no_warnings(built):
    tmp, html, _ = built
    assert html.returncode == 0, html.stdout + html.stderr
    assert "WARNING" not in html.stderr, html.stderr
    pages = {p for p in os.listdir(tmp / "html") if p.endswith(".html")}
    assert {"index.html", "getting_started.html", "how_it_works.html", "executors.html",
            "performance.html", "api.html", "troubleshooting.html"} <= pages


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
