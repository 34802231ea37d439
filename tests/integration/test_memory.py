"""No hidden growth: an executor never keeps the user's arrays alive, and its sites are
bounded.

A model is fitted with real NUTS (and its gradient jitted) on the process-wide default
executor and on a thread pool; then the model, the run and the data are dropped. The
data's arrays must be garbage collected: a site holds a prepared copy of its data
(keyed by content, so that every trace of a model finds it again), never the user's
arrays; prepared blocks that were numpy views of the user's JAX arrays would keep them
alive. The executor's sites are bounded in number and bytes (least recently used out
first). NumPyro's and JAX's own bounded caches, which hold the last sampling loops'
arguments, are cleared first.
"""

import functools
import gc
import sys
import weakref

import jax
import numpy as np
from numpyro.infer import MCMC, NUTS

import parallel_backend as pb
from helpers import regression_data, regression_loglik, regression_model

N = 50_000


def fit_and_drop(executor):
    """Fit, evaluate a jitted gradient, drop everything; weak references to the data's
    leaves and the number of sites the executor held before the drop."""
    data = regression_data(N, seed=5)
    refs = [weakref.ref(leaf) for leaf in jax.tree.leaves(data)]
    grad = jax.jit(jax.grad(lambda a, d=data: pb.reduce_sum(regression_loglik, d, a, 1.0, 1.0,
                                                            executor=executor)))
    assert np.isfinite(float(grad(0.3)))
    mcmc = MCMC(NUTS(regression_model), num_warmup=20, num_samples=10, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), data, executor, None)
    assert np.isfinite(np.asarray(mcmc.get_samples()["alpha"])).all()
    held = len((executor or pb.get_default_executor()).sites())
    del data, grad, mcmc
    return refs, held


def clear_numpyro_caches():
    """NumPyro keeps its last 8 sampling loops (with their arguments, the data among
    them) in caches on its own functions (``numpyro.util.cached_by``): bounded, and
    not ours. Clear them so that what is left alive is what this project holds."""
    import numpyro.infer.mcmc
    import numpyro.util

    for module in (numpyro.util, numpyro.infer.mcmc):
        for obj in vars(module).values():
            cache = getattr(obj, "_cache", None)
            if callable(obj) and hasattr(cache, "clear"):
                cache.clear()


def clear_jax_tracing_caches():
    """JAX's tracing caches (``functools.lru_cache`` in ``jax._src``, which
    ``jax.clear_caches`` leaves) hold NumPyro's jitted sampling loop, whose closure
    holds the model's arguments. Bounded too, and not ours: clear them as well."""
    for name, module in list(sys.modules.items()):
        if name.startswith("jax._src") and module is not None:
            for obj in list(vars(module).values()):
                if isinstance(obj, functools._lru_cache_wrapper):
                    obj.cache_clear()


def collect():
    clear_numpyro_caches()
    jax.clear_caches()
    clear_jax_tracing_caches()
    for _ in range(3):
        gc.collect()


def test_dropped_data_is_freed_on_the_default_executor():
    refs, held = fit_and_drop(None)
    assert held >= 1
    collect()
    alive = [r for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} data leaves still alive after the drop"


def test_dropped_data_is_freed_on_a_thread_pool():
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        refs, held = fit_and_drop(ex)
        assert held >= 1
        collect()
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of {len(refs)} data leaves still alive after the drop"


def test_sites_are_bounded_in_number_and_bytes():
    from parallel_backend.site import SiteCache

    with pb.SerialExecutor() as ex:
        ex._states = SiteCache(max_sites=3, max_bytes=10 * N * 4, on_forget=ex._retire)
        for seed in range(6):  # six datasets, one site each
            data = regression_data(N, seed=seed)
            jax.jit(lambda a, d=data: pb.reduce_sum(regression_loglik, d, a, 1.0, 1.0,
                                                    executor=ex))(0.3)
        assert len(ex.sites()) == 3
        assert sum(s.nbytes for s in ex.sites()) <= 10 * N * 4
