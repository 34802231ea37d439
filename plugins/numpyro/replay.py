"""Replaying a NumPyro model for bookkeeping, and the names the NumPyro and ArviZ plugins share.

This module owns :func:`quietly` (``reduce_sum`` calls traced inside go to a private
executor that counts nothing, so a model replayed to find its sites or shapes never
shows in the caller's executor or its stats), :func:`trace_model` (a seeded, and
optionally substituted, trace of a model), :class:`FactorUnit` (the distribution of a
``pb.factor`` site, which carries its inputs), :func:`factor_sites` (the ``pb.factor``
sites of a trace), :class:`honour_plates` and :func:`plates_fit` (how a site whose
log-density is one sum over its rows meets the plates around it) and
:data:`HMC_EXTRA_FIELDS`. Imports jax, numpyro and the core's public names.

A site's inputs (``fn``, ``data``, ``shared``...) travel in its distribution, a pytree
whose arrays are leaves, not in the site's ``infer`` dict: NumPyro and ArviZ keep
``infer`` as static metadata (``PytreeTrace``), where arrays and tracers break
``jax.eval_shape`` and ``scan``.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpyro
from numpyro import handlers
from numpyro.distributions import Unit
from numpyro.primitives import Messenger

import parallel_backend as pb

from .internals import handler_stack

__all__ = ["HMC_EXTRA_FIELDS", "INFER_KEY", "FactorUnit", "factor_sites", "honour_plates",
           "plates_fit", "quietly", "site_distribution", "site_inputs", "trace_model",
           "under_ecs_proxy"]

#: Key of a factor site's ``infer`` dict that marks it as a ``pb.factor`` site (a flag).
INFER_KEY = "parallel_backend"
#: Fields of an HMC/NUTS state that ``pb.sample`` collects and ``pb.to_arviz`` reads
#: into ``sample_stats``.
HMC_EXTRA_FIELDS = ("potential_energy", "energy", "num_steps", "accept_prob",
                    "adapt_state.step_size", "diverging")


@contextlib.contextmanager
def quietly():
    """A block in which ``reduce_sum`` calls traced run on a private ``SerialExecutor``
    that counts nothing; yields it."""
    with pb.SerialExecutor(count_calls=False) as scratch, pb.use_executor(scratch):
        yield scratch


def trace_model(model, model_args=(), model_kwargs=None, *, params=None, substitute_fn=None,
                seed: int = 0):
    """The trace of ``model`` seeded with ``seed``, with ``params`` (a dict of site values)
    or ``substitute_fn`` substituted."""
    seeded = handlers.seed(model, rng_seed=seed)
    if params is not None:
        seeded = handlers.substitute(seeded, data=params)
    elif substitute_fn is not None:
        seeded = handlers.substitute(seeded, substitute_fn=substitute_fn)
    return handlers.trace(seeded).get_trace(*model_args, **(model_kwargs or {}))


# -- plates ---------------------------------------------------------------------------
#
# A pb site's log-density is one number, the sum over its rows (and over the batch dims
# after them), so its distribution has batch shape (). A plate around it must not
# broadcast that sum (Distribution.expand would: N plate entries, N copies of the sum);
# the plate's scale (N / B for a subsample) and a scalar handlers.scale multiply the
# sum exactly as they multiply the plain site's summed log-probs. So a pb site's
# ``expand`` is a check, not a broadcast: a plate stack whose dims lie within the rows'
# batch shape (each its size there, or 1) is already summed over; any other plate would
# replicate the rows in the plain model, and is an error that names the plate.


def plates_fit(shape, batch) -> bool:
    """Whether a plate stack's batch ``shape`` lies within a site's own ``batch`` shape
    (right-aligned, as NumPyro aligns plate dims): each dim 1 or the site's size there,
    and dims left of the site's all 1."""
    shape, batch = tuple(shape), tuple(batch)
    extra = len(shape) - len(batch)
    if extra > 0 and any(s != 1 for s in shape[:extra]):
        return False
    inner = shape[max(extra, 0):]
    return all(s in (1, b) for s, b in zip(inner, batch[len(batch) - len(inner):]))


def under_ecs_proxy() -> bool:
    """Whether the model runs under HMCECS's likelihood estimator with a proxy, which
    reads each subsampled site's log-density row by row."""
    from numpyro.infer.hmc_gibbs import estimate_likelihood

    return any(isinstance(h, estimate_likelihood) and h.method is not None
               and h.params is not None for h in handler_stack())


