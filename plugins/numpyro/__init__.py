"""NumPyro integration: ``factor``, a model statement backed by ``reduce_sum``.

Imports numpyro and the core's public names.
"""

from .factor import factor, reduce_sum_sites
from .sample import sample
from .profile import ProfileReport, ProfileRow, profile

__all__ = ["factor", "reduce_sum_sites", "sample", "profile", "ProfileReport", "ProfileRow"]
