"""``pb.factor``: a NumPyro factor site whose log-density is a ``reduce_sum``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

try:
    import numpyro
except ImportError as e:  # pragma: no cover - numpyro is a core dependency
    raise ImportError('parallel_backend.factor needs NumPyro: '
                      'pip install "parallel-backend"') from e

import jax

import parallel_backend as pb

from .replay import INFER_KEY, FactorUnit, factor_sites, honour_plates

if TYPE_CHECKING:
    from jax.typing import ArrayLike

__all__ = ["factor", "reduce_sum_sites"]


def factor(name: str, fn: Callable[..., ArrayLike], data: Any, *shared: Any,
           executor: pb.Executor | str | None = None, grainsize: int | None = None,
           block_rows: int | None = None) -> jax.Array:
    """Add ``reduce_sum(fn, data, *shared)`` to the model's log-density as site ``name``.

    Like ``numpyro.factor``, but the log-density is evaluated chunk by chunk on an
    executor, and the site remembers ``fn``, ``data`` and ``shared`` so that the
    pointwise log-likelihood can be recomputed after sampling (LOO, WAIC).

    Inside ``numpyro.plate`` over the rows it is the counterpart of
    ``numpyro.factor(name, fn(data, *shared))``: the plate's scale (``N / B`` with
    ``subsample_size=B``, whose rows the caller passes), ``handlers.scale`` with a scalar
    and ``handlers.mask`` with a per-row or scalar mask apply as they do to that site. A
    plate that would repeat the rows (another size at their dim) raises ``ValueError``.

    Parameters
    ----------
    name : str
        Site name.
    fn, data, *shared, executor, grainsize, block_rows
        As for :func:`parallel_backend.reduce_sum`.

    Returns
    -------
    jax.Array
        The summed log-density (also added to the joint log-density).

    Examples
    --------
    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> y = jnp.array([0.1, -0.3, 0.4])
    >>> def loglik(y, mu):
    ...     return dist.Normal(mu, 1.0).log_prob(y)
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     pb.factor("y", loglik, y, mu)
    >>> tr = numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace(y)
    >>> tr["y"]["type"], tr["y"]["fn"].log_prob(None).shape
    ('sample', ())
    """
    if not isinstance(name, str):
        raise TypeError(f"factor: name must be a str, got {type(name).__name__}")
    value = pb.reduce_sum(fn, data, *shared, executor=executor, grainsize=grainsize,
                          block_rows=block_rows)
    # As numpyro.factor: a site of a Unit distribution observed at an empty value; the
    # distribution carries our inputs through handlers such as trace and substitute.
    leaves = jax.tree.leaves(data)
    rows = int(jax.numpy.shape(leaves[0])[0]) if leaves else None
    unit = FactorUnit(value, fn, data, shared, executor, grainsize, block_rows, rows)
    with honour_plates(name, "factor", () if rows is None else (rows,), "its rows"):
        numpyro.sample(name, unit, obs=unit.sample(None),
                       infer={"is_auxiliary": True, INFER_KEY: True})
    return value


#: The ``pb.factor`` sites of a NumPyro trace (an alias of :func:`.replay.factor_sites`).
reduce_sum_sites = factor_sites
