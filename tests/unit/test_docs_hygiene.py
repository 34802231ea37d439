"""The documentation stays documentation: page sizes, the words it must not use, and
tables and plots that are generated from the records they cite.

- README.md is for users: at most 8,000 characters and 20 ratio figures (``N.NNx``);
  docs/performance.md answers its questions in at most 25,000 characters, and
  ``benchmarks/results/`` keeps at most 30 files (the records its tables come from).
- README, docs, examples and the package's sources speak of the software, not of how it
  was made (:data:`DEVELOPMENT`, the words ``shared/hooks/before-stop`` looks for), and
  the package's sources carry no benchmark figure (they go to docs/performance.md).
- Every table of docs/performance.md is the output of the ``python -m benchmarks report``
  command written above it, and its plots are what ``python -m benchmarks plot`` draws
  from the records it names.

The package's sources are read where Python imports them from (the checkout, or the
installed wheel), the rest from the tree these tests sit in.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

import parallel_backend as pb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
PERFORMANCE = os.path.join(DOCS, "performance.md")
RESULTS = os.path.join(ROOT, "benchmarks", "results")

README_CHARS, README_FIGURES = 8_000, 20
PERFORMANCE_CHARS = 25_000
RESULTS_FILES = 30

#: Words about how the project is developed rather than about the software (the
#: before-stop hook's expression; a PRNG seed is of course fine).
DEVELOPMENT = re.compile(
    r"\bsessions?\b|lent by|device[` ]+tool|seed.s (problem|question|size|model|hmm)",
    re.IGNORECASE)
FIGURE = re.compile(r"[0-9]+\.[0-9]+x\b")

#: Folders under docs/ that are build output or copies, not sources.
NOT_SOURCES = {"_build", "_static", "notebooks", "__pycache__"}
TEXT = (".md", ".rst", ".py", ".ipynb", ".txt", ".toml", ".cfg", ".sh")


def read(path) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def files_under(top, suffixes=TEXT):
    """The files under ``top`` whose names end in ``suffixes`` (``None``: every file)."""
    for folder, dirs, names in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d not in NOT_SOURCES)
        yield from (os.path.join(folder, n) for n in sorted(names)
                    if suffixes is None or n.endswith(suffixes))


def package_dirs() -> list:
    """Where the core and the plugins are imported from (in a checkout, two folders; in
    an installed wheel the plugins sit inside the package)."""
    from parallel_backend import plugins

    dirs = [os.path.dirname(pb.__file__), os.path.dirname(plugins.__file__)]
    return [d for i, d in enumerate(dirs) if not any(d.startswith(e + os.sep) or d == e
                                                     for e in dirs[:i])]


def scanned() -> list:
    paths = [os.path.join(ROOT, "README.md")]
    paths += list(files_under(DOCS)) + list(files_under(os.path.join(ROOT, "examples")))
    for d in package_dirs():
        paths += list(files_under(d, (".py",)))
    return paths


def offences(pattern, paths) -> list:
    found = []
    for path in paths:
        for n, line in enumerate(read(path).splitlines(), 1):
            for m in pattern.finditer(line):
                found.append(f"{os.path.relpath(path, ROOT)}:{n}: {m.group(0)!r}")
    return found


def test_readme_is_short_and_for_users():
    text = read(os.path.join(ROOT, "README.md"))
    assert len(text) <= README_CHARS, f"README.md has {len(text):,} characters"
    figures = FIGURE.findall(text)
    assert len(figures) <= README_FIGURES, f"README.md has {len(figures)} ratio figures"


def test_performance_page_is_at_most_25000_characters():
    size = len(read(PERFORMANCE))
    assert size <= PERFORMANCE_CHARS, f"docs/performance.md has {size:,} characters"


def test_results_keep_only_the_records_tables_are_made_from():
    files = list(files_under(RESULTS, None))
    assert 0 < len(files) <= RESULTS_FILES, f"benchmarks/results holds {len(files)} files"


def test_no_words_about_how_the_project_is_developed():
    found = offences(DEVELOPMENT, scanned())
    assert not found, ("say these as facts about the software (STYLE.md 19):\n"
                       + "\n".join(found))


def test_package_sources_carry_no_benchmark_figures():
    paths = [p for d in package_dirs() for p in files_under(d, (".py",))]
    assert len(paths) > 20  # the core and the plugins were found
    found = offences(FIGURE, paths)
    assert not found, "figures live in docs/performance.md (STYLE.md 9):\n" + "\n".join(found)


# -- the tables and plots of performance.md ---------------------------------------------------

REPORT = re.compile(r"```bash\n(python -m benchmarks report [^\n]+)\n```\n")


@pytest.fixture
def harness(monkeypatch):
    """The benchmark harness of this tree (it is not installed with the package)."""
    monkeypatch.syspath_prepend(ROOT)
    import benchmarks.__main__ as main
    from benchmarks import records, report

    return main, records, report


def report_commands(page):
    """``(arguments, the page after the command's code block)`` per report command."""
    return [(shlex.split(m.group(1))[3:], page[m.end():]) for m in REPORT.finditer(page)]


def test_every_table_is_the_report_of_the_records_it_cites(harness):
    main, records, report = harness
    page = read(PERFORMANCE)
    commands = report_commands(page)
    assert commands, "no `python -m benchmarks report ...` block in docs/performance.md"
    rendered = 0
    for argv, after in commands:
        args = main.parser().parse_args(argv)
        recs = records.load([os.path.join(ROOT, f) for f in args.files])
        benches = args.bench.split(",") if args.bench else None
        tables = report.tables(recs, stacks=args.stacks, benches=benches)
        want = "\n\n".join(tables)
        assert after.lstrip("\n").startswith(want), (
            f"the table under `python -m benchmarks {shlex.join(argv)}` is not that "
            f"command's output; paste its output there:\n{want}")
        rendered += len(tables)
    assert page.count("\n|---") == rendered, "a table of performance.md cites no records"


def test_plots_are_drawn_from_the_records_they_cite(harness, tmp_path):
    """``python -m benchmarks plot FILE`` of each record file the page names draws the PNG
    the page shows (to the pixel but for a few: a font may render differently)."""
    image = pytest.importorskip("matplotlib.image")
    import numpy as np

    from benchmarks.plots import plot

    _, records, _ = harness
    page = read(PERFORMANCE)
    cited = re.findall(r"python -m benchmarks plot (benchmarks/results/\S+?\.jsonl)", page)
    shown = re.findall(r"\]\(_static/(\S+?\.png)\)", page)
    assert cited and shown
    drawn = {}
    for path in cited:
        out = tmp_path / os.path.basename(path)
        out.mkdir()
        for png in plot(records.load([os.path.join(ROOT, path)]), str(out)):
            drawn[os.path.basename(png)] = png
    assert sorted(drawn) == sorted(shown), "a plot on the page is not drawn from its records"
    for name, png in drawn.items():
        new, old = image.imread(png), image.imread(os.path.join(DOCS, "_static", name))
        assert new.shape == old.shape, name
        differ = np.mean(np.abs(new - old).max(axis=-1) > 0.25)
        assert differ < 0.002, f"docs/_static/{name} is not drawn from its records: redraw it"


def test_the_checks_find_what_they_look_for(tmp_path):
    """The expressions catch what they are for (and a PRNG seed passes)."""
    bad = tmp_path / "page.md"
    bad.write_text("Measured in the last session.\nThe seed's problem, lent by a tool.\n"
                   "The device tool. A seed of 0 gives the same draws. 2.50x faster\n")
    found = offences(DEVELOPMENT, [str(bad)])
    assert [f.split(": ", 1)[1] for f in found] == ["'session'", '"seed\'s problem"',
                                                    "'lent by'", "'device tool'"]
    assert offences(FIGURE, [str(bad)])[0].endswith("'2.50x'")
