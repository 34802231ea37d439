"""``pb.sample``: NumPyro NUTS on an executor, returned as ``arviz.InferenceData``;
checkpoints and resuming.

The chains run in the loop of :mod:`.driver` (NumPyro's ``kernel.init`` and
``kernel.sample``, bitwise ``MCMC.run``'s draws), with the progress callback of
:mod:`.progress` compiled in; it also splits the wall time between warmup and
sampling. With ``checkpoint=`` the loop runs in segments of ``checkpoint_every``
iterations, each followed by a checkpoint (:mod:`.checkpoint`); every segment, and an
uninterrupted run, is the same compiled program, so a resumed run's draws are those of
an uninterrupted one. The result goes through ``pb.to_arviz``, which computes the
pointwise log-likelihood on the same executor. ArviZ is imported inside
:func:`sample`, so this module imports without it. Imports jax, numpyro and the core's
public names.
"""

from __future__ import annotations

import copy
import json
import numbers
import os
import warnings

import jax
import numpy as np
import numpyro
from numpyro.infer import NUTS
from numpyro.infer.hmc import HMC
from numpyro.infer.mcmc import MCMCKernel

import parallel_backend as pb
from parallel_backend.extend import check_count, resolve_executor

from . import checkpoint as ckpt
from .chains import Chains
from .driver import collected_fields, lanes_for, to_host
from .progress import Progress, terminal
from .replay import HMC_EXTRA_FIELDS

__all__ = ["sample"]

CHAIN_METHODS = ("vectorized", "parallel", "sequential")


