"""ArviZ integration: ``to_arviz`` (a NumPyro run as ``InferenceData`` with pointwise
log-likelihoods of ``pb.factor`` sites) and ``save``/``load`` of a run as netCDF.

Imports arviz, numpyro and the core's public names.
"""

from .convert import HMC_EXTRA_FIELDS, to_arviz
from .io import load, save
from .loglik import LogLikPlan, pointwise_log_likelihood

__all__ = ["to_arviz", "save", "load", "pointwise_log_likelihood", "LogLikPlan",
           "HMC_EXTRA_FIELDS"]
