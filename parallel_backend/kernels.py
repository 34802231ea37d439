"""What one block computes, per derivative order, and the two layouts that run many blocks.

A *kernel* is what a block of rows gives for one parameter set, as plain functions of the
block and the parameters. There is one kernel per derivative order, each a class without
flags:

* ``VALUE``: the block's summed log-density (nothing differentiated);
* ``GRADIENT``: the summed value, the gradient of every shared leaf and the per-row
  gradient of every traced leaf that ``Wrt`` marks (a reverse pass over the block);
* ``HESSIAN_VECTOR_PRODUCT``: the tangent of those three along tangents that follow
  the leaves (forward over reverse), what second derivatives are made of.

``kernel_for`` picks one from what an evaluation carries (its derivative order and
its ``Wrt``): the only place an order is looked at. Each kernel also gives the
same quantity for plain NumPyro's program (``fn`` on every row at once,
``Gradient.plain``), which the graph evaluates on an accelerator.

A *layout* is how a run of blocks is evaluated, one class per form of the site
(``spec.SiteSpec.form``):

* ``BATCHED``: every block in one ``vmap``; only the padded last block is masked,
  run apart after the others (the mask kept XLA from fusing the values into their sum);
* ``LOOPED``: one block per iteration of a ``fori_loop`` (a ``scan`` in ``fn``, or
  LAPACK kernels that must run in place), written into buffers.

Both take any kernel, so the four combinations are written once each. A layout builds the
graph route's body (``Batched.graph``), a host chunk's compiled program
(``Batched.chunk_program``, called as ``tasks.CHUNK_CALLS`` says), and the blocked sum
that third derivatives differentiate (``Batched.sum_blocks``). Imports jax and the core
below it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .batching import over_blocks, set_by_set
from .blocks import take_blocks
from .tasks import Partials

__all__ = ["BATCHED", "GRADIENT", "HESSIAN_VECTOR_PRODUCT", "LAYOUTS", "LOOPED", "VALUE",
           "AllRows", "Batched", "Gradient", "HessianVectorProduct", "Looped", "RowsBefore",
           "Value", "Wrt", "as_is", "kept", "kernel_for", "merge", "pinned"]


def kept(xs, mask) -> list:
    """The entries of ``xs`` that ``mask`` marks, in order."""
    return [x for x, m in zip(xs, mask) if m]


def merge(full, subset, mask) -> tuple:
    """``full`` with the entries ``mask`` marks taken from ``subset``, in order."""
    it = iter(subset)
    return tuple(next(it) if m else x for x, m in zip(full, mask))


class Wrt(NamedTuple):
    """Which leaves an evaluation differentiates: one flag per traced data leaf and per
    shared leaf (static: it selects the compiled program)."""

    traced: tuple
    shared: tuple

    @classmethod
    def none(cls, n_traced: int, n_shared: int) -> Wrt:
        return cls((False,) * n_traced, (False,) * n_shared)

    def any(self) -> bool:
        """Whether any leaf is differentiated."""
        return any(self.traced) or any(self.shared)


# -- which rows of a block count ---------------------------------------------------------


class AllRows:
    """Every row of the block counts (a block with no padding)."""

    def __init__(self, valid, rows: int):
        del valid, rows  # a full block: nothing to hide

    def total(self, pointwise):
        return jnp.sum(pointwise)

    def cotangent(self, pointwise):
        """What the pullback of the sum starts from: ones."""
        return jnp.ones_like(pointwise)


class RowsBefore:
    """Only rows ``[0, valid)`` count: the padding after them (copies of the last row) is
    kept out of the value and, as zeros pulled back, of every gradient."""

    def __init__(self, valid, rows: int):
        self.mask = jnp.arange(rows) < valid

    def total(self, pointwise):
        return jnp.sum(jnp.where(self.mask, pointwise, 0))

    def cotangent(self, pointwise):
        return self.mask.astype(pointwise.dtype)


def pinned(partials: Partials) -> Partials:
    """``partials`` beside the small product of guard ``pin`` (:func:`.guards.pin`)."""
    return partials.pinned()


def as_is(partials: Partials) -> Partials:
    """``partials`` unchanged (a loop pins once, outside its body)."""
    return partials


# -- the kernels: one per derivative order ------------------------------------------------


class Value:
    """The block's summed value; no gradients.

    Attributes
    ----------
    label : str
        Added to the layout's name where a traced program is counted
        (``Program.traces``).
    in_sampling : bool
        What a sampler evaluates (the adaptive chunker learns from these only).
    """

    label = ""
    in_sampling = True

    def sets_apart(self, spec) -> bool:
        """Whether a batch of parameter sets, on a site of ``sets="each"``, is evaluated
        one set at a time (always, for a value or a gradient)."""
        del spec
        return True

    def has_work(self, tangents) -> bool:
        """Whether an evaluation must run a chunk (always, but along zero tangents)."""
        del tangents
        return True

    def block(self, pointwise, traced, shared, valid, rows: int, wrt: Wrt, counted,
              finish) -> Partials:
        """``pointwise(traced, shared) -> (rows,)`` is ``fn`` on the block with its data
        bound; ``counted`` (:class:`AllRows` or :class:`RowsBefore`) says which rows of
        ``valid`` count; ``finish`` is :func:`pinned` or :func:`as_is`."""
        del wrt
        count = counted(valid, rows)
        return finish(Partials(count.total(pointwise(traced, shared)), (), ()))

    def plain(self, block, resident, traced, shared, valid, wrt: Wrt) -> tuple:
        """``(value, shared gradients, per-row gradients)`` of ``block(resident, traced,
        shared)`` (``fn`` on every row it is given) summed, by JAX's own derivatives
        (none where ``wrt`` marks nothing): plain NumPyro's program. ``valid``: only
        rows ``[0, valid)`` count, or ``None``: all."""

        def total(traced_part, shared_part):
            pointwise = block(resident, merge(traced, traced_part, wrt.traced),
                              merge(shared, shared_part, wrt.shared))
            return jnp.sum(_rows_before(pointwise, valid))

        value, (traced_grads, shared_grads) = jax.value_and_grad(total, argnums=(0, 1))(
            tuple(kept(traced, wrt.traced)), tuple(kept(shared, wrt.shared)))
        return value, tuple(shared_grads), tuple(traced_grads)


class Gradient(Value):
    """The block's summed value, the gradients of the shared leaves ``wrt`` marks and the
    per-row gradients of the traced leaves it marks: one reverse pass. The gradient of
    a sum is the pullback of ones; padded rows pull back zeros."""

    def block(self, pointwise, traced, shared, valid, rows: int, wrt: Wrt, counted,
              finish) -> Partials:
        """As :meth:`Value.block`."""
        count = counted(valid, rows)

        def at(traced_part, shared_part):
            return pointwise(merge(traced, traced_part, wrt.traced),
                             merge(shared, shared_part, wrt.shared))

        values, pullback = jax.vjp(at, kept(traced, wrt.traced), kept(shared, wrt.shared))
        traced_grads, shared_grads = pullback(count.cotangent(values))
        return finish(Partials(count.total(values), tuple(shared_grads), tuple(traced_grads)))


def _rows_before(pointwise, valid):
    """``pointwise`` with the rows from ``valid`` on zeroed (``valid`` ``None``: all kept)."""
    if valid is None:
        return pointwise
    return jnp.where(jnp.arange(pointwise.shape[0]) < valid, pointwise, 0)


class HessianVectorProduct:
    """The tangent of :class:`Gradient`'s three along tangents (forward over reverse): a
    Hessian-vector product per block. ``traced`` and ``shared`` end with the tangents of
    the leaves ``wrt`` marks, in order."""

    label = " hvp"
    in_sampling = False

    def sets_apart(self, spec) -> bool:
        """A batch of tangents is mapped inside the blocks, but where LAPACK kernels must
        run in place (a batch would batch their matrices)."""
        return bool(spec.lapack_rows)

    def has_work(self, tangents) -> bool:
        """A product along zero is zero: no chunk runs."""
        return any(np.any(x) for x in tangents)

    def block(self, pointwise, traced, shared, valid, rows: int, wrt: Wrt, counted,
              finish) -> Partials:
        """As :meth:`Value.block`, the tangents after the leaves."""
        traced, traced_tangents = _split(traced, len(wrt.traced))
        shared, shared_tangents = _split(shared, len(wrt.shared))
        first = kernel_for(1, wrt)

        def partials(traced_part, shared_part):
            return first.block(pointwise, merge(traced, traced_part, wrt.traced),
                               merge(shared, shared_part, wrt.shared), valid, rows, wrt,
                               counted, finish)

        return jax.jvp(partials, (tuple(kept(traced, wrt.traced)),
                                  tuple(kept(shared, wrt.shared))),
                       (tuple(traced_tangents), tuple(shared_tangents)))[1]

    def plain(self, block, resident, traced, shared, valid, wrt: Wrt) -> tuple:
        """As :meth:`Gradient.plain`, the tangents after the leaves: their tangent."""
        traced, traced_tangents = _split(traced, len(wrt.traced))
        shared, shared_tangents = _split(shared, len(wrt.shared))

        def grads(traced_part, shared_part):
            return GRADIENT.plain(block, resident, merge(traced, traced_part, wrt.traced),
                                  merge(shared, shared_part, wrt.shared), valid, wrt)

        return jax.jvp(grads, (tuple(kept(traced, wrt.traced)), tuple(kept(shared, wrt.shared))),
                       (tuple(traced_tangents), tuple(shared_tangents)))[1]


def _split(leaves, n: int) -> tuple:
    """``(leaves[:n], leaves[n:])``: the leaves, then the tangents that follow them."""
    return leaves[:n], leaves[n:]


VALUE, GRADIENT, HESSIAN_VECTOR_PRODUCT = Value(), Gradient(), HessianVectorProduct()


def kernel_for(order: int, wrt: Wrt):
    """The kernel of a derivative ``order`` (1: value and gradients, 2: their tangent)
    over the leaves ``wrt`` marks: :data:`VALUE` where nothing is differentiated."""
    if order == 2:
        return HESSIAN_VECTOR_PRODUCT
    return GRADIENT if wrt.any() else VALUE


# -- the layouts: how a run of blocks is evaluated ------------------------------------------


class Batched:
    """Every block in one ``vmap`` (the form of a likelihood without a loop over rows)."""

    name = "batched"

    def partials(self, program, kernel, prepared, traced, shared, valid, wrt: Wrt,
                 counted=AllRows, tail: tuple[Any, Any, Any] | None = None,
                 set_axes=None) -> Partials:
        """Every block of the given arrays (leading axis: blocks), each counted as
        ``counted`` says; then, with ``tail`` (the padded last block's ``(prepared,
        traced, valid)``, an axis of one block each), that block alone, its padding
        masked, after them. ``set_axes``: a batch of parameter sets, inside the blocks
        (:func:`.batching.over_blocks`); the outputs then lead with the sets.

        Only a padded block needs the mask, and the mask costs: the ``where`` that keeps
        padding out kept XLA from fusing the values into their sum (measured on a
        logistic regression; docs/performance.md)."""
        program.traces[(self.name + kernel.label, int(valid.shape[0]), counted is RowsBefore,
                        tail is not None)] += 1
        block = functools.partial(program.block, kernel=kernel, wrt=wrt, counted=counted,
                                  finish=pinned)
        out = over_blocks(block, prepared, traced, shared, valid, set_axes)
        if tail is None:
            return out
        last_block = functools.partial(block, counted=RowsBefore)
        last = over_blocks(last_block, *tail[:2], shared, tail[2], set_axes)
        axis = 0 if set_axes is None else 1
        return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis), out, last)

    def graph(self, program, kernel, prepared, prepared_tail, traced, shared, valid,
              wrt: Wrt, set_axes, traced_axes) -> Partials:
        """Every block inside the caller's program (the inputs already behind the
        guards; :meth:`.spec.Program.graph_partials`), the padded last block apart where
        the site's tiles say so."""
        tail = None
        if program.split_tail:
            tail = (prepared_tail, take_blocks(traced, traced_axes, -1, None), valid[-1:])
            traced, valid = take_blocks(traced, traced_axes, None, -1), valid[:-1]
        return self.partials(program, kernel, prepared, traced, shared, valid, wrt,
                             tail=tail, set_axes=set_axes)

    def chunk_program(self, program, kernel, blocks: int, wrt: Wrt, in_axes, split: bool):
        """A host chunk of ``blocks`` blocks, to be compiled: ``f(prepared, traced, shared,
        valid)``, or with ``split`` (the chunk ends with the padded last block)
        ``f(prepared, traced, shared, valid, tail)``, called as :data:`.tasks.CHUNK_CALLS`
        says."""
        del blocks
        run = functools.partial(self.partials, program, kernel, wrt=wrt, set_axes=in_axes)
        if split:
            return lambda prepared, traced, shared, valid, tail: run(
                prepared, traced, shared, valid, tail=tail)
        return run

    def sum_blocks(self, one, resident_blocks, traced_blocks):
        """``one(resident, traced)`` (a block's sum) of every full block, in plain JAX."""
        return jax.vmap(one)(resident_blocks, traced_blocks)