def sample(model, *model_args, num_warmup=1000, num_samples=1000, num_chains=4,
           chain_method="vectorized", seed=0, executor=None, progress_bar=True,
           init_params=None, nuts_kwargs=None, arviz_kwargs=None, checkpoint=None,
           checkpoint_every=100, **model_kwargs):
    """Run NumPyro's NUTS on ``model`` and return ``arviz.InferenceData``.

    Every ``pb.reduce_sum``/``pb.factor`` inside the model runs on ``executor``
    (unless the site names its own). With ``chain_method="vectorized"`` the chains
    are a batch axis of every parameter: one evaluation carries all chains, and the
    executor sees chains x chunks as parallel work.

    Parameters
    ----------
    model : callable or numpyro.infer.mcmc.MCMCKernel
        A NumPyro model, or a kernel the user configured (``NUTS(model, ...)``).
    *model_args, **model_kwargs
        The model's arguments.
    num_warmup, num_samples, num_chains : int
        As for ``numpyro.infer.MCMC``.
    chain_method : {"vectorized", "parallel", "sequential"}
        As for ``numpyro.infer.MCMC``.
    seed : int or jax PRNG key
        The same seed gives the same draws, whichever executor or worker count.
    executor : Executor or str, optional
        Default: the innermost ``use_executor``, else the default executor. A name
        (``"thread"``) makes one for this call and closes it afterwards.
    progress_bar : bool
        Show a bar (only when ``sys.stdout`` is a terminal) with NumPyro's figures,
        gradient evaluations per second and the executor's worker count.
    init_params : pytree, optional
        Initial unconstrained values, as for ``MCMC.run``.
    nuts_kwargs : dict, optional
        Passed to ``NUTS`` (``target_accept_prob``, ``max_tree_depth``,
        ``dense_mass``...); not allowed with a kernel.
    arviz_kwargs : dict, optional
        Passed to :func:`parallel_backend.to_arviz` (``coords``, ``dims``,
        ``log_likelihood=False``...).
    checkpoint : str or os.PathLike, optional
        A netCDF file. Every ``checkpoint_every`` iterations (warmup and sampling) the
        draws so far and the sampler state (step size, mass matrix, adaptation state,
        PRNG keys) replace it atomically. If the file is there when ``sample`` starts,
        the run continues from it, with the draws an uninterrupted run would give,
        whichever executor ran each part; a file of another run (other settings, model
        or data) is refused and left as it is. When the run ends the file holds the
        whole run (:func:`parallel_backend.plugins.arviz.load` reads it); calling
        ``sample`` again then returns it.
    checkpoint_every : int
        Iterations between checkpoints (per chain; sequential chains also get one when
        a chain ends).

    Returns
    -------
    arviz.InferenceData
        See :func:`parallel_backend.to_arviz`; ``attrs`` also hold
        ``warmup_seconds`` and ``sampling_seconds`` (compilation included, all parts
        of a resumed run added), ``resume_count`` and, for a resumed run,
        ``resumed_from`` (the iteration each resume started at; with sequential
        chains ``resumed_chain`` says whose).

    Raises
    ------
    TypeError
        ``model`` is neither callable nor a kernel; a bad ``seed``.
    ValueError
        Bad counts or ``chain_method``; ``nuts_kwargs`` together with a kernel; a
        ``checkpoint`` in a folder that does not exist.
    parallel_backend.plugins.numpyro.CheckpointError
        ``checkpoint`` holds another run, or is not a checkpoint (a ``ValueError``).

    Examples
    --------
    >>> import os, tempfile
    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> y = jnp.linspace(-1.0, 1.0, 50)
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     pb.factor("y", lambda y, mu: dist.Normal(mu, 1.0).log_prob(y), y, mu)
    >>> idata = pb.sample(model, y, num_warmup=50, num_samples=20, num_chains=2,
    ...                   progress_bar=False)
    >>> idata.posterior["mu"].shape, idata.log_likelihood["y"].shape
    ((2, 20), (2, 20, 50))

    With a checkpoint, a second call continues (here: returns) the run in the file:

    >>> path = os.path.join(tempfile.mkdtemp(), "run.nc")
    >>> a = pb.sample(model, y, num_warmup=50, num_samples=20, num_chains=2,
    ...               progress_bar=False, checkpoint=path, checkpoint_every=25)
    >>> b = pb.sample(model, y, num_warmup=50, num_samples=20, num_chains=2,
    ...               progress_bar=False, checkpoint=path, checkpoint_every=25)
    >>> bool((a.posterior["mu"] == idata.posterior["mu"]).all()), b.attrs["checkpoint_status"]
    (True, 'finished')
    """
    try:
        import arviz  # noqa: F401 - fail before sampling, not after
    except ImportError as e:
        raise ImportError('pb.sample returns arviz.InferenceData and needs ArviZ: '
                          'pip install "parallel-backend[arviz]"') from e

    _check_count("num_warmup", num_warmup, 0)
    _check_count("num_samples", num_samples, 1)
    _check_count("num_chains", num_chains, 1)
    _check_count("checkpoint_every", checkpoint_every, 1)
    if not callable(chain_method) and chain_method not in CHAIN_METHODS:
        raise ValueError(f"sample: chain_method must be one of {list(CHAIN_METHODS)}, "
                         f"got {chain_method!r}")
    if isinstance(model, MCMCKernel):
        if nuts_kwargs:
            raise ValueError("sample: nuts_kwargs apply only when model is a model function; "
                             f"configure the kernel you passed instead (got {sorted(nuts_kwargs)})")
        kernel = model
    elif callable(model):
        kernel = NUTS(model, **(nuts_kwargs or {}))
    else:
        raise TypeError("sample: model must be a NumPyro model (a callable) or an MCMCKernel "
                        f"such as NUTS(model), got {type(model).__name__}")
    key = _key(seed)
    path = _path(checkpoint)
    lanes = lanes_for(chain_method, num_chains)

    fingerprint = saved = None
    if path is not None:
        fingerprint = ckpt.fingerprint(model, kernel, _settings(
            num_warmup, num_samples, num_chains, chain_method, seed, init_params),
            model_args, model_kwargs)
        saved = ckpt.read(path)
        if saved is not None:
            ckpt.check(saved, fingerprint, path)
            if saved.finished:
                from parallel_backend.plugins.arviz.io import load

                return load(path)
            _warn_version(saved, path)

    own = isinstance(executor, str)
    ex = resolve_executor(executor)
    try:
        history = _History(saved, num_warmup + num_samples,
                           lanes.kind == "each" and num_chains > 1)
        progress = Progress(ex, num_chains, num_warmup, num_samples,
                            enabled=bool(progress_bar) and terminal(), done=history.transitions,
                            resumed_from=history.resumed_at, resume_count=history.count)
        # A copy: NumPyro's HMC keeps what init builds (a vectorized init wraps its
        # sample function in vmap), so a kernel used twice must start afresh.
        kernel = copy.copy(kernel)
        fields = collected_fields(kernel, HMC_EXTRA_FIELDS if isinstance(kernel, HMC) else ())
        chains = Chains(kernel, lanes, fields, num_chains, num_warmup, num_samples,
                        model_args, model_kwargs, progress.tick)
        on_segment = None
        with pb.use_executor(ex), progress:
            one, draws = chains.start(key, init_params, resume=saved is not None)
            if path is not None:
                signature = ckpt.signature(one, draws)
                if saved is not None:
                    ckpt.check(saved, signature, path)
                    names = ckpt.draw_names(fields, draws)
                    chains.restore(ckpt.unpack(saved.state, jax.tree.leaves(to_host(one))),
                                   [saved.draws[n] for n in names], saved.done)
                fingerprint.update(signature)
                on_segment = _writer(path, chains, fields, draws, fingerprint, history, progress)
            chains.run(checkpoint_every if path is not None else None, on_segment)
            progress.finish()
        attrs = {"chain_method": chain_method if isinstance(chain_method, str) else "callable",
                 "num_warmup": int(num_warmup), **history.attrs(progress.seconds)}
        idata = pb.to_arviz(chains.result(), executor=ex, attrs=attrs, **(arviz_kwargs or {}))
        if path is not None:
            ckpt.finish(path, idata, fingerprint)
        return idata
    finally:
        if own:
            ex.close()


