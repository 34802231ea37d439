"""``pb.sample``: NumPyro's NUTS on an executor, returned in ArviZ's format; checkpoints,
resuming, and a finished run that no later error can lose.

The chains run in this plugin's loop (:class:`~.chains.Chains`: NumPyro's
``kernel.init`` and ``kernel.sample``, bitwise ``MCMC.run``'s draws), with the progress
callback compiled in (:mod:`.progress`); it also splits the wall time between warmup and
sampling. The tuner (:mod:`.tuning`) times the sites' routes on segments of the run and
records its choice on each site. With ``checkpoint=`` the loop runs in segments of
``checkpoint_every`` iterations, each followed by a checkpoint (:mod:`.checkpoint`);
every segment, and an uninterrupted run, is the same compiled program, so a resumed
run's draws are those of an uninterrupted one. The result goes through the ArviZ
plugin's ``to_arviz``, which computes the pointwise log-likelihood on the same executor;
if that or anything else after sampling fails, the draws are in a checkpoint file and
:class:`ConversionError` says where. Imports jax, numpy, numpyro, the core's public
names, the ArviZ plugin's ``convert`` and ``io`` and the NumPyro plugin's ``replay``.
"""

from __future__ import annotations

import copy
import numbers
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from numpyro.infer import NUTS
from numpyro.infer.hmc import HMC
from numpyro.infer.mcmc import MCMCKernel

import parallel_backend as pb
from parallel_backend.extend import check_count, resolve_executor

from ..arviz.convert import to_arviz
from ..arviz.io import load
from ..numpyro.replay import HMC_EXTRA_FIELDS
from . import checkpoint as ckpt
from .chains import Chains
from .fingerprint import check, fingerprint, signature
from .loop import collected_fields, lanes_for, to_host
from .progress import Progress
from .tuning import Tuner

if TYPE_CHECKING:
    import arviz
    import xarray

__all__ = ["ConversionError", "sample"]

CHAIN_METHODS = ("vectorized", "parallel", "sequential")