class Looped:
    """One block per iteration of a loop (the form of a ``scan`` in ``fn``, or of LAPACK
    kernels that must run in place)."""

    name = "looped"

    def partials(self, program, kernel, wrt: Wrt, prepared, valid, first, count,
                 length: int, traced, shared) -> Partials:
        """Blocks ``[first, first + count)`` of ``prepared`` one per loop iteration
        (``traced`` and ``valid`` hold only those blocks), written to buffers of
        ``length`` blocks; every block masked (the padding of the last one)."""
        program.traces[(self.name + kernel.label, int(length))] += 1
        rows = program.spec.plan.block_rows
        values = jnp.zeros((length,), np.dtype(program.spec.value_dtype))
        shared_grads = tuple(jnp.zeros((length,) + jnp.shape(s), jnp.result_type(s))
                             for s, d in zip(shared, wrt.shared) if d)
        data_grads = tuple(jnp.zeros((length, rows) + jnp.shape(t)[2:], jnp.result_type(t))
                           for t, d in zip(traced, wrt.traced) if d)
        body = functools.partial(_loop_step, program, kernel, wrt, prepared, traced, shared,
                                 valid, first)
        # Pinned outside the loop: it may still compile as one kernel, alike on every route.
        return Partials(*lax.fori_loop(0, count, body,
                                       (values, shared_grads, data_grads))).pinned()

    def graph(self, program, kernel, prepared, prepared_tail, traced, shared, valid,
              wrt: Wrt, set_axes, traced_axes) -> Partials:
        """Every block inside the caller's program, looped (a batch of parameter sets
        mapped around the loop, set by set where LAPACK kernels must not batch)."""
        del prepared_tail, traced_axes
        n_blocks = program.spec.plan.n_blocks
        one = functools.partial(self.partials, program, kernel, wrt, prepared, valid,
                                jnp.int32(0), jnp.int32(n_blocks), n_blocks)
        if set_axes is None:
            return one(traced, shared)
        if program.spec.lapack_rows:  # a batch would batch the kernels' matrices
            return set_by_set(one, set_axes)(traced, shared)
        return jax.vmap(one, set_axes)(traced, shared)

    def chunk_program(self, program, kernel, blocks: int, wrt: Wrt, in_axes, split: bool):
        """A host chunk of ``blocks`` blocks, to be compiled: ``f(prepared, traced, shared,
        valid, first, count)``, where ``prepared`` may hold more blocks (from ``first``
        on); a batch of parameter sets (or of tangents) mapped around the loop."""
        del split  # every looped block is masked
        return functools.partial(_looped_chunk, self, program, kernel, blocks, wrt, in_axes)

    def sum_blocks(self, one, resident_blocks, traced_blocks):
        """As :meth:`Batched.sum_blocks`, one block after another (``fn`` cannot be
        batched, or is a loop)."""
        return lax.map(lambda blocks: one(*blocks), (resident_blocks, traced_blocks))