class _History:
    """A run's parts so far: resumes (from a checkpoint's attributes) and wall seconds."""

    def __init__(self, saved, total: int, sequential: bool):
        before = saved.attrs if saved is not None else {}
        self.count = int(before.get("resume_count", 0)) + (saved is not None)
        self.resumed_from = list(before.get("resumed_from", []))
        self.resumed_chain = list(before.get("resumed_chain", []))
        self.seconds = {"warmup": float(before.get("warmup_seconds", 0.0)),
                        "sample": float(before.get("sampling_seconds", 0.0))}
        self.transitions = int(np.sum(saved.done)) if saved is not None else 0
        self.resumed_at = None
        self.sequential = sequential
        if saved is not None:
            # The first chain not finished: where this part starts.
            chain = next((c for c, d in enumerate(saved.done) if d < total), len(saved.done) - 1)
            self.resumed_at = int(saved.done[chain])
            self.resumed_from.append(self.resumed_at)
            self.resumed_chain.append(chain)

    def attrs(self, seconds: dict) -> dict:
        """``warmup_seconds``/``sampling_seconds`` of every part, and the resumes."""
        out = {"warmup_seconds": self.seconds["warmup"] + seconds["warmup"],
               "sampling_seconds": self.seconds["sample"] + seconds["sample"],
               "resume_count": self.count}
        if self.count:
            out["resumed_from"] = list(self.resumed_from)
            if self.sequential:
                out["resumed_chain"] = list(self.resumed_chain)
        return out


def _writer(path, chains, fields, draws, fingerprint, history, progress):
    """What runs after each segment: the checkpoint of everything so far."""
    names = ckpt.draw_names(fields, draws)
    base = {"parallel_backend_version": pb.__version__, "jax_version": jax.__version__,
            "numpyro_version": numpyro.__version__,
            "checkpoint_fingerprint": json.dumps(fingerprint, sort_keys=True),
            "num_chains": chains.num_chains, "num_samples": chains.num_samples,
            "num_warmup": chains.num_warmup}

    def write():
        state, values, done = chains.snapshot()
        ckpt.write(path, attrs={**base, **history.attrs(progress.seconds)}, state_leaves=state,
                   draws=dict(zip(names, values)), done=done, num_warmup=chains.num_warmup)

    return write


def _settings(num_warmup, num_samples, num_chains, chain_method, seed, init_params) -> dict:
    """``pb.sample``'s arguments that a continued run must share (not the executor, the
    progress bar or ``checkpoint_every``: they do not change a draw)."""
    return {"num_warmup": num_warmup, "num_samples": num_samples, "num_chains": num_chains,
            "chain_method": chain_method, "init_params": init_params,
            "seed": seed if isinstance(seed, numbers.Integral) else to_host(seed).tolist()}


def _warn_version(saved, path) -> None:
    version = saved.attrs.get("parallel_backend_version")
    if version != pb.__version__:
        warnings.warn(f"sample: the checkpoint {path!r} was written by parallel_backend "
                      f"{version}, this is {pb.__version__}: its draws may differ from an "
                      "uninterrupted run's", stacklevel=3)


def _path(checkpoint):
    if checkpoint is None:
        return None
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"sample: checkpoint must be a file path (str or os.PathLike), got "
                        f"{type(checkpoint).__name__}")
    path = os.path.abspath(os.fspath(checkpoint))
    if not os.path.isdir(os.path.dirname(path)):
        raise ValueError(f"sample: the folder of checkpoint {os.fspath(checkpoint)!r} does not "
                         "exist; create it first")
    return path


def _check_count(name, value, least):
    check_count(value, name, "sample", least=least)


def _key(seed):
    if isinstance(seed, bool):
        raise TypeError(f"sample: seed must be an int or a jax PRNG key, got {seed!r}")
    if isinstance(seed, numbers.Integral):
        return jax.random.PRNGKey(int(seed))
    shape = getattr(seed, "shape", None) if isinstance(seed, (jax.Array, np.ndarray)) else None
    if shape is None or not (shape == () or shape[-1:] == (2,)):
        raise TypeError(f"sample: seed must be an int or a jax PRNG key "
                        f"(jax.random.PRNGKey(0) or jax.random.key(0)), got {seed!r}")
    return seed
