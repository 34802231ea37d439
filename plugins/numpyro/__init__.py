"""NumPyro integration: the model statements ``pb.factor`` and ``pb.observe`` (sites backed
by ``reduce_sum``), the pointwise log-likelihood of their sites, and ``pb.profile``.

Exports what users call; the modules (``replay``, ``loglik``, ``record``, ``internals``)
are imported directly by the plugins built on this one (``arviz``, ``sample``). Imports
numpyro and the core's public names; never ArviZ or those plugins.
"""

from .factor import factor
from .loglik import log_likelihood, pointwise_log_likelihood
from .observe import observe, pointwise, unobserved
from .profile import profile

__all__ = ["factor", "log_likelihood", "observe", "pointwise", "pointwise_log_likelihood",
           "profile", "unobserved"]
