"""The shape of the code base: what may import what.

Read from the source with ``ast`` (every import statement, at module level or inside a
function), so a lazy import cannot slip past.
"""

import ast
from pathlib import Path

import pytest

import parallel_backend as pb
from parallel_backend import extend

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "parallel_backend"
PLUGINS = ROOT / "plugins"
#: What a plugin may import from the core: the facade and the executor-author interface.
PLUGIN_INTERFACE = {"parallel_backend", "parallel_backend.extend"}
#: Libraries the core must never import: the integrations live in ``plugins/``.
INTEGRATIONS = {"numpyro", "dask", "distributed", "arviz"}


def modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def imported(path: Path) -> set[str]:
    """Absolute module names imported by ``path`` (``from x import y`` gives ``x`` and,
    for a package ``x``, ``x.y``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def core_imports(path: Path) -> set[str]:
    """The core modules ``path`` imports, plugins (mapped under the package) left out."""
    out = set()
    for name in imported(path):
        if name.startswith("parallel_backend.plugins") or name.split(".")[0] != "parallel_backend":
            continue
        out.add(name)
    return out


@pytest.mark.parametrize("path", modules(PLUGINS), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_import_only_the_declared_interface(path):
    allowed = PLUGIN_INTERFACE | {f"parallel_backend.{n}" for n in pb.__all__}
    allowed |= {f"parallel_backend.extend.{n}" for n in extend.__all__}
    bad = sorted(n for n in core_imports(path) if n not in allowed)
    assert not bad, f"{path.relative_to(ROOT)} imports core internals {bad}; " \
                    "use parallel_backend.extend (or add what is missing there)"


def typing_only_imports(path: Path) -> dict[str, str]:
    """``{name: module}`` of the ``from module import name`` statements inside the
    module-level ``if TYPE_CHECKING:`` blocks of ``path`` (never run)."""
    out = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                   "typing.TYPE_CHECKING"):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
                    out.update({a.asname or a.name: sub.module for a in sub.names})
    return out


#: The facade: the one core module whose type-checking block may name plugins (its lazily
#: exported names, see test_the_facade_types_its_lazy_names).
FACADE = CORE / "__init__.py"


@pytest.mark.parametrize("path", modules(CORE), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_imports_no_integration(path):
    typing_only = set()
    if path == FACADE:
        typing_only = {f"{m}.{n}" for n, m in typing_only_imports(path).items()}
        typing_only |= set(typing_only_imports(path).values())
    bad = sorted(n for n in imported(path) - typing_only
                 if n.split(".")[0] in INTEGRATIONS or n.startswith("parallel_backend.plugins"))
    assert not bad, f"the core module {path.relative_to(ROOT)} imports {bad}"


def test_the_facade_types_its_lazy_names():
    """The facade's ``if TYPE_CHECKING:`` block imports exactly the names its
    ``__getattr__`` imports on first use, each from the module that defines it: a type
    checker sees their real types (tests/unit/test_typing.py), and nothing of it runs, so
    ``import parallel_backend`` imports no plugin (test_import_is_light)."""
    import importlib

    typed = typing_only_imports(FACADE)
    assert set(typed) == set(pb._LAZY)
    for name, module in typed.items():
        lazy_module, attr, _ = pb._LAZY[name]
        assert getattr(importlib.import_module(module), name) is getattr(
            importlib.import_module(lazy_module), attr), (name, module)


#: The core's modules, bottom up: a module imports only modules of the layers below its
#: own, never one of its layer or above (so no cycle, and each layer can be read without
#: those above). A module's size follows its job; what this test holds is the layering.
CORE_LAYERS = [
    {"_version", "errors", "internals", "identity", "blocks", "timeline"},
    {"analysis", "guards", "batching", "chunking"},
    {"tasks"},
    {"kernels"},
    {"spec", "host"},
    {"routes"},
    {"site"},
    {"executors.base"},
    {"executors.serial", "executors.thread"},
    {"executors.registry", "derivatives"},
    {"executors", "reduce"},
    {"extend", ""},
]


def core_name(path: Path) -> str:
    """``"spec"``, ``"executors.base"``, ``"executors"`` (a package), ``""`` (the package)."""
    parts = list(path.relative_to(CORE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def core_relative_imports(path: Path) -> set[str]:
    """The core modules ``path`` imports (relative imports resolved; ``from . import x``
    gives ``x``)."""
    here = core_name(path).split(".") if core_name(path) else []
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module:
                out.add(target)
            else:
                out.update(".".join(base + [a.name]) for a in node.names)
    known = {core_name(p) for p in modules(CORE)}
    return {n for n in out if n in known}


def test_core_layers_name_every_module():
    named = set().union(*CORE_LAYERS)
    assert named == {core_name(p) for p in modules(CORE)}, \
        "every core module belongs to one layer of CORE_LAYERS (and only existing ones)"


@pytest.mark.parametrize("path", modules(CORE), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_imports_only_lower_layers(path):
    layer = {m: i for i, names in enumerate(CORE_LAYERS) for m in names}
    me = core_name(path)
    bad = sorted(n for n in core_relative_imports(path) if layer[n] >= layer[me])
    assert not bad, (f"{path.relative_to(ROOT)} (layer {layer[me]}) imports {bad}, "
                     f"not below it: see CORE_LAYERS")


def plugin_imports(path: Path, plugin: str) -> set[str]:
    """What ``path`` imports of the plugin ``plugin`` (absolute or relative imports)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(plugin))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.startswith(plugin):
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
            elif node.level >= 2 and (node.module or "").split(".")[0] == plugin.split(".")[-1]:
                out.add(f"{plugin.rpartition('.')[0]}.{node.module}")  # from ..arviz.io import x
    return out


