"""Running a NumPyro kernel ourselves: chains in segments of one compiled loop.

``pb.sample`` drives the kernel as NumPyro's ``MCMC`` does (``kernel.init``, then
``kernel.sample`` in a loop that postprocesses ``z`` and collects fields into
preallocated buffers), and its draws are bitwise ``MCMC``'s. The loop is one jitted
function whose bounds are runtime arguments, so any segment ``[lo, hi)`` of a run uses
the very same compiled program: a run cut into segments (for checkpoints, or resumed in
another process) computes exactly what one uninterrupted loop computes, without
compiling again.

The chains run in *lanes*: ``"batched"`` (vectorized: one state holds every chain),
``"each"`` (one chain after another) or ``"mapped"`` (states stacked on a chain axis,
run by ``jax.pmap`` or the user's chain transform). Outside the loop every chain's state
and draws are kept stacked on a leading chain axis, whatever the lanes.

Why not NumPyro's own loop (``MCMC.run``, whose ``fori_collect`` loops to a bound fixed
when it compiles, with ``post_warmup_state`` to continue): every segment length would be
a program of its own, compiled inside the tuner's timed segments; a checkpoint inside
warmup would need an ``MCMC`` per segment; the sites' routes (a runtime input here)
would have no way in; and with its progress bar on, ``fori_collect`` runs the body from
Python once per iteration, another program than with it off. What NumPyro decides
itself, it decides here too: ``MCMC`` validates the chain method and falls back from
``"parallel"`` (:func:`lanes_for`), and ``kernel.init``/``kernel.sample`` are NumPyro's.

This module owns :func:`lanes_for`, :func:`init_states` and :class:`Segments`. Imports
jax, numpy, numpyro, the core's interface and :mod:`.progress`.
"""

from __future__ import annotations

import warnings
from operator import attrgetter
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpyro.infer import MCMC
from numpyro.util import is_prng_key

from parallel_backend.extend import GRAPH, Slots, carried

from .progress import figures

__all__ = ["SLOTS", "Lanes", "Segments", "collected_fields", "init_states", "is_key", "lanes_for",
           "to_device", "to_host"]

#: Sites of a model whose route a run can switch at runtime (more are run where their
#: executor puts them).
SLOTS = 8


class Lanes(NamedTuple):
    """How the chains run.

    Attributes
    ----------
    kind : {"batched", "each", "mapped"}
    transform : callable or None
        For ``"mapped"``: ``jax.pmap`` or the user's ``chain_method`` callable.
    """

    kind: str
    transform: Any = None

    def chains(self, num_chains: int) -> list:
        """The chain indices of each lane, in the order they run."""
        if self.kind == "each":
            return [[c] for c in range(num_chains)]
        return [list(range(num_chains))]


def lanes_for(kernel, chain_method, num_chains: int) -> Lanes:
    """The lanes of NumPyro's ``MCMC`` with these settings: it validates ``chain_method``
    and, with fewer devices than chains, turns ``"parallel"`` into ``"sequential"`` with
    its warning (which names the fix); one chain is one unbatched lane."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        method = MCMC(kernel, num_warmup=0, num_samples=1, num_chains=int(num_chains),
                      chain_method=chain_method, progress_bar=False).chain_method
    for w in caught:  # NumPyro's warning, pointed at the caller of pb.sample
        warnings.warn(w.message, w.category, stacklevel=3)
    if num_chains == 1 or method == "sequential":
        return Lanes("each")
    if method == "vectorized":
        return Lanes("batched")
    return Lanes("mapped", jax.pmap if method == "parallel" else method)


def collected_fields(kernel, extra=()) -> tuple:
    """The state fields collected each draw, in ``MCMC.run``'s order (sample field first)."""
    return tuple(dict.fromkeys((kernel.sample_field, *kernel.default_fields, *extra)))


