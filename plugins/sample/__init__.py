"""``pb.sample``: NumPyro's NUTS on an executor, returned in ArviZ's format, with all it
is made of: the sampling loop (:mod:`.loop`, :mod:`.chains`), the tuner that picks each
site's route from the run's own timings (:mod:`.tuning`), the progress bar
(:mod:`.progress`) and checkpoints (:mod:`.checkpoint`, :mod:`.fingerprint`).

It composes the two other plugins: NumPyro's kernels over the NumPyro plugin's sites, and
the ArviZ plugin's conversion and netCDF files; neither of them imports it. Importable
only with ArviZ installed (``pb.sample`` returns ArviZ data).
"""

try:
    import arviz  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('parallel_backend.plugins.sample needs ArviZ: '
                      'pip install "parallel-backend[arviz]"') from e

from .fingerprint import CheckpointError
from .run import ConversionError, sample

__all__ = ["CheckpointError", "ConversionError", "sample"]
