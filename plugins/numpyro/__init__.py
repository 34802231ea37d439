"""NumPyro integration: ``pb.factor`` (a model statement backed by ``reduce_sum``), the
pointwise log-likelihood of its sites, ``pb.profile``, and the pieces a NUTS runner is
made of (the chains' compiled loop, the progress bar, what identifies a run for a
checkpoint, a finished run as plain data).

Imports numpyro and the core's public names; never ArviZ (the ArviZ plugin builds
``pb.sample`` and ``pb.to_arviz`` from the names here, never the other way round).
"""

from .chains import Chains
from .driver import Lanes, Run, collected_fields, lanes_for, to_host
from .factor import factor, reduce_sum_sites
from .loglik import LogLikPlan, log_likelihood, pointwise_log_likelihood
from .observe import ObservedRows, observe, unobserved
from .profile import ProfileReport, ProfileRow, profile
from .progress import Progress, terminal
from .record import RunRecord, run_record
from .replay import HMC_EXTRA_FIELDS, factor_sites, quietly, trace_model
from .tuning import Tuner
from .runstate import (STAT_NAMES, CheckpointError, Saved, check, draw_names, fingerprint,
                       pack, signature, unpack)

__all__ = [
    # model statements and what they give afterwards
    "factor", "observe", "log_likelihood", "unobserved", "ObservedRows", "reduce_sum_sites", "factor_sites", "pointwise_log_likelihood", "LogLikPlan",
    "quietly", "trace_model", "HMC_EXTRA_FIELDS",
    # measuring
    "profile", "ProfileReport", "ProfileRow",
    # running chains (pb.sample is built from these in the ArviZ plugin)
    "Chains", "Lanes", "lanes_for", "collected_fields", "to_host", "Run", "Progress",
    "terminal", "RunRecord", "run_record", "Tuner",
    # what identifies a run, for checkpoints
    "CheckpointError", "Saved", "fingerprint", "signature", "check", "draw_names", "pack",
    "unpack", "STAT_NAMES",
]
