"""``pb.observe``: an observed NumPyro site over rows whose log-density is a ``reduce_sum``.

The parallel counterpart of ``numpyro.sample(name, dist, obs=obs)`` inside a plate over
the rows of ``data``. With ``obs`` given, the site's distribution is
:class:`ObservedRows`: its ``log_prob(obs)`` is ``reduce_sum`` of the rows'
``dist_fn(chunk, *shared).log_prob(obs_chunk)`` (computed when NumPyro asks for it, so a
model traced only to read its sites evaluates nothing), and it carries its inputs so that
the pointwise log-likelihood can be recomputed (:mod:`.loglik`). With ``obs=None`` it
is ``numpyro.sample(name, dist_fn(data, *shared))``: the same draws as plain NumPyro with
the same key. :func:`unobserved` turns observed sites into draws (posterior predictive
checks of a model that was given its observations). Imports jax, numpy and numpyro.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.distributions import Distribution
from numpyro.primitives import Messenger

from parallel_backend.extend import RowSum, reduce_rows

from .internals import handler_stack
from .replay import INFER_KEY, honour_plates, plates_fit, under_ecs_proxy

if TYPE_CHECKING:
    from jax.typing import ArrayLike

    import parallel_backend as pb

__all__ = ["ObservedRows", "RowValues", "observe", "pointwise", "unobserved"]


class RowValues:
    """``fn(rows, *shared)`` of an observed site's rows, as its distribution's ``log_prob``
    returns them: ``dist_fn(data_rows, *shared).log_prob(obs_rows)``, of the batch shape
    (the rows first), where ``rows`` is ``(data, obs)`` (or ``(data, obs, mask)`` for a
    masked site, masked rows at zero)."""

    def __init__(self, dist_fn, masked: bool = False):
        self.dist_fn, self.masked = dist_fn, masked
        self.__name__ = getattr(dist_fn, "__name__", type(dist_fn).__name__)

    def __call__(self, rows, *shared):
        lp = self.dist_fn(rows[0], *shared).log_prob(rows[1])
        return jnp.where(rows[2], lp, jnp.zeros((), lp.dtype)) if self.masked else lp


class ObservedRows(Distribution):
    """The distribution of an observed ``pb.observe`` site: its value is ``obs``, its
    ``log_prob(obs)`` the log-density of each row (the batch shape of ``dist_fn(data,
    *shared)``, the rows first), computed as ``reduce_sum`` computes
    (``parallel_backend.extend.reduce_rows``: in blocks, on the executor, with parallel
    derivatives), its ``sample`` a draw of ``dist_fn(data, *shared)``.

    Its batch shape is the rows', as the plain site's, so NumPyro treats it as it treats
    the plain site: ``log_density`` sums the rows (times a plate's scale, or the weights
    of ``handlers.scale``, one per row or one for all), ``numpyro.infer.log_likelihood``
    (and ArviZ's ``from_numpyro``) gets each row's value. Plates see it through
    ``expand``, a checked no-op (:func:`.replay.plates_fit`): a plate over the rows
    (subsampled or not) or over a later batch dim is the site's own. ``mask`` with a
    scalar or an array of flags that broadcasts to ``rows_batch``
    (``numpyro.handlers.mask``) masks rows inside the evaluation.

    Where ``log_prob`` is differentiated and nothing asked for the rows one by one
    (``per_row`` false: see :func:`rows_asked`), it gives the rows' sum in its first
    entry and zeros in the others, with the sum's derivatives: what NumPyro's
    ``log_density`` sums, at the cost of one ``reduce_sum`` (parameters out, partials
    back). Not differentiated, it gives each row's value.
    """

    pytree_data_fields = ("data", "shared", "obs", "row_mask")
    pytree_aux_fields = ("dist_fn", "executor", "grainsize", "block_rows", "name",
                         "rows_batch", "unhonoured", "per_row")
    pb_site = "observe"

    def __init__(self, name, dist_fn, data, shared, obs, executor=None, grainsize=None,
                 block_rows=None, row_mask=None, rows_batch=None, unhonoured=None,
                 per_row=False):
        self.name, self.dist_fn, self.data, self.shared, self.obs = (
            name, dist_fn, data, tuple(shared), obs)
        self.executor, self.grainsize, self.block_rows = executor, grainsize, block_rows
        self.row_mask, self.per_row = row_mask, bool(per_row)
        if rows_batch is None:
            rows_batch = _batch_shape(dist_fn, data, self.shared)
        self.rows_batch, self.unhonoured = tuple(rows_batch), unhonoured
        event = tuple(jnp.shape(obs))[len(self.rows_batch):]
        super().__init__(batch_shape=self.rows_batch, event_shape=event)

    def _replace(self, **changes):
        fields = {k: getattr(self, k) for k in (
            "name", "dist_fn", "data", "shared", "obs", "executor", "grainsize", "block_rows",
            "row_mask", "rows_batch", "unhonoured", "per_row")}
        return ObservedRows(**(fields | changes))

    @property
    def support(self):
        return self.full().support

    @property
    def is_discrete(self):
        return self.full().is_discrete

    def full(self):
        """``dist_fn(data, *shared)``: the distribution of all rows."""
        return self.dist_fn(self.data, *self.shared)

    @property
    def inputs(self) -> dict:
        """The ``reduce_sum`` inputs of the site (as :func:`.replay.site_inputs` gives)."""
        rows = (self.data, self.obs) if self.row_mask is None else (
            self.data, self.obs, self.row_mask)
        values = RowValues(self.dist_fn, self.row_mask is not None)
        # "fn" gives one value per row (what reduce_sum sums); "values" the log-density of
        # each element of the batch shape, the rows first: what the pointwise
        # log-likelihood keeps, as numpyro.infer.log_likelihood does for the plain site.
        return {"fn": RowSum(values), "values": values, "data": rows,
                "shared": self.shared, "executor": self.executor, "grainsize": self.grainsize,
                "block_rows": self.block_rows, "kind": "observe"}

    def expand(self, batch_shape):
        batch_shape = tuple(batch_shape)
        if plates_fit(batch_shape, self.rows_batch):
            return self
        # Kept for the site's honour_plates check, which names the plates.
        return self._replace(unhonoured=batch_shape)

    def log_prob(self, value):
        if self.unhonoured is not None:
            raise ValueError(f"pb.observe site {self.name!r}: expanded to batch shape "
                             f"{self.unhonoured}, which does not lie within the site's batch "
                             f"shape {self.rows_batch}")
        if value is not self.obs:  # not the site's own observations: in the caller's program
            return self.pointwise(value)
        rows = (self.data, self.obs) if self.row_mask is None else (
            self.data, self.obs, self.row_mask)
        return reduce_rows(RowValues(self.dist_fn, self.row_mask is not None), rows,
                           *self.shared, executor=self.executor, grainsize=self.grainsize,
                           block_rows=self.block_rows, summed=not self.per_row)

    def pointwise(self, value):
        """``dist_fn(data, *shared).log_prob(value)`` with masked rows at zero: the plain
        site's log-density of each row, shape ``rows_batch`` (in the caller's program)."""
        lp = self.full().log_prob(value)
        if self.row_mask is not None:
            lp = jnp.where(self.row_mask, lp, jnp.zeros((), lp.dtype))
        return lp

    def sample(self, key, sample_shape=()):
        return self.full().sample(key, sample_shape)

    def mask(self, mask):
        # Any mask but a Python bool goes inside the sum: a MaskedDistribution around this
        # one would be expanded (broadcast) by the plates outside it. mask=False (which
        # Predictive sets) gives zeros without evaluating anything, broadcast or not.
        if isinstance(mask, bool):
            return self if mask else super().mask(False)
        lead = self.rows_batch
        if not plates_fit(jnp.shape(mask), lead):
            raise ValueError(f"pb.observe site {self.name!r}: a mask of shape "
                             f"{jnp.shape(mask)} does not broadcast to the site's batch shape "
                             f"{lead} (the rows first); a mask over rows has shape "
                             f"({lead[0]},) + (1,) * {len(lead) - 1}, or {lead}")
        full = jnp.broadcast_to(jnp.asarray(mask, bool), lead)
        if self.row_mask is not None:
            full = full & self.row_mask
        return self._replace(row_mask=full)


def observe(name: str, dist_fn: Callable[..., Distribution], data: Any, *shared: Any,
            obs: ArrayLike | None = None, executor: pb.Executor | str | None = None,
            grainsize: int | None = None, block_rows: int | None = None) -> jax.Array:
    """An observed site over the rows of ``data``, evaluated as ``reduce_sum`` evaluates.

    The parallel counterpart of ``numpyro.sample(name, dist_fn(data, *shared), obs=obs)``
    inside a plate over the rows. It may sit inside that plate (with or without
    ``subsample_size``; with it, pass the subsampled rows, ``X[idx]``, ``y[idx]``), inside
    plates over later batch dims of ``dist_fn``'s, under ``handlers.scale`` with a scalar or
    an array that broadcasts against the site's batch shape (one weight per row: shape
    ``(N,)`` for rows alone), and under ``handlers.mask`` with a scalar or per-row mask: its
    log-density and its gradient are the plain site's in the same plates, scale and mask.

    Parameters
    ----------
    name : str
        Site name.
    dist_fn : callable
        ``dist_fn(data_chunk, *shared)`` returns a NumPyro distribution whose batch shape
        starts with the chunk's rows.
    data : pytree of arrays
        Every leaf with the same leading size ``N``, the rows.
    *shared : pytrees
        Passed whole to every chunk: parameters and small data.
    obs : array or None
        The observations, leading size ``N``. ``None``: the site draws ``name`` from
        ``dist_fn(data, *shared)`` (prior and posterior predictive).
    executor, grainsize, block_rows
        As for :func:`parallel_backend.reduce_sum`.

    Returns
    -------
    jax.Array
        ``obs``, or the values drawn where ``obs`` is ``None``.

    Raises
    ------
    ValueError
        ``dist_fn``'s batch shape does not start with the rows, or ``obs``'s shape does
        not match the distribution's (message names the site, the argument and shapes);
        a plate around the site that would repeat its rows (another size at their dim, or
        a dim left of the batch shape; message names the plate, its size and dim, and the
        shapes); one weight per row set as the site's scale by a handler other than
        ``numpyro.handlers.scale`` (wrap the model in :class:`pointwise`, so that the site
        gives each row's derivatives).
    TypeError
        ``name`` is not a str, ``dist_fn`` is not callable or does not return a NumPyro
        distribution; integer or boolean ``obs`` with a continuous distribution.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> x = jnp.linspace(-1.0, 1.0, 6)
    >>> def model(x, y=None):
    ...     b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    ...     pb.observe("y", lambda x, b: dist.Normal(b * x, 1.0), x, b, obs=y)
    >>> y = 0.5 * x
    >>> tr = numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace(x, y)
    >>> tr["y"]["is_observed"], tr["y"]["value"].shape
    (True, (6,))
    >>> numpyro.infer.Predictive(model, {"b": jnp.ones(3)})(jax.random.PRNGKey(1), x)["y"].shape
    (3, 6)
    """
    if not isinstance(name, str):
        raise TypeError(f"observe: name must be a str, got {type(name).__name__}")
    if not callable(dist_fn):
        raise TypeError(f"pb.observe site {name!r}: dist_fn must be callable, got "
                        f"{type(dist_fn).__name__}")
    n = _data_rows(name, data)
    batch, event, discrete = _probe(name, dist_fn, data, shared)
    if not batch or batch[0] != n:
        raise ValueError(f"pb.observe site {name!r}: dist_fn(data, *shared) must have a batch "
                         f"shape that starts with the {n} rows of data; got batch shape "
                         f"{batch} (event shape {event})")
    if obs is None:
        return numpyro.sample(name, dist_fn(data, *shared))
    shape = tuple(jnp.shape(obs))
    if not shape or shape[0] != n:
        raise ValueError(f"pb.observe site {name!r}: obs must have leading size {n} (the rows "
                         f"of data); got obs shape {shape}")
    want = batch + event
    if shape != want and not _broadcasts(shape, want):
        raise ValueError(f"pb.observe site {name!r}: obs shape {shape} does not match the "
                         f"distribution's batch + event shape {want}")
    kind = np.dtype(jnp.result_type(obs)).kind
    if kind in "biu" and not discrete:
        raise TypeError(f"pb.observe site {name!r}: obs has dtype {jnp.result_type(obs)} "
                        f"(discrete) but dist_fn returns a continuous distribution; pass float "
                        f"observations, or a discrete distribution")
    site = ObservedRows(name, dist_fn, data, shared, obs, executor, grainsize, block_rows,
                        rows_batch=batch, per_row=rows_asked(name))
    with honour_plates(name, "observe", batch, f"the rows of data first; obs shape {shape}"):
        return numpyro.sample(name, site, obs=obs, infer={INFER_KEY: True})


def _data_rows(name, data) -> int:
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise ValueError(f"pb.observe site {name!r}: data has no arrays; its leading axis is "
                         f"the rows")
    sizes = {tuple(jnp.shape(x))[:1] for x in leaves}
    if len(sizes) != 1 or sizes == {()}:
        raise ValueError(f"pb.observe site {name!r}: every leaf of data must have the same "
                         f"leading size (the rows); got shapes "
                         f"{[tuple(jnp.shape(x)) for x in leaves]}")
    return int(sizes.pop()[0])


def _broadcasts(shape, to) -> bool:
    try:
        return np.broadcast_shapes(shape, to) == tuple(to)
    except ValueError:
        return False


def _probe(name, dist_fn, data, shared):
    """``(batch_shape, event_shape, is_discrete)`` of ``dist_fn(data, *shared)``, found
    without computing it."""
    facts = {}

    def build(d, s):
        dist_ = dist_fn(d, *s)
        if not isinstance(dist_, Distribution):
            raise TypeError(f"pb.observe site {name!r}: dist_fn must return a NumPyro "
                            f"distribution, got {type(dist_).__name__}")
        facts.update(batch=tuple(dist_.batch_shape), event=tuple(dist_.event_shape),
                     discrete=bool(dist_.is_discrete))
        return 0

    jax.eval_shape(build, data, tuple(shared))
    return facts["batch"], facts["event"], facts["discrete"]


def _batch_shape(dist_fn, data, shared) -> tuple:
    return _probe("", dist_fn, data, shared)[0]


def rows_asked(name: str) -> bool:
    """Whether a handler around site ``name`` reads its rows one by one where its
    log-density is differentiated, so that ``log_prob`` must give each row's own value
    and derivatives (:class:`ObservedRows`): :class:`pointwise`, ``handlers.scale`` with
    one weight per row, HMCECS's likelihood estimator with a proxy, or a
    ``handlers.block`` that hides the site (the code that hides a site reads it itself:
    HMCECS's Taylor proxy takes the Jacobian and Hessian of its rows). A handler that
    sets a per-row scale otherwise is caught after the fact (:class:`.replay.honour_plates`
    raises an error that names :class:`pointwise`)."""
    for h in handler_stack():
        if isinstance(h, pointwise) and h.asks(name):
            return True
        if isinstance(h, numpyro.handlers.scale) and jnp.size(h.scale) != 1:
            return True
        if isinstance(h, numpyro.handlers.block) and h.hide_fn(
                {"name": name, "type": "sample", "is_observed": True}):
            return True
    return under_ecs_proxy()


class pointwise(Messenger):
    """A handler under which ``pb.observe`` sites give each row's own log-density and its
    own derivatives, also where the log-density is differentiated: for code that reads a
    site's rows one by one inside a gradient (``TraceGraph_ELBO`` with a guide site in
    the rows' plate that is not reparameterized, a ``jax.grad`` of
    ``numpyro.infer.log_likelihood``). Elsewhere a differentiated ``pb.observe`` site
    gives its rows' sum (see ``ObservedRows``), which is all NumPyro's
    ``log_density`` reads; per-row ``handlers.scale`` weights and HMCECS's proxy are
    recognised without it, as is a site that ``handlers.block`` hides. ``names`` limits it to those sites. A gradient then costs a
    Hessian-vector product more, and the rows' values travel from the executor.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> x = jnp.linspace(-1.0, 1.0, 4)
    >>> def model(b):
    ...     pb.observe("y", lambda x, b: dist.Normal(b * x, 1.0), x, b, obs=0.5 * x)
    >>> def second_row(b):  # its derivative in b is 0.5 * x[1] ** 2
    ...     tr = numpyro.handlers.trace(pb.pointwise(model)).get_trace(b)
    ...     return tr["y"]["fn"].log_prob(tr["y"]["value"])[1]
    >>> round(float(jax.grad(second_row)(0.0)), 6)
    0.055556
    """

    def __init__(self, fn: Callable[..., Any] | None = None,
                 names: Iterable[str] | None = None) -> None:
        self.names = None if names is None else set(names)
        super().__init__(fn)

    def asks(self, name: str) -> bool:
        return self.names is None or name in self.names


class unobserved(Messenger):
    """A handler under which observed sites draw their value instead (posterior and prior
    predictive of a model that was given its observations): ``numpyro.sample`` with
    ``obs`` and ``pb.observe`` alike; ``pb.factor`` sites and other auxiliary sites are
    left alone. ``names`` limits it to those sites."""

    def __init__(self, fn: Callable[..., Any] | None = None,
                 names: Iterable[str] | None = None) -> None:
        self.names = None if names is None else set(names)
        super().__init__(fn)

    def process_message(self, msg: dict[str, Any]) -> None:
        if (msg["type"] == "sample" and msg.get("is_observed")
                and not (msg.get("infer") or {}).get("is_auxiliary", False)
                and (self.names is None or msg["name"] in self.names)):
            msg["value"] = None
            msg["is_observed"] = False
