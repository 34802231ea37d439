"""parallel_backend: parallel gradients for one NumPyro chain.

The core (this package) imports jax, numpy and cloudpickle only. Integrations
live in ``parallel_backend.plugins`` and are re-exported here lazily, so
``import parallel_backend`` never imports NumPyro, dask or ArviZ.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .blocks import BlockPlan, plan_blocks, tree_sum
from .errors import ChunkError, EvaluationStalled
from .executors import (
    Executor,
    SerialExecutor,
    ThreadExecutor,
    get_default_executor,
    known_executors,
    make_executor,
    set_default_executor,
    use_executor,
)
from .reduce import reduce_sum

if TYPE_CHECKING:
    # What a type checker sees of the names `__getattr__` imports on first use (_LAZY):
    # their real definitions. Never run, so `import parallel_backend` stays light. Each
    # from the module that defines it: where a plugin's package exports a function named
    # as its module (`from .loo import loo`), mypy takes the package's name for both.
    from parallel_backend.plugins.arviz.convert import to_arviz
    from parallel_backend.plugins.arviz.loo import loo
    from parallel_backend.plugins.dask import DaskExecutor
    from parallel_backend.plugins.device import DeviceExecutor
    from parallel_backend.plugins.numpyro.factor import factor
    from parallel_backend.plugins.numpyro.loglik import log_likelihood
    from parallel_backend.plugins.numpyro.observe import observe, pointwise
    from parallel_backend.plugins.numpyro.profile import profile
    from parallel_backend.plugins.sample import sample

__all__ = [
    "BlockPlan",
    "ChunkError",
    "DaskExecutor",
    "DeviceExecutor",
    "EvaluationStalled",
    "Executor",
    "SerialExecutor",
    "ThreadExecutor",
    "__version__",
    "factor",
    "get_default_executor",
    "known_executors",
    "log_likelihood",
    "loo",
    "make_executor",
    "observe",
    "plan_blocks",
    "pointwise",
    "profile",
    "reduce_sum",
    "sample",
    "set_default_executor",
    "to_arviz",
    "tree_sum",
    "use_executor",
]

# Public names that live in plugins: name -> (module, attribute, extra to install).
_LAZY = {
    "factor": ("parallel_backend.plugins.numpyro", "factor", None),
    "observe": ("parallel_backend.plugins.numpyro", "observe", None),
    "log_likelihood": ("parallel_backend.plugins.numpyro", "log_likelihood", None),
    "sample": ("parallel_backend.plugins.sample", "sample", "arviz"),
    "profile": ("parallel_backend.plugins.numpyro", "profile", None),
    "pointwise": ("parallel_backend.plugins.numpyro", "pointwise", None),
    "to_arviz": ("parallel_backend.plugins.arviz", "to_arviz", "arviz"),
    "loo": ("parallel_backend.plugins.arviz", "loo", "arviz"),
    "DaskExecutor": ("parallel_backend.plugins.dask", "DaskExecutor", "dask"),
    "DeviceExecutor": ("parallel_backend.plugins.device", "DeviceExecutor", None),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr, extra = _LAZY[name]
        try:
            value = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            hint = f'pip install "parallel-backend[{extra}]"' if extra else "pip install parallel-backend"
            raise ImportError(f"parallel_backend.{name} needs an optional dependency: {hint}") from e
        globals()[name] = value
        return value
    raise AttributeError(f"module 'parallel_backend' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
