"""Build the optional C counter (see parallel_backend/_counter.c); all else is in pyproject.toml.

The extension is optional: where no C compiler is found the package installs without
it and counts in-graph evaluations with a slower host callback instead.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("parallel_backend._counter", ["parallel_backend/_counter.c"],
                             optional=True)])