def _loop_step(program, kernel, wrt, prepared, traced, shared, valid, first, i, carry):
    """Iteration ``i`` of :meth:`Looped.partials`: block ``first + i`` into the buffers."""
    values, shared_grads, data_grads = carry
    block_prepared = tuple(lax.dynamic_index_in_dim(x, first + i, keepdims=False)
                           for x in prepared)
    block_traced = tuple(lax.dynamic_index_in_dim(x, i, keepdims=False) for x in traced)
    block_valid = lax.dynamic_index_in_dim(valid, i, keepdims=False)
    out = program.block(block_prepared, block_traced, shared, block_valid, kernel=kernel,
                        wrt=wrt, counted=RowsBefore, finish=as_is)
    return (values.at[i].set(out.values),
            tuple(a.at[i].set(g) for a, g in zip(shared_grads, out.shared_grads)),
            tuple(a.at[i].set(g) for a, g in zip(data_grads, out.data_grads)))


def _looped_chunk(layout, program, kernel, blocks, wrt, in_axes, prepared, traced, shared,
                  valid, first, count):
    """:meth:`Looped.chunk_program`'s program."""
    one = functools.partial(layout.partials, program, kernel, wrt, prepared, valid, first,
                            count, blocks)
    return one(traced, shared) if in_axes is None else jax.vmap(one, in_axes)(traced, shared)


BATCHED, LOOPED = Batched(), Looped()

#: The layout of each :attr:`.spec.SiteSpec.form`.
LAYOUTS: dict[str, Batched | Looped] = {"batched": BATCHED, "looped": LOOPED}