def _enclosing_plates() -> list:
    """``(name, size, dim)`` of the plates around the site, as its frames will be."""
    return [(h.name, int(h.subsample_size), h.dim) for h in handler_stack()
            if isinstance(h, numpyro.plate) and h.dim is not None]


class honour_plates(Messenger):
    """Installed by ``pb.factor``/``pb.observe`` around their own ``numpyro.sample``: after
    every handler has processed the site, raises a ``ValueError`` naming each plate that
    does not lie within the rows' ``batch`` shape (see :func:`plates_fit`), and an array
    ``scale`` on a ``pb.factor`` site (a scale per row cannot multiply its one sum)."""

    def __init__(self, name, kind, batch, what):
        self.name, self.kind, self.batch, self.what = name, kind, tuple(batch), what
        super().__init__()

    def process_message(self, msg):
        # Before the plates process the site (they run after this innermost handler): a
        # plate that does not fit would otherwise fail in NumPyro's broadcasting, unnamed.
        if msg["type"] != "sample" or msg["name"] != self.name:
            return
        bad = [(name, size, dim) for name, size, dim in _enclosing_plates()
               if not plates_fit((size,) + (1,) * (-dim - 1), self.batch)]
        if bad:
            plates = ", ".join(f"plate {n!r} (size {s} at dim {d})" for n, s, d in bad)
            raise ValueError(
                f"pb.{self.kind} site {self.name!r}: {plates} does not match the site's "
                f"batch shape {self.batch} ({self.what}); in the plain model it would repeat "
                f"the rows. A plate over the rows must have their size at their dim (with "
                f"subsample_size, pass the subsampled rows: X[idx], y[idx]); another plate "
                f"must have size 1 there or sit on a dim of the batch shape with its size")

    def postprocess_message(self, msg):
        if msg["type"] != "sample" or msg["name"] != self.name:
            return
        if self.kind == "factor" and msg.get("is_observed") and under_ecs_proxy():
            raise ValueError(
                f"pb.{self.kind} site {self.name!r}: HMCECS with a proxy (taylor_proxy) "
                f"needs the site's log-density per row, and a pb.{self.kind} site gives one "
                f"parallel sum; use HMCECS without proxy= (its subsampled likelihood works "
                f"with pb.{self.kind}), or numpyro.sample for this site")
        scale = msg.get("scale")
        site = site_distribution(msg["fn"])
        if (self.kind == "observe" and scale is not None and jnp.size(scale) != 1
                and site is not None and not site.per_row):
            raise ValueError(
                f"pb.observe site {self.name!r}: a scale of shape {jnp.shape(scale)} (one "
                f"weight per row) reached the site from a handler that it does not know to "
                f"weigh its rows one by one; wrap the model in pb.pointwise (or use "
                f"numpyro.handlers.scale), so that its log_prob gives each row's derivatives")
        # An observe site's log_prob is per row, so NumPyro weights its rows itself.
        if self.kind == "factor" and msg.get("is_observed") and scale is not None and \
                jnp.size(scale) != 1:
            raise ValueError(
                f"pb.{self.kind} site {self.name!r}: a scale of shape {jnp.shape(scale)} "
                f"(handlers.scale with an array) cannot multiply the site's log-density, one "
                f"sum over its batch shape {self.batch}; use pb.observe (whose rows take "
                f"per-row weights), a scalar scale, or weight the rows inside the "
                f"log-density (the weights as a data leaf)")


