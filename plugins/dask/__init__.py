"""dask.distributed integration: :class:`DaskExecutor`.

Imports dask.distributed (the ``dask`` extra) and the core.
"""

try:
    import distributed  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised without the extra
    raise ImportError('parallel_backend.plugins.dask needs dask.distributed: '
                      'pip install "parallel-backend[dask]"') from e

from .executor import DaskExecutor

__all__ = ["DaskExecutor"]
