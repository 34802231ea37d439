"""Where the demo's two fits start: the MAP of the model's posterior and the Laplace
approximation there (its covariance is the fits' mass matrix), and a warning where the
precision cannot resolve the log-density for NUTS.

Imports numpy and the standard library at module level; jax and numpyro inside the
functions. Nothing of parallel_backend: the model given is evaluated as it is written
(with ``pb.factor`` sites and an executor, in parallel).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

__all__ = ["Start", "chain_inits", "laplace_start", "precision_note"]


class Start(NamedTuple):
    """Where both fits start and the mass matrix they sample with (:func:`laplace_start`).

    ``params``: the MAP in NumPyro's unconstrained space (a dict of arrays).
    ``inverse_mass_matrix``: the inverse of the potential energy's Hessian at ``params``
    (the Laplace approximation's covariance, ``(d, d)``, float64), or ``None`` where the
    Hessian was not positive definite (then warmup adapts the mass matrix).
    ``steps``: Adam steps taken. ``seconds``: wall time of the search and the Hessian,
    compilation included. ``decrement``: ``g' H^-1 g`` at ``params`` (about the squared
    distance to the optimum, in posterior sds; ``nan`` without a Hessian). ``potential``:
    the potential energy (minus the log-density) at ``params``.
    """

    params: dict
    inverse_mass_matrix: np.ndarray | None
    steps: int
    seconds: float
    decrement: float
    potential: float


def laplace_start(model, model_args=(), model_kwargs=None, init_values=None, steps: int = 200,
                  seed: int = 0) -> Start:
    """The MAP of ``model``'s posterior in NumPyro's unconstrained space, found by ``steps``
    Adam steps (learning rate 0.05 decaying to 0.001) on its potential energy, the Hessian
    there (one Hessian-vector product per dimension, one after the other, so the memory is
    one gradient's), and three Newton steps with that Hessian (kept where they bring the
    gradient closer to zero).

    Every evaluation goes through the model as given: with ``pb.factor`` sites and an
    executor in ``model_kwargs``, in parallel. ``init_values`` (constrained, a value for
    every latent site) is where the search starts; default: the prior's median.
    """
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree
    from numpyro.infer import init_to_median
    from numpyro.infer.util import initialize_model, potential_energy, unconstrain_fn

    began = time.perf_counter()
    model_args, model_kwargs = tuple(model_args), dict(model_kwargs or {})
    if init_values:
        # Compiled: run eagerly, the model's likelihood (an HMM's scan) costs seconds.
        z0 = jax.jit(lambda values: unconstrain_fn(model, model_args, model_kwargs, values))(
            {k: jnp.asarray(v) for k, v in init_values.items()})
    else:
        z0 = initialize_model(jax.random.PRNGKey(seed), model, init_strategy=init_to_median(),
                              model_args=model_args, model_kwargs=model_kwargs,
                              validate_grad=False).param_info.z
    x0, unravel = ravel_pytree(z0)

    def potential(x):
        return potential_energy(model, model_args, model_kwargs, unravel(x))

    @jax.jit
    def search(x):
        value_and_grad = jax.value_and_grad(potential)

        def step(carry, t):
            x, m, v = carry
            _, g = value_and_grad(x)
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            rate = 0.05 * (0.001 / 0.05) ** (t / steps)
            x = x - rate * (m / (1 - 0.9 ** (t + 1))) / (jnp.sqrt(v / (1 - 0.999 ** (t + 1)))
                                                         + 1e-8)
            return (x, m, v), None

        zero = jnp.zeros_like(x)
        (x, _, _), _ = jax.lax.scan(step, (x, zero, zero), jnp.arange(steps, dtype=x.dtype))
        return x

    @jax.jit
    def polish(x):
        grad = jax.grad(potential)
        hessian = jax.lax.map(lambda v: jax.jvp(grad, (x,), (v,))[1],
                              jnp.eye(x.size, dtype=x.dtype))
        hessian = 0.5 * (hessian + hessian.T)

        def newton(y, _):
            return y - jnp.linalg.solve(hessian, grad(y)), None

        y, _ = jax.lax.scan(newton, x, None, length=3)
        return hessian, grad(x), y, grad(y), potential(x), potential(y)

    x = search(x0) if steps > 0 else x0
    if not bool(jnp.all(jnp.isfinite(x))):
        x = x0
    hessian, gradient, y, gradient_y, value, value_y = (np.asarray(a, np.float64)
                                                        for a in polish(x))
    inverse, decrement = None, float("nan")
    if np.all(np.isfinite(hessian)) and np.all(np.isfinite(gradient)):
        w, v = np.linalg.eigh(hessian)
        if w.min() > 0:
            inverse = (v / w) @ v.T
            decrement = float(gradient @ inverse @ gradient)
            # Three Newton steps with this Hessian, kept where they brought the gradient
            # closer to zero (as this Hessian measures it).
            after = float(gradient_y @ inverse @ gradient_y)
            if np.all(np.isfinite(y)) and after < decrement:
                x, decrement, value = jnp.asarray(y, x.dtype), after, value_y
    return Start(unravel(x), inverse, steps, time.perf_counter() - began, decrement,
                 float(value))


def chain_inits(start: Start, num_chains: int, seed: int = 0, spread: float = 2.0) -> dict:
    """Each chain's initial unconstrained values: a draw from the Laplace approximation
    with its sds multiplied by ``spread`` (so several chains start apart and r-hat sees
    chains that have not mixed), or the MAP itself without a Hessian. A leading chain
    axis when ``num_chains > 1`` (as ``pb.sample``'s ``init_params`` takes them)."""
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    flat, unravel = ravel_pytree(start.params)
    centre = np.asarray(flat, np.float64)
    points = np.repeat(centre[None], num_chains, axis=0)
    if start.inverse_mass_matrix is not None:
        root = np.linalg.cholesky(start.inverse_mass_matrix)
        noise = np.random.default_rng(seed).standard_normal((num_chains, centre.size))
        points = points + spread * noise @ root.T
    points = jnp.asarray(points, flat.dtype)
    return unravel(points[0]) if num_chains == 1 else jax.vmap(unravel)(points)


def precision_note(potential: float, dtype) -> str:
    """A warning where ``dtype`` cannot resolve the potential energy to a quarter of a nat
    (float32 from about 2 million, the HMM from about 11,000 sequences): NUTS accepts
    or rejects on energy differences of a fraction of a nat, and the round-off of the sum
    can swamp them. The HMM at 50,000 sequences: the sum is 9.3 million, float32 steps by
    1 nat there, and the float32 sum at nearby points was 4.7 to 5.5 nats off float64's;
    from :func:`laplace_start` a float32 chain adapted its step size to 2e-5, ran every
    tree to the 31-step limit and did not move, where float64 converged. Empty otherwise.

    Examples
    --------
    >>> precision_note(9.3e6, np.float32)[:56]
    'PRECISION: the log-density at the MAP is -9.3e+06, where'
    >>> precision_note(9.3e6, np.float64), precision_note(5.6e5, np.float32)
    ('', '')
    """
    if not np.isfinite(potential):
        return ""
    step = float(np.spacing(np.asarray(abs(potential), dtype)))
    if step < 0.25:
        return ""
    return (f"PRECISION: the log-density at the MAP is {-potential:.4g}, where "
            f"{np.dtype(dtype).name} steps by {step:g} nat; NUTS's energy differences (a "
            "fraction of a nat) drown in that round-off, and a chain may not converge: "
            "run with --float64")