def sample(model: Callable[..., Any] | MCMCKernel, *model_args: Any, num_warmup: int = 1000,
           num_samples: int = 1000, num_chains: int = 4,
           chain_method: str | Callable[..., Any] = "vectorized", seed: int | jax.Array = 0,
           executor: pb.Executor | str | None = None, progress_bar: bool = True,
           init_params: Any = None, nuts_kwargs: Mapping[str, Any] | None = None,
           posterior_predictive: bool = False, arviz_kwargs: Mapping[str, Any] | None = None,
           checkpoint: str | os.PathLike[str] | None = None, checkpoint_every: int = 100,
           **model_kwargs: Any) -> xarray.DataTree | arviz.InferenceData:
    """Run NumPyro's NUTS on ``model`` and return the run in ArviZ's format.

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
        Show progress with NumPyro's figures, gradient evaluations per second and the
        executor's worker count: a bar in a terminal and in Jupyter (a widget with
        ipywidgets installed, a text bar without); elsewhere (a batch job, a pipe) an
        INFO line on the ``parallel_backend.sample`` logger at every tenth of the run.
    init_params : pytree, optional
        Initial unconstrained values, as for ``MCMC.run``.
    nuts_kwargs : dict, optional
        Passed to ``NUTS`` (``target_accept_prob``, ``max_tree_depth``,
        ``dense_mass``...); not allowed with a kernel.
    posterior_predictive : bool
        Add a ``posterior_predictive`` group: a draw of every observed site
        (``pb.observe`` and ``numpyro.sample(obs=...)``) at every posterior draw, dims as
        the site's ``observed_data`` (ready for ``arviz.plot_ppc``, ``arviz.loo_pit``),
        drawn with a key made from ``seed``; a resumed run gets the same draws.
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
    xarray.DataTree or arviz.InferenceData
        As the installed ArviZ keeps a run (1.x: ``DataTree``; 0.x: ``InferenceData``);
        see :func:`parallel_backend.to_arviz`. ``attrs`` also hold
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
    parallel_backend.plugins.sample.CheckpointError
        ``checkpoint`` holds another run, or is not a checkpoint (a ``ValueError``).
    ConversionError
        Sampling finished, but converting the run failed; the error says in which file
        the draws are (a checkpoint: ``checkpoint`` or one of its own) and carries them.

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
    lanes = lanes_for(kernel, chain_method, num_chains)
    settings = _settings(num_warmup, num_samples, num_chains, chain_method, seed, init_params)

    print_ = fingerprint(model, kernel, settings, model_args, model_kwargs)
    saved = None
    if path is not None:
        saved = ckpt.read(path)
        if saved is not None:
            check(saved, print_, path)
            if saved.finished:
                return load(path)
            ckpt.warn_versions(saved, path)

    ex = resolve_executor(executor)
    history = ckpt.History(saved, num_warmup + num_samples,
                           lanes.kind == "each" and num_chains > 1)
    progress = Progress(ex, num_chains, num_warmup, num_samples,
                        enabled=bool(progress_bar), done=history.transitions,
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
        print_.update(signature(one, draws))
        if saved is not None:
            check(saved, print_, path)
            names = ckpt.draw_names(fields, draws)
            held = saved.draws
            assert held is not None  # a checkpoint to continue holds its draws (ckpt.read)
            chains.restore(ckpt.unpack(saved.state, jax.tree.leaves(to_host(one))),
                           [held[n] for n in names], saved.done)
        if path is not None:
            on_segment = ckpt.writer(path, chains, fields, draws, print_, history, progress)
        tuner = Tuner(chains.segments, progress)
        chains.run(checkpoint_every if path is not None else None, on_segment, tuner)
        progress.finish()
        tuner.count_graph_evaluations()
    attrs = {"chain_method": chain_method if isinstance(chain_method, str) else "callable",
             "num_warmup": int(num_warmup), **history.attrs(progress.seconds)}
    predictive: dict[str, Any] = ({"posterior_predictive": True,
                                   "predictive_seed": jax.random.fold_in(key, 1)}
                                  if posterior_predictive else {})
    # From here on the draws exist: whatever fails must not lose them.
    try:
        run = to_arviz(chains.result(), executor=ex, attrs=attrs, **predictive,
                       **(arviz_kwargs or {}))
    except Exception as e:
        raise _rescue(e, path, chains, fields, draws, print_, history, progress) from e
    if path is not None:
        try:
            ckpt.finish(path, run, print_)
        except Exception as e:  # noqa: BLE001 - the run is in hand; the file has the draws
            warnings.warn(f"sample: the finished run could not be written to {path!r} "
                          f"({type(e).__name__}: {e}); it is returned, and the file still "
                          "holds every draw as an unfinished checkpoint", stacklevel=2)
    return run


class ConversionError(RuntimeError):
    """Sampling finished, but what came after it (the conversion to ArviZ's format, the
    pointwise log-likelihood) failed. The draws are not lost: ``path`` is a checkpoint
    file that holds every draw and the sampler state (``load(path)`` reads the draws;
    ``pb.sample(..., checkpoint=path)`` with the same arguments converts them again),
    and ``run`` holds them in memory (``run.get_samples(group_by_chain=True)``).

    Attributes
    ----------
    path : str or None
        Where the draws were written (``None`` if that failed too).
    run : object
        The finished run, with ``MCMC``'s ``get_samples`` and ``get_extra_fields``.
    """

    def __init__(self, message, path, run):
        super().__init__(message)
        self.path = path
        self.run = run


def _rescue(error, path, chains, fields, draws, print_, history, progress) -> ConversionError:
    """The error to raise when sampling finished but its conversion failed: the draws
    written to ``path`` (the checkpoint holds them already) or to a file of their own."""
    what = f"{type(error).__name__}: {error}"
    if path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(tempfile.gettempdir(), f"parallel_backend-{stamp}-{os.getpid()}.nc")
        try:
            ckpt.writer(path, chains, fields, draws, print_, history, progress)()
        except Exception as e:  # noqa: BLE001 - say so; the draws are still carried
            return ConversionError(
                f"sample: sampling finished, then {what}. Writing the draws to {path!r} failed "
                f"too ({type(e).__name__}: {e}); they are in this error's .run "
                "(.run.get_samples(group_by_chain=True)).", None, chains.result())
    return ConversionError(
        f"sample: sampling finished, then {what}. Nothing is lost: every draw and the "
        f"sampler state are in {path!r}. Read the draws with "
        f"parallel_backend.plugins.arviz.load({path!r}), or call pb.sample again with the same "
        f"model, arguments and settings and checkpoint={path!r} to convert them again "
        "without sampling (after fixing the cause). This error's .run holds them too.",
        path, chains.result())


def _settings(num_warmup, num_samples, num_chains, chain_method, seed, init_params) -> dict:
    """``pb.sample``'s arguments that a continued run must share (not the executor, the
    progress bar or ``checkpoint_every``: they do not change a draw)."""
    return {"num_warmup": num_warmup, "num_samples": num_samples, "num_chains": num_chains,
            "chain_method": chain_method, "init_params": init_params,
            "seed": seed if isinstance(seed, numbers.Integral) else to_host(seed).tolist()}


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
