"""The types a checker sees: mypy on the public API (``[tool.mypy]`` of pyproject.toml), the
lazily exported names typed as what they are (not ``Any``), and every public signature
annotated.

mypy reads the package as it is installed: ``parallel_backend.plugins`` comes from
``plugins/`` (pyproject.toml's ``package-dir``), a folder no checkout holds, and an
editable install maps it with an import hook that mypy does not run. So mypy runs in a tree
of links laid out as the installed package (:func:`link_tree`). The same run from the
command line (what CI runs): ``python tests/unit/test_typing.py [mypy options]``.
"""

from __future__ import annotations

import hashlib
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import parallel_backend as pb

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "pyproject.toml"
#: mypy's cache (gitignored), one per environment: what it read of jax, numpy and the
#: rest stays valid between runs, so a run after the first takes seconds.
CACHE = ROOT / ".mypy_cache" / (f"py{sys.version_info[0]}{sys.version_info[1]}-"
                                 f"{hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]}")
#: What a checker must see as the facade's names: the lazily exported ones (``_LAZY``:
#: ``sample``, ``observe``...) and two of the core's.
REVEALED = ["reduce_sum", "ThreadExecutor", *sorted(pb._LAZY)]


def link_tree(dest: Path) -> Path:
    """``dest/parallel_backend``: links to the core's files, and ``plugins`` at
    ``parallel_backend/plugins``, as the wheel lays them out."""
    package = dest / "parallel_backend"
    package.mkdir(parents=True)
    for entry in (ROOT / "parallel_backend").iterdir():
        if entry.name not in ("__pycache__", "plugins"):
            (package / entry.name).symlink_to(entry)
    (package / "plugins").symlink_to(ROOT / "plugins", target_is_directory=True)
    return dest


def run_mypy(tree: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m mypy`` with pyproject.toml's settings, in ``tree`` (the configured
    ``files`` are paths of that tree)."""
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(CONFIG), "--cache-dir", str(CACHE)]
    return subprocess.run([*cmd, *args], cwd=tree, capture_output=True, text=True,
                          timeout=600, check=False)


def explain(out: subprocess.CompletedProcess) -> str:
    return (f"mypy exited {out.returncode} (parallel_backend/plugins/X is plugins/X of the "
            f"checkout):\n{out.stdout}{out.stderr}")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    pytest.importorskip("mypy", reason='mypy comes with the test extra: '
                                       'pip install -e ".[test]"')
    return link_tree(tmp_path_factory.mktemp("typing"))


def test_mypy_passes_on_the_public_api(tree):
    """mypy, configured in pyproject.toml (no blanket ignores), finds nothing in the public
    API's modules and what they import."""
    out = run_mypy(tree)
    assert out.returncode == 0, explain(out)
    assert re.search(r"^Success: no issues found in \d+ source files", out.stdout,
                     re.MULTILINE), explain(out)


def revealed_types(tree: Path, names: list[str]) -> dict[str, str]:
    """What mypy's ``reveal_type(pb.<name>)`` says of each name."""
    snippet = tree / "reveal.py"
    snippet.write_text("import parallel_backend as pb\n\n"
                       + "".join(f"reveal_type(pb.{n})\n" for n in names))
    out = run_mypy(tree, snippet.name)
    found = re.findall(r'^reveal\.py:(\d+): note: Revealed type is "(.*)"$', out.stdout,
                       re.MULTILINE)
    assert len(found) == len(names), explain(out)
    return {names[int(line) - 3]: t for line, t in found}


def test_the_facade_names_have_their_types(tree):
    """``pb.sample``, ``pb.observe`` and the other names the facade imports on first use
    (PEP 562 ``__getattr__``) are, to a type checker, the callables they are: the facade's
    ``if TYPE_CHECKING:`` block imports them. Without it each is ``Any``."""
    revealed = revealed_types(tree, REVEALED)
    untyped = {n: t for n, t in revealed.items() if t == "Any" or not t.startswith("def ")}
    assert not untyped, f"a type checker sees these as untyped: {untyped}"
    assert revealed["ThreadExecutor"].endswith("-> parallel_backend.executors.thread."
                                               "ThreadExecutor"), revealed["ThreadExecutor"]
    assert re.search(r"-> jax\S*\.Array$", revealed["reduce_sum"]), revealed["reduce_sum"]


def public_callables() -> list[tuple[str, object]]:
    """Every public function and class of ``pb.__all__`` and the public methods (and
    properties) of its classes."""
    out = []
    for name in pb.__all__:
        if name == "__version__":
            continue
        try:
            obj = getattr(pb, name)
        except ImportError:  # an extra that is not installed: its names are not checked
            continue
        if not inspect.isclass(obj):
            out.append((name, obj))
            continue
        for attr, value in vars(obj).items():
            if isinstance(value, property):
                value = value.fget
            elif isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if callable(value) and (not attr.startswith("_") or attr in (
                    "__init__", "__call__", "__enter__", "__exit__")):
                out.append((f"{name}.{attr}", value))
    return out


@pytest.mark.parametrize(("name", "obj"), [pytest.param(n, o, id=n)
                                           for n, o in public_callables()])
def test_public_signatures_are_annotated(name, obj):
    """Every parameter and the return value of each public function and method carries a
    type hint (``self`` and ``cls`` excepted)."""
    sig = inspect.signature(obj)
    bare = [p for p, v in sig.parameters.items()
            if v.annotation is inspect.Parameter.empty and p not in ("self", "cls")]
    if sig.return_annotation is inspect.Signature.empty:
        bare.append("return")
    assert not bare, f"{name}: no type hint for {bare}"


if __name__ == "__main__":  # CI: python tests/unit/test_typing.py [mypy options]
    with tempfile.TemporaryDirectory() as tmp:
        result = run_mypy(link_tree(Path(tmp)), *sys.argv[1:])
        print(result.stdout + result.stderr, end="")
        sys.exit(result.returncode)