def is_key(x) -> bool:
    """Whether ``x`` is a typed JAX PRNG key array."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _strong(x):
    # A state loaded from a file has no weak types; drop them here too, so a fresh and a
    # resumed run call the loop with the same input types (one compiled program).
    return x if is_key(x) else lax.convert_element_type(x, jnp.result_type(x))


def init_states(kernel, key, lanes: Lanes, num_chains: int, num_warmup: int, init_params,
                model_args, model_kwargs, chains=None) -> list:
    """``kernel.init`` as ``MCMC.run`` calls it: ``[state]`` of every chain at once for a
    batched lane, else one state per chain of ``chains`` (default: every chain; ``[0]``
    only sets the kernel up, as a resumed run needs).

    ``key`` is split into one key per chain when there are several chains. A batched
    lane is always initialized whole: its kernel samples every chain at once.
    """
    if num_chains > 1 and is_prng_key(key):
        key = jax.random.split(key, num_chains)

    def one(c):
        k = key if num_chains == 1 else key[c]
        p = init_params if init_params is None or num_chains == 1 else \
            jax.tree.map(lambda x: x[c], init_params)
        return jax.tree.map(_strong, kernel.init(k, num_warmup, p, model_args, model_kwargs))

    if lanes.kind == "batched":
        return [jax.tree.map(_strong, kernel.init(key, num_warmup, init_params, model_args,
                                                  model_kwargs))]
    return [one(c) for c in (range(num_chains) if chains is None else chains)]


class Segments:
    """The compiled loop: ``run(state, buffers, lo, hi, choices)`` makes transitions
    ``lo .. hi-1``.

    Transition ``i`` (0-based; ``i >= num_warmup`` are draws) calls ``kernel.sample``,
    hands the new state's figures to ``tick`` on the host, and writes the collected
    fields of draw ``i - num_warmup`` into ``buffers`` (each of shape
    ``(chains, num_samples, ...)`` for a batched or mapped lane, ``(num_samples, ...)``
    for one chain). ``choices`` (int32, :data:`SLOTS` of them) say where each
    ``reduce_sum`` site of the model runs (``pb.extend.Slots``: both routes are compiled
    in, and give the same bits); :attr:`slots` lists the sites once traced. One program
    serves every segment of every lane of a run, whatever the choices.
    """

    def __init__(self, kernel, lanes: Lanes, fields: tuple, num_warmup: int, num_samples: int,
                 model_args, model_kwargs, tick):
        self.kernel, self.lanes, self.fields = kernel, lanes, fields
        self.num_warmup, self.num_samples = num_warmup, num_samples
        self.args, self.kwargs = model_args, model_kwargs
        self.tick = tick
        #: The sites the traced loop holds (a ``Slots``), once it was traced.
        self.slots: Slots | None = None
        batched = lanes.kind == "batched"
        one = self._segment(batched)
        if lanes.kind == "mapped":
            mapped = lanes.transform(one)

            def run(state, buffers, lo, hi, choices):
                n = jax.tree.leaves(state)[0].shape[0]
                return mapped(state, buffers, jnp.full(n, lo, jnp.int32),
                              jnp.full(n, hi, jnp.int32), jnp.broadcast_to(choices, (n, SLOTS)))

            self._run = run if lanes.transform is jax.pmap else jax.jit(run)
        else:
            self._run = jax.jit(one)

    def collect(self, state):
        """The collected fields of one chain's state: ``z`` postprocessed (constrained
        values and deterministic sites), the others as they are."""
        values = list(attrgetter(*self.fields)(state)) if len(self.fields) > 1 else \
            [attrgetter(self.fields[0])(state)]
        values[0] = self.kernel.postprocess_fn(self.args, self.kwargs)(values[0])
        return tuple(values)

    def _segment(self, batched: bool):
        kernel, args, kwargs, w = self.kernel, self.args, self.kwargs, self.num_warmup
        collect = jax.vmap(self.collect) if batched else self.collect

        def store(buffers, values, draw):
            if batched:
                return jax.tree.map(lambda b, v: b.at[:, draw].set(v), buffers, values)
            return jax.tree.map(lambda b, v: b.at[draw].set(v), buffers, values)

        def body(i, carry):
            state, buffers = carry
            state = kernel.sample(state, args, kwargs)
            jax.debug.callback(self.tick, *figures(state))
            buffers = lax.cond(i >= w, lambda b: store(b, collect(state), i - w),
                               lambda b: b, buffers)
            return state, buffers

        def segment(state, buffers, lo, hi, choices):
            slots = Slots(choices)
            with carried(slots):
                out = lax.fori_loop(lo, hi, body, (state, buffers))
            self.slots = slots
            return out

        return segment

    def run(self, state, buffers, lo: int, hi: int, choices=None):
        """Transitions ``lo .. hi-1`` from ``state`` with the sites' ``choices`` (default:
        every site where its executor puts it); returns the new state and buffers."""
        if choices is None:
            choices = self.default_choices()
        return self._run(state, buffers, jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32),
                         jnp.asarray(choices, jnp.int32))

    def default_choices(self) -> np.ndarray:
        """Each slot's default route (before the loop is traced: all in the graph)."""
        out = np.full(SLOTS, GRAPH, np.int32)
        for site in self.slots.sites if self.slots is not None else ():
            if site.slot is not None:
                out[site.slot] = site.executor.route(site.state).slot
        return out


def to_host(tree):
    """A numpy copy of ``tree`` (typed keys as their key data): safe to keep while the
    device arrays go on being used."""
    return jax.tree.map(lambda x: np.array(jax.random.key_data(x) if is_key(x) else x), tree)


def to_device(tree, like):
    """``tree`` (from :func:`to_host` or a file) as device arrays of the dtypes of
    ``like`` (a tree of the same structure), key data wrapped as keys again."""
    def put(x, t):
        if is_key(t):
            return jax.random.wrap_key_data(jnp.asarray(x), impl=jax.random.key_impl(t))
        return jnp.asarray(x, dtype=t.dtype)

    return jax.tree.map(put, tree, like)