#: Which plugin may import which: ``sample`` (``pb.sample``) is built on ``arviz`` (the
#: output) and ``numpyro`` (the model sites), ``arviz`` on ``numpyro``; never the other way.
PLUGIN_DEPENDS = {"numpyro": set(), "arviz": {"numpyro"}, "sample": {"arviz", "numpyro"},
                  "cli": set(), "dask": set(), "device": set()}
#: Imports against that direction, each with its reason (none today).
UPWARD: set = set()


def plugin_of(path: Path) -> str:
    """The plugin ``path`` belongs to (``""`` for ``plugins/__init__.py``)."""
    parts = path.relative_to(PLUGINS).parts
    return parts[0] if len(parts) > 1 else ""


@pytest.mark.parametrize("path", [p for p in modules(PLUGINS) if plugin_of(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_depend_one_way(path):
    """A plugin imports only the plugins below it (and their libraries only where they
    do): the NumPyro plugin no ArviZ, xarray or ``pb.sample``."""
    own = plugin_of(path)
    where = str(path.relative_to(PLUGINS))
    bad = sorted(f"parallel_backend.plugins.{other}" for other in PLUGIN_DEPENDS
                 if other != own and other not in PLUGIN_DEPENDS[own]
                 and plugin_imports(path, f"parallel_backend.plugins.{other}")
                 and (where, f"parallel_backend.plugins.{other}") not in UPWARD)
    if own == "numpyro":
        bad += sorted(n for n in imported(path) if n.split(".")[0] in ("arviz", "arviz_base",
                                                                       "xarray"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", [p for p in modules(PLUGINS) if plugin_of(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_import_each_others_modules(path):
    """A plugin's ``__init__`` exports what users call; another plugin imports the module
    that defines a name (``from ..numpyro.replay import trace_model``), not the package."""
    own = plugin_of(path)
    bad = []
    for other in PLUGIN_DEPENDS:
        if other == own:
            continue
        package = f"parallel_backend.plugins.{other}"
        for name in plugin_imports(path, package):
            module = name[len(package) + 1:].split(".")[0]
            if not (PLUGINS / other / f"{module}.py").exists() and \
                    (str(path.relative_to(PLUGINS)), package) not in UPWARD:
                bad.append(name)
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} from a plugin's package"


def test_plugins_export_what_users_call():
    """The plugins' public names are the ones users call (and the facade re-exports)."""
    import parallel_backend.plugins.arviz as arviz_plugin
    import parallel_backend.plugins.numpyro as numpyro_plugin
    import parallel_backend.plugins.sample as sample_plugin

    assert set(numpyro_plugin.__all__) == {"factor", "observe", "unobserved", "log_likelihood",
                                           "pointwise", "pointwise_log_likelihood", "profile"}
    assert set(arviz_plugin.__all__) == {"to_arviz", "save", "load", "loo", "HMC_EXTRA_FIELDS",
                                         "DATATREE"}
    assert pb.loo is arviz_plugin.loo
    assert set(sample_plugin.__all__) == {"sample", "CheckpointError", "ConversionError"}
    # the facade's pb.sample is the sample plugin's, and the ArviZ plugin has none
    assert pb.sample is sample_plugin.sample and not hasattr(arviz_plugin, "sample")


def test_the_interface_module_names_only_what_exists():
    missing = [n for n in extend.__all__ if not hasattr(extend, n)]
    assert not missing and len(extend.__all__) == len(set(extend.__all__))


def test_the_package_is_one_pure_python_wheel(tmp_path):
    """``pip wheel .`` gives a ``py3-none-any`` wheel with the plugins mapped under the
    package, and no compiled or C source file in it (nor in the source tree)."""
    import subprocess
    import sys
    import zipfile

    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q",
                          "-w", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".c", ".h", ".so", ".pyd", ".dylib"))]
    assert "parallel_backend/plugins/numpyro/observe.py" in names
    assert "parallel_backend/plugins/sample/run.py" in names
    assert not [n for n in names if n.startswith("plugins/")]  # no top-level `plugins`
    assert not list(CORE.rglob("*.c")) and not (ROOT / "setup.py").exists()


def _ci_selections() -> list[str]:
    """The marker expressions CI's lanes run: the default run's (pyproject.toml's
    ``addopts``) and every ``-m`` of ``.ci/run``, shell variables resolved."""
    import re
    import shlex
    import tomllib

    root = ROOT
    addopts = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["addopts"]
    args = shlex.split(addopts)
    found = [args[args.index("-m") + 1]]
    ci = (root / ".ci" / "run").read_text()
    variables = dict(re.findall(r'^\s*([A-Z_]+)="([^"$]*)"\s*$', ci, flags=re.MULTILINE))
    for expr in re.findall(r'-m\s+"([^"]+)"', ci):
        found.append(variables.get(expr.lstrip("$").strip("{}"), expr))
    return found


def test_every_marker_runs_in_some_ci_lane():
    """Each marker of pyproject.toml is selected by some lane of ``.ci/run`` (a test that
    CI never runs protects nothing; the GPU tests skip where there is no GPU)."""
    import tomllib

    root = ROOT
    markers = [m.split(":")[0].strip() for m in tomllib.loads(
        (root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]]
    selections = _ci_selections()
    assert len(selections) >= 3, selections
    for marker in markers:
        env = {m: m == marker for m in markers}
        assert any(eval(expr, {"__builtins__": {}}, env) for expr in selections), (
            f"no lane of .ci/run runs the tests marked {marker!r}: {selections}")
