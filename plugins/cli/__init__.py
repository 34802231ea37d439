"""The ``parallel-backend`` command line and its demo: a user of every other plugin
(NumPyro for the models, ArviZ for ``pb.sample``'s results), reached only through the
facade ``parallel_backend``. Nothing imports it but the console script."""

from .main import main, profile_command

__all__ = ["main", "profile_command"]
