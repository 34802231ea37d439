"""Sphinx configuration of the parallel_backend documentation.

Build (fails on any warning or broken reference)::

    .venv/bin/python -m sphinx -W -n --keep-going -b html docs docs/_build/html
    .venv/bin/python -m sphinx -W -n --keep-going -b doctest docs docs/_build/doctest

``docs/design.md`` and ``docs/performance.md`` stay Markdown (the benchmark runs
update ``performance.md``); Sphinx reads only the ``.rst`` pages here, and the
Performance page pulls the tables of ``performance.md`` in with the local
``mdtables`` extension. Its plots are PNGs in ``docs/_static/``, drawn from the results
files by ``python benchmarks/plots.py`` and committed; the build only shows them.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))

import parallel_backend

project = "parallel_backend"
author = "the parallel_backend developers"
copyright = "the parallel_backend developers"
release = version = parallel_backend.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "mdtables",
]

root_doc = "index"
source_suffix = {".rst": "restructuredtext"}
exclude_patterns = ["_build"]
templates_path: list = []
html_theme = "alabaster"
html_static_path: list = []  # _static/ holds the plots, which the figure directive copies
html_theme_options = {"description": "Parallel gradients for one NumPyro chain",
                      "fixed_sidebar": True}

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

mdtables_markdown_root = HERE
