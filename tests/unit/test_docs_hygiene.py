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
- Every message that README.md and docs/ quote as one the package prints (the convention:
  :func:`quoted_messages`) is in the package's code, and every Python example of theirs
  runs in a fresh interpreter, or :data:`NOT_RUN` says why it cannot here.

The package's sources are read where Python imports them from (the checkout, or the
installed wheel), the rest from the tree these tests sit in.
"""

from __future__ import annotations

import ast
import itertools
import os
import re
import shlex
import subprocess
import sys
import textwrap
from typing import NamedTuple

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


# -- the messages the docs quote --------------------------------------------------------------

#: A line of a code block (an example's output) that quotes an exception or a warning as
#: Python prints it, ``ValueError: ...``, ``UserWarning: ...``, ``CheckpointError: ...``.
RAISED_LINE = re.compile(r"^\s*([A-Z]\w*(?:Error|Exception|Warning|Stalled|Limit)): (.+?)\s*$")
#: A line of a code block that quotes a log record of a package logger, as
#: ``%(name)s %(levelname)s %(message)s`` prints it (docs/cluster.md).
LOG_LINE = re.compile(r"^\s*parallel_backend(?:\.\w+)* (?:DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                      r"(.+?)\s*$")
#: In a title of the troubleshooting page: a ``literal`` or a "quoted" span of 3 words or more.
TROUBLESHOOTING = os.path.join(DOCS, "troubleshooting.rst")
LITERAL, QUOTED = re.compile(r"``(.+?)``"), re.compile(r'"([^"]+)"')
#: A place the package fills in, in its code: an f-string's field, ``str.format``'s
#: ``{name}``, ``%``-formatting's ``%s``.
WILD = "\0"
FIELD = re.compile(r"\{[^{}]*\}|%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdrifgexXc]")
#: The share of a quote's letters that must be the code's own text (the rest: what the
#: package fills in; letters within quotes, ``'dsk'``, are values and not counted); a
#: template with fewer letters of its own than ``MIN_LETTERS`` (such as
#: ``f"{name}: {message}"``) matches nothing.
SHARE, MIN_LETTERS = 0.5, 8
QUOTED_VALUE = re.compile(r"'[^']*'|\"[^\"]*\"")


def doc_pages() -> list:
    return [os.path.join(ROOT, "README.md")] + list(files_under(DOCS, (".md", ".rst")))


def code_lines(path) -> list:
    """``(line number, line)`` of the code blocks of a page: between ``` fences in
    Markdown; in reST, the lines indented by 3 spaces or more (directive bodies, literal
    blocks and doctests)."""
    lines, out, fenced = read(path).splitlines(), [], False
    for n, line in enumerate(lines, 1):
        if path.endswith(".md"):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced:
                out.append((n, line))
        elif line.startswith("   "):
            out.append((n, line))
    return out


def titles(path) -> list:
    """``(line number, title)`` of a reST page's section titles (underlined)."""
    lines = read(path).splitlines()
    return [(n, line) for n, (line, under) in enumerate(itertools.pairwise(lines), 1)
            if line.strip() and re.fullmatch(r"([-=~^])\1{2,}", under)
            and len(under) >= len(line.rstrip())]


def quoted_messages(paths) -> list:
    """``(page:line, message)`` for every message the pages quote as one the package
    prints. The convention:

    - in a code block, a line ``SomeError: message`` or ``SomeWarning: message`` (what
      Python prints for an exception or a warning), or ``parallel_backend.x LEVEL message``
      (a log record);
    - in a title of docs/troubleshooting.rst, a ````literal```` or a "quoted" span of three
      words or more.

    A value, a name or a shape the package fills in may be shown as an example (``'dsk'``),
    a word that says which (``rows``) or ``...``, which also leaves text out.
    """
    found = []
    for path in paths:
        where, here = os.path.relpath(path, ROOT), []
        for n, line in code_lines(path):
            m = RAISED_LINE.match(line) or LOG_LINE.match(line)
            if m:
                here.append((n, m.group(m.lastindex)))
        if os.path.basename(path) == os.path.basename(TROUBLESHOOTING):
            for n, title in titles(path):
                spans = LITERAL.findall(title) + QUOTED.findall(LITERAL.sub("", title))
                here += [(n, q) for q in spans if q.count(" ") >= 2]
        found += [(f"{where}:{n}", q) for n, q in sorted(here, key=lambda h: h[0])]
    return found


def _text(node, fields: bool = True):
    """A string expression's text with :data:`WILD` where the program fills something in;
    ``None`` for an expression that makes no string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return FIELD.sub(WILD, node.value) if fields else node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v, fields=False) if isinstance(v, ast.Constant) else WILD
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        if left is None and right is None:
            return None
        return (WILD if left is None else left) + (WILD if right is None else right)
    return None


class _Strings(ast.NodeVisitor):
    def __init__(self):
        self.found = []

    def visit_Expr(self, node):
        if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            self.generic_visit(node)  # a docstring or a bare string documents; it prints nothing

    def visit_Constant(self, node):
        if isinstance(node.value, str):
            self.found.append(_text(node))

    def visit_JoinedStr(self, node):
        self.found.append(_text(node))

    def visit_BinOp(self, node):
        text = _text(node)
        if text is not None:
            self.found.append(text)
        self.generic_visit(node)


def message_templates(paths) -> list:
    """Every string the package's code can print (comments and docstrings left out), with
    :data:`WILD` where it fills something in, whitespace runs as one space."""
    templates = set()
    for path in paths:
        visitor = _Strings()
        visitor.visit(ast.parse(read(path)))
        for text in visitor.found:
            text = re.sub(r"\s+", " ", text)
            if sum(c.isalpha() for c in text) >= MIN_LETTERS:
                templates.add(text)
    return sorted(templates)


def letters_fitted(piece: str, template: str) -> int:
    """The most letters of ``piece`` that ``template``'s own text matches when ``piece``
    is read as a stretch of a message ``template`` prints (a :data:`WILD` stands for any
    text); -1 where it is none."""
    n = len(template)

    def closure(states):
        for j in range(n):  # a place the program fills in may be empty
            if j in states and template[j] == WILD:
                states[j + 1] = max(states.get(j + 1, -1), states[j])
        return states

    states = closure(dict.fromkeys(range(n + 1), 0))
    for c in piece:
        new = {}
        for j, got in states.items():
            if j == n:
                continue
            if template[j] == WILD:
                new[j] = max(new.get(j, -1), got)
            elif template[j] == c:
                new[j + 1] = max(new.get(j + 1, -1), got + c.isalpha())
        if not new:
            return -1
        states = closure(new)
    return max(states.values())


class MessageIndex:
    """The package's messages, for :meth:`prints`."""

    def __init__(self, templates):
        self.templates = templates
        self.by_word = {}
        for i, t in enumerate(templates):
            for w in set(re.findall(r"[a-z]{4,}", t.lower())):
                self.by_word.setdefault(w, set()).add(i)

    def prints(self, quote: str) -> bool:
        """Whether the package can print ``quote``: each stretch between ``...`` is part of
        a message, and the code's own text matches at least :data:`SHARE` of the quote's
        letters (those outside quoted values). A location prefix (``reduce_sum: ``, ``DeviceExecutor: ``) may be added by
        the caller of the message, so it is left out."""
        quote = re.sub(r"\s+", " ", quote.replace("\u2026", "..."))
        while re.match(r"[A-Za-z_][\w.]*: ", quote):
            quote = quote.split(": ", 1)[1]
        pieces = [p.strip() for p in quote.split("...")]
        pieces = [p for p in pieces if sum(c.isalpha() for c in p) >= 3]
        total = sum(c.isalpha() for p in pieces for c in QUOTED_VALUE.sub("", p))
        own = 0
        for piece in pieces:
            words = set(re.findall(r"[a-z]{4,}", piece.lower()))
            candidates = set().union(*(self.by_word.get(w, set()) for w in words)) if words \
                else range(len(self.templates))
            best = max((letters_fitted(piece, self.templates[i]) for i in candidates),
                       default=-1)
            if best < 0:
                return False
            own += best
        return own >= max(1, SHARE * total)


@pytest.fixture(scope="module")
def messages():
    return MessageIndex(message_templates([p for d in package_dirs()
                                           for p in files_under(d, (".py",))]))


#: Quoted messages that the code puts together from pieces (no one string holds them), and a
#: call that makes the package raise each: the quote must be in what it raises.
COMPOSED = {
    "grainsize must be an int >= 1 or None": lambda: pb.reduce_sum(abs, (), grainsize=0),
}


def raised(call) -> str:
    """The message of the error ``call()`` raises ("" if it raises none)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - any error: its message is what is checked
        return f"{type(e).__name__}: {e}"
    return ""


def unprinted(quotes, messages) -> list:
    return [f"{where}: {text!r}" for where, text in quotes
            if not (messages.prints(text) or text in raised(COMPOSED.get(text, tuple)))]


def test_every_message_the_docs_quote_is_one_the_package_prints(messages):
    quotes = quoted_messages(doc_pages())
    assert len(quotes) >= 20, quotes  # the convention finds the troubleshooting page's
    missing = unprinted(quotes, messages)
    assert not missing, ("these quoted messages are in no string of the package's code; "
                         "quote what it prints (see quoted_messages):\n" + "\n".join(missing))


def test_the_message_check_tells_printed_from_invented(messages, tmp_path):
    """Quotes in each form of the convention: those the package prints pass, with values
    filled in, a word for them or ``...``; invented ones and old wordings fail."""
    page = tmp_path / "troubleshooting.rst"
    page.write_text(textwrap.dedent("""\
        ``unknown executor 'dsk'; known: [...]``
        ----------------------------------------

        ``grainsize must be >= 1`` / "the host route is not taken"
        ----------------------------------------------------------

        ::

            ValueError: reduce_sum: fn must return shape (3,) for a chunk of 3 rows (one log-density per row), got shape (3, 1)
            UserWarning: DeviceExecutor: only one device (TFRT_CPU_0), so the blocks run one after another.
            UserWarning: DeviceExecutor: slower than plain NumPyro on one GPU
            parallel_backend.dask WARNING worker tcp://10.0.0.2:9000 lost (OSError: ...); its chunks go to the workers left
            parallel_backend.dask INFO worker tcp://10.0.0.2:9000 answered in 4.5 ms
        """))
    quotes = quoted_messages([str(page)])
    assert [q for _, q in quotes] == [
        "unknown executor 'dsk'; known: [...]", "grainsize must be >= 1",
        "the host route is not taken",
        ("reduce_sum: fn must return shape (3,) for a chunk of 3 rows (one log-density per "
         "row), got shape (3, 1)"),
        "DeviceExecutor: only one device (TFRT_CPU_0), so the blocks run one after another.",
        "DeviceExecutor: slower than plain NumPyro on one GPU",
        "worker tcp://10.0.0.2:9000 lost (OSError: ...); its chunks go to the workers left",
        "worker tcp://10.0.0.2:9000 answered in 4.5 ms"]
    assert [q.split(": ", 1)[1] for q in unprinted(quotes, messages)] == [
        "'grainsize must be >= 1'", "'the host route is not taken'",
        "'DeviceExecutor: slower than plain NumPyro on one GPU'",
        "'worker tcp://10.0.0.2:9000 answered in 4.5 ms'"]
    assert "grainsize must be an int >= 1 or None" in raised(COMPOSED[
        "grainsize must be an int >= 1 or None"])


# -- the Python examples of README.md and docs/ ------------------------------------------------

#: Python examples that cannot run here, by page and first line, and why. (The reST pages'
#: doctests and ``testcode`` run in the Sphinx doctest build: tests/integration/test_docs.py.)
NOT_RUN = {
    ("docs/cluster.md", "import parallel_backend as pb"):
        "three ways to make a DaskExecutor: a scheduler at tcp://scheduler:8786, and the "
        "reader's `model`, `data` and `client`",
    ("docs/cluster.md", 'with pb.DaskExecutor(address="tcp://scheduler-host:8786") as ex:'):
        "a scheduler and workers on other hosts (the commands above it start them)",
    ("docs/cluster.md", "from dask_kubernetes.operator import KubeCluster"):
        "a Kubernetes cluster with the dask operator, and the image built above it",
    ("docs/cluster.md", "from dask_gateway import Gateway"):
        "a dask-gateway server (tests/integration/test_dask_gateway.py starts one: -m gateway)",
    ("docs/cluster.md", "from dask_jobqueue import SLURMCluster"):
        "a SLURM queue (tests/integration/test_dask_jobqueue.py runs local jobs: -m jobqueue)",
    ("docs/numpyro.rst", "# plain NumPyro"):
        "two versions of a statement of a model's body: `X`, `y`, `alpha`, `beta` are the model's",
    ("docs/checkpoints.rst", 'with pb.DaskExecutor(address="tcp://scheduler:8786") as ex:'):
        "a running dask scheduler, and the reader's `model`, `X` and `y`",
    ("docs/executors.rst",
     'with pb.DaskExecutor(address="tcp://10.0.0.1:8786", timeout=10) as ex, pb.use_executor(ex):'):
        "the cluster that the commands above it start, and the reader's `mcmc`",
    ("docs/executors.rst", "from distributed import Client"):
        "the reader's `cluster` and `mcmc`",
    ("docs/executors.rst", "from distributed import Client, LocalCluster"):
        "TLS certificates of the reader's cluster (ca.pem, client.pem); "
        "tests/integration/test_dask.py runs the self-signed variant",
}
#: Each example's limit. Together they take about half a minute on 2 cores (most of it the
#: README's NUTS run over 20,000 rows), so they stay in the default run.
EXAMPLE_SECONDS = 300


class Example(NamedTuple):
    page: str   # relative to the repository's root
    line: int   # where the code starts
    code: str

    @property
    def first(self) -> str:
        return self.code.lstrip("\n").splitlines()[0].strip()


def indented_block(lines, start):
    """The lines of the reST block whose body starts after ``lines[start]`` (blank lines
    and lines indented deeper than that line), dedented, and where it starts."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    i = start + 1
    while i < len(lines) and re.match(r"\s+:\w[\w-]*:", lines[i]):  # a directive's options
        i += 1
    body = []
    for line in lines[i:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    blank = next((k for k, line in enumerate(body) if line.strip()), len(body))
    return textwrap.dedent("\n".join(body)).strip("\n"), i + blank + 1


def python_examples(paths=None) -> list:
    """The Python examples of README.md and docs/: ```python blocks in Markdown, ``..
    code-block:: python`` in reST."""
    out = []
    for path in paths or doc_pages():
        text, page = read(path), os.path.relpath(path, ROOT)
        if path.endswith(".md"):
            for m in re.finditer(r"^```python[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
                out.append(Example(page, text[:m.start()].count("\n") + 2, m.group(1)))
            continue
        lines = text.splitlines()
        for n, line in enumerate(lines):
            if re.match(r"\s*\.\. code-block:: python\s*$", line):
                code, first = indented_block(lines, n)
                out.append(Example(page, first, code))
    return out


def literal_blocks_in_python(paths) -> list:
    """reST literal blocks (a paragraph ending in ``::``) that hold Python: they belong in
    ``.. code-block:: python``, where the examples are found and run."""
    found = []
    for path in paths:
        if not path.endswith(".rst"):
            continue
        lines = read(path).splitlines()
        for n, line in enumerate(lines):
            if line.rstrip().endswith("::") and not line.lstrip().startswith(".."):
                code, first = indented_block(lines, n)
                try:
                    ast.parse(code)
                except SyntaxError:
                    continue  # a shell command, output, a diagram
                found.append(f"{os.path.relpath(path, ROOT)}:{first}")
    return found


def example_params():
    return [pytest.param(ex, id=f"{ex.page}:{ex.line}") for ex in python_examples()
            if (ex.page, ex.first) not in NOT_RUN]


def test_every_python_example_parses_and_is_run_or_says_why_not():
    examples = python_examples()
    keys = {(ex.page, ex.first) for ex in examples}
    stale = sorted(set(NOT_RUN) - keys)
    assert not stale, f"NOT_RUN names examples no page has: {stale}"
    for ex in examples:  # those not run too: at least they are Python
        compile(ex.code, f"{ex.page}:{ex.line}", "exec")
    hidden = literal_blocks_in_python(doc_pages())
    assert not hidden, ("Python in a literal block (::): write it as `.. code-block:: "
                        "python`:\n" + "\n".join(hidden))
    assert len(examples) > len(NOT_RUN)  # some run


@pytest.mark.parametrize("example", example_params())
def test_python_example_runs(example, tmp_path):
    """Each example in a fresh interpreter, on the CPU, in an empty folder."""
    script = tmp_path / "example.py"
    script.write_text(example.code)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=EXAMPLE_SECONDS, check=False)
    assert proc.returncode == 0, (f"the example at {example.page}:{example.line} failed:\n"
                                  + proc.stderr[-3000:])


def test_the_example_checks_find_what_they_look_for(tmp_path):
    """Blocks in each form are found; Python in a literal block is named."""
    md, rst = tmp_path / "page.md", tmp_path / "page.rst"
    md.write_text("Text\n\n```python\nx = 1\n```\n\n```bash\nls\n```\n")
    rst.write_text(textwrap.dedent("""\
        Text:

        .. code-block:: python
           :caption: one

           y = 2
           print(y)

        A literal block that is Python::

            import os

        A command::

            dask scheduler --port 8786
        """))
    examples = python_examples([str(md), str(rst)])
    assert [(ex.line, ex.code) for ex in examples] == [(4, "x = 1\n"), (6, "y = 2\nprint(y)")]
    assert [h.rsplit(":", 1)[1] for h in literal_blocks_in_python([str(rst)])] == ["11"]
