"""Sphinx configuration of the parallel_backend documentation.

Build (fails on any warning or broken reference)::

    .venv/bin/python -m sphinx -W -n --keep-going -b html docs docs/_build/html
    .venv/bin/python -m sphinx -W -n --keep-going -b doctest docs docs/_build/doctest

The pages are reStructuredText (``.rst``) and Markdown (``.md``, read by MyST through
myst-nb); the notebooks of ``examples/`` are shown with the outputs they are committed
with (myst-nb, never executed here: the test suite executes them). They are copied into
``docs/notebooks/`` (not in git) when the build starts, since Sphinx reads pages only
under ``docs/``. The plots of ``performance.md`` are PNGs in ``docs/_static/``, drawn
from the benchmark records by ``python -m benchmarks plot FILE`` and committed; the build
only shows them.
"""

from __future__ import annotations

import filecmp
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
NOTEBOOKS = os.path.join(HERE, "notebooks")

import parallel_backend

project = "parallel_backend"
author = "the parallel_backend developers"
copyright = "the parallel_backend developers"
release = version = parallel_backend.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "myst_nb",
]

root_doc = "index"
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}


exclude_patterns = ["_build"]
templates_path: list = []
html_theme = "alabaster"
html_static_path: list = []  # _static/ holds the plots, which the image directives copy
html_theme_options = {"description": "Parallel gradients for one NumPyro chain",
                      "fixed_sidebar": True}

# MyST: `$...$` and `$$...$$` math in the Markdown pages; headings get anchors so that
# `[text](page.md#heading)` links resolve.
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3
# The notebooks are committed with their outputs; the test suite executes them
# (tests/integration/test_examples.py), on both supported stacks.
nb_execution_mode = "off"
# A progress bar redraws its line with carriage returns: show its last state only.
nb_merge_streams = True

# numpydoc-style docstrings through napoleon; types are rendered as text, since
# jax/numpyro types cannot be cross-referenced without network access (intersphinx).
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_param = False
napoleon_use_rtype = False
napoleon_use_ivar = True
autodoc_typehints = "none"
autodoc_member_order = "bysource"

# Broken references fail the build (-n); these are names of other projects.
nitpick_ignore_regex = [
    ("py:.*", r"(jax|numpyro|numpy|np|jnp|arviz|az|distributed|dask|pandas|matplotlib)(\..*)?"),
]

# Only `.. doctest::` / `.. testcode::` blocks in the pages run in the doctest
# builder; the docstrings' own examples run under pytest --doctest-modules.
doctest_test_doctest_blocks = ""
doctest_global_setup = """
import jax, jax.numpy as jnp, numpy as np
import numpyro, numpyro.distributions as dist
import parallel_backend as pb

def _has(name):
    try:
        getattr(pb, name)
    except (ImportError, AttributeError):
        return False
    return True

HAS_DASK, HAS_DEVICE = _has("DaskExecutor"), _has("DeviceExecutor")
"""
doctest_global_cleanup = """
pb.set_default_executor(None)
"""

def _copy_notebooks(app) -> None:
    """``examples/*.ipynb`` into ``docs/notebooks/``, where Sphinx reads pages; a copy
    is written only when its example differs, so that Sphinx reads an unchanged notebook
    from its cache."""
    os.makedirs(NOTEBOOKS, exist_ok=True)
    wanted = {n for n in os.listdir(EXAMPLES) if n.endswith(".ipynb")}
    for name in set(os.listdir(NOTEBOOKS)) - wanted:
        os.remove(os.path.join(NOTEBOOKS, name))
    for name in sorted(wanted):
        source, copy = os.path.join(EXAMPLES, name), os.path.join(NOTEBOOKS, name)
        if not os.path.exists(copy) or not filecmp.cmp(source, copy, shallow=False):
            shutil.copyfile(source, copy)


def setup(app):
    app.connect("builder-inited", _copy_notebooks)
