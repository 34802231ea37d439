"""ArviZ integration: ``pb.sample`` (NUTS, checkpoints, a run no later error can lose),
``pb.to_arviz`` (a run with pointwise log-likelihoods of ``pb.factor`` sites), and
``save``/``load`` of a run as netCDF, under ArviZ 1.x (``xarray.DataTree``) and ArviZ
0.2x (``arviz.InferenceData``) alike.

Imports arviz, xarray, numpyro, the core's public names and the NumPyro plugin's public
names (never the other way round).
"""

try:
    import arviz  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('parallel_backend.plugins.arviz needs ArviZ: '
                      'pip install "parallel-backend[arviz]"') from e

from parallel_backend.plugins.numpyro import (HMC_EXTRA_FIELDS, CheckpointError, LogLikPlan,
                                              pointwise_log_likelihood)

from .container import ARVIZ_MAJOR, DATATREE
from .convert import to_arviz
from .io import load, save
from .sample import ConversionError, sample

__all__ = ["sample", "to_arviz", "save", "load", "ConversionError", "CheckpointError",
           "HMC_EXTRA_FIELDS", "pointwise_log_likelihood", "LogLikPlan", "ARVIZ_MAJOR",
           "DATATREE"]