class FactorUnit(Unit):
    """The distribution of a ``pb.factor`` site: ``numpyro.distributions.Unit`` of the
    summed log-density, carrying the ``reduce_sum`` inputs that made it (``data`` and
    ``shared`` as pytree leaves; ``fn``, ``executor``, ``grainsize``, ``block_rows`` and
    ``rows``, the number of rows, as static fields).

    Inside plates over the rows, ``expand`` is a checked no-op (see :func:`plates_fit`),
    and ``mask`` (a scalar or per-row flags) masks rows inside a new ``reduce_sum``."""

    pytree_data_fields = ("data", "shared")
    pytree_aux_fields = ("fn", "executor", "grainsize", "block_rows", "rows", "unhonoured")
    #: Marks the distribution of a parallel_backend site (``pb.observe``'s too).
    pb_site = "factor"

    def __init__(self, log_factor, fn, data, shared, executor=None, grainsize=None,
                 block_rows=None, rows=None, unhonoured=None):
        self.fn, self.data, self.shared = fn, data, tuple(shared)
        self.executor, self.grainsize, self.block_rows = executor, grainsize, block_rows
        self.rows, self.unhonoured = rows, unhonoured
        super().__init__(log_factor)

    def expand(self, batch_shape):
        batch_shape = tuple(batch_shape)
        if self.rows is None or plates_fit(batch_shape, (self.rows,)):
            return self
        return FactorUnit(self.log_factor, self.fn, self.data, self.shared, self.executor,
                          self.grainsize, self.block_rows, self.rows, batch_shape)

    def log_prob(self, value):
        if self.unhonoured is not None:
            raise ValueError(f"pb.factor site: expanded to batch shape {self.unhonoured}, which "
                             f"does not lie within its {self.rows} rows")
        return super().log_prob(value)

    def mask(self, mask):
        # Any mask but a Python bool goes inside the sum: a MaskedDistribution around this
        # one would be expanded (broadcast) by the plates outside it. mask=False (which
        # Predictive sets) gives zeros without evaluating anything, broadcast or not.
        if isinstance(mask, bool) or self.rows is None:
            return super().mask(mask)
        if not plates_fit(jnp.shape(mask), (self.rows,)):
            raise ValueError(f"pb.factor site: a mask of shape {jnp.shape(mask)} does not "
                             f"broadcast to its {self.rows} rows")
        flags = jnp.broadcast_to(jnp.asarray(mask, bool), (self.rows,))
        fn = self.fn
        if isinstance(fn, MaskedRows):  # masked twice: both masks
            fn, data = fn.fn, self.data[0]
            flags = flags & self.data[1]
        else:
            data = self.data
        fn = MaskedRows(fn)
        value = pb.reduce_sum(fn, (data, flags), *self.shared, executor=self.executor,
                              grainsize=self.grainsize, block_rows=self.block_rows)
        return FactorUnit(value, fn, (data, flags), self.shared, self.executor, self.grainsize,
                          self.block_rows, self.rows, self.unhonoured)

    @property
    def inputs(self) -> dict:
        """``fn``, ``data``, ``shared``, ``executor``, ``grainsize``, ``block_rows`` and
        ``kind`` (``"factor"``)."""
        return {"fn": self.fn, "data": self.data, "shared": self.shared,
                "executor": self.executor, "grainsize": self.grainsize,
                "block_rows": self.block_rows, "kind": "factor"}


class MaskedRows:
    """``fn((data, flags), *shared)``: ``fn(data, *shared)`` with the flagged-off rows 0
    (a ``pb.factor`` site under ``handlers.mask`` with per-row flags)."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, rows, *shared):
        lp = self.fn(rows[0], *shared)
        return jnp.where(rows[1], lp, jnp.zeros((), jnp.result_type(lp)))

    def __eq__(self, other):
        return type(other) is MaskedRows and other.fn == self.fn

    def __hash__(self):
        return hash((MaskedRows, self.fn))


def site_inputs(site):
    """The ``reduce_sum`` inputs of a ``pb.factor`` or observed ``pb.observe`` trace site
    (through any wrapper a handler put around its distribution), or ``None`` for another
    site."""
    if (site.get("type") != "sample" or not site.get("is_observed")
            or not (site.get("infer") or {}).get(INFER_KEY)):
        return None
    fn = site_distribution(site["fn"])
    return fn.inputs if fn is not None else None


def site_distribution(fn):
    """The ``pb.factor`` or ``pb.observe`` distribution inside ``fn`` (through any wrapper
    a handler put around it: ``base_dist``), or ``None``."""
    while getattr(fn, "pb_site", None) is None and hasattr(fn, "base_dist"):
        fn = fn.base_dist
    return fn if getattr(fn, "pb_site", None) is not None else None


def factor_sites(trace) -> dict:
    """The ``pb.factor`` and observed ``pb.observe`` sites of a NumPyro trace: ``{name:
    inputs}`` with ``fn``, ``data``, ``shared``, ``executor``, ``grainsize``,
    ``block_rows`` and ``kind`` (``"factor"`` or ``"observe"``; an observe site's ``fn``
    gives each row's log-density of ``data = (data, obs)``)."""
    out = {}
    for name, site in trace.items():
        inputs = site_inputs(site)
        if inputs is not None:
            out[name] = inputs
    return out
