"""NumPyro integration: ``pb.factor`` (a model statement backed by ``reduce_sum``),
``pb.sample`` (NUTS returned as ArviZ data, with checkpoints), ``pb.profile``, and the
``parallel-backend`` command (``cli``, ``demo``).

Imports numpyro and the core's public names.
"""

from .checkpoint import CheckpointError
from .factor import factor, reduce_sum_sites
from .profile import ProfileReport, ProfileRow, profile
from .sample import sample

__all__ = ["factor", "reduce_sum_sites", "sample", "profile", "ProfileReport", "ProfileRow",
           "CheckpointError"]
