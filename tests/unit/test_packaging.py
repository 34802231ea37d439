"""What the installed distribution carries for those who adopt it: the license its
metadata names, the ``py.typed`` marker, and type hints on the public entry points that
live in plugins.

Read from the installed package (an editable install or the wheel), not from the
source tree, so that the wheel lane of ``.ci/run`` checks the wheel.
"""

from __future__ import annotations

import importlib.resources
import inspect
from importlib import metadata

import pytest

import parallel_backend as pb

DISTRIBUTION = "parallel-backend"


def test_the_license_is_apache_2_and_ships_with_the_distribution():
    meta = metadata.metadata(DISTRIBUTION)
    assert meta["License-Expression"] == "Apache-2.0"
    files = [f for f in metadata.files(DISTRIBUTION) or () if f.name == "LICENSE"]
    assert files, "no LICENSE file in the installed distribution"
    text = files[0].read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a pointer to it


def test_metadata_has_classifiers_and_keywords():
    meta = metadata.metadata(DISTRIBUTION)
    classifiers = meta.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert {"Programming Language :: Python :: 3.11",
            "Programming Language :: Python :: 3.12"} <= set(classifiers)
    assert "numpyro" in meta["Keywords"].split(",")


def test_py_typed_is_installed_with_the_package():
    assert (importlib.resources.files("parallel_backend") / "py.typed").is_file()


@pytest.mark.parametrize("name", ["sample", "to_arviz", "profile", "log_likelihood"])
def test_public_entry_points_in_plugins_are_annotated(name):
    sig = inspect.signature(getattr(pb, name))
    missing = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
    assert not missing, f"pb.{name}: parameters without a type hint: {missing}"
    assert sig.return_annotation is not inspect.Signature.empty, f"pb.{name}: no return hint"
