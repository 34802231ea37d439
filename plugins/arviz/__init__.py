"""ArviZ integration, for a run's output: ``pb.to_arviz`` (a finished NumPyro run with the
pointwise log-likelihood of its ``pb.factor``/``pb.observe`` sites) and ``save``/``load``
of a run as netCDF, and ``pb.loo`` (exact PSIS-LOO of a run, its log-likelihood made in row
groups, never whole), under ArviZ 1.x (``xarray.DataTree``) and ArviZ 0.x
(``arviz.InferenceData``) alike.

Imports arviz, xarray, numpyro, the core's public names and the NumPyro plugin's modules
(never the other way round). ``pb.sample`` lives in ``parallel_backend.plugins.sample``.
"""

try:
    import arviz  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('parallel_backend.plugins.arviz needs ArviZ: '
                      'pip install "parallel-backend[arviz]"') from e

from ..numpyro.replay import HMC_EXTRA_FIELDS
from .container import DATATREE
from .convert import to_arviz
from .io import load, save
from .loo import loo

__all__ = ["DATATREE", "HMC_EXTRA_FIELDS", "load", "loo", "save", "to_arviz"]

