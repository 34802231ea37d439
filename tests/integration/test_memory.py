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

A site that leaves the cache frees what it placed elsewhere (issue 38): the buffers a
``DeviceExecutor`` put on its devices (counted with ``jax.live_arrays()``, here and on
two forced CPU devices in a subprocess) and the spec and data shards a ``DaskExecutor``
sent to the worker processes of a real ``LocalCluster`` (counted there with
``client.run``), unless another cached site shares them; ``close()`` leaves nothing.
"""

import functools
import gc
import os
import re
import sys
import warnings
import weakref

import cloudpickle
import jax
import numpy as np
import pytest
from numpyro.infer import MCMC, NUTS

import helpers
import parallel_backend as pb
from helpers import regression_data, regression_loglik, regression_model
from parallel_backend.site import SiteCache

# Workers cannot import this test module by name: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(helpers)

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


@pytest.mark.slow
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


# -- evicted sites free what they placed: device buffers, dask workers' data -----------

#: Rows of one evicting site's data: two float32 columns, 800 kB.
ROWS = 100_000
BLOCK_ROWS = 5000  # 20 blocks in 2 tiles: one data shard per worker of 2
FORCED = "PARALLEL_BACKEND_TEST_FORCED_DEVICES"
#: Device bytes beyond the sites' data (masks of valid rows and the like).
SLACK = 64 * 1024


def site_rows(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=ROWS).astype(np.float32),
            "y": rng.normal(size=ROWS).astype(np.float32)}


def gauss(rows, mu):
    return -0.5 * (rows["x"] - mu) ** 2 - rows["y"]


def gauss_scaled(rows, mu):
    return -0.5 * (2.0 * rows["x"] - mu) ** 2 - rows["y"]


def program(executor, seed, fn=gauss):
    """A new jitted gradient over fresh data: one new site of ``executor``."""
    data = site_rows(seed)
    return jax.jit(jax.grad(lambda mu: pb.reduce_sum(fn, data, mu, executor=executor,
                                                     block_rows=BLOCK_ROWS)))


def one_site(executor, seed, fn=gauss):
    """Trace and evaluate one new site; its program is dropped."""
    assert np.isfinite(float(program(executor, seed, fn)(0.3)))


def bounded(executor, sites: int):
    executor._states = SiteCache(max_sites=sites, on_forget=executor._retire)
    return executor


def device_bytes() -> int:
    """Bytes of the device buffers alive in this process (each buffer once: a sharded
    array and the arrays of its shards share theirs)."""
    buffers = {}
    for a in jax.live_arrays():
        for shard in a.addressable_shards:
            buffers[shard.device.id, shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(buffers.values())


@pytest.mark.parametrize("dispatch", ["host", "graph"])
def test_evicted_sites_free_device_buffers(dispatch):
    """Sites evicted from a ``DeviceExecutor``'s cache leave the devices (placed data on
    the graph route's mesh, each device's share on the host route); an evicted site that
    a live program still evaluates keeps (or gets back) its buffers until that program
    is dropped; close() frees the rest."""
    collect()
    base = device_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one device, or forced CPU devices: it warns
        ex = bounded(pb.DeviceExecutor(dispatch=dispatch), 2)
    one_site(ex, 0)
    collect()
    one = device_bytes() - base
    if ex.workers > 1 or dispatch == "graph":  # placed by the executor
        assert one >= 2 * ROWS * 4
    for seed in range(1, 6):
        one_site(ex, seed)
    collect()
    evicted = device_bytes() - base
    assert len(ex.sites()) == 2
    assert evicted <= 2 * one + SLACK, (one, evicted)
    keep = program(ex, 6)
    keep(0.3)
    kept = ex.sites()[-1]
    one_site(ex, 7)
    one_site(ex, 8)  # the kept program's site leaves the cache
    assert kept not in ex.sites()
    keep(0.4)  # and is evaluated by the program that holds it
    gc.collect()  # not jax.clear_caches(): keep's program stays compiled
    again = device_bytes() - base
    assert again <= 3 * one + SLACK, (one, again)
    del keep, kept
    collect()
    dropped = device_bytes() - base
    assert dropped <= 2 * one + SLACK, (one, dropped)
    ex.close()
    collect()
    closed = device_bytes() - base
    assert closed <= SLACK, closed
    print(f"\ndevice bytes ({ex.workers} device(s), {dispatch}): one site {one}, "
          f"6 sites in a cache of 2 {evicted}, an evicted site evaluated again {again}, "
          f"its program dropped {dropped}, closed {closed}")


@pytest.mark.slow  # a subprocess that compiles every test above again
def test_device_buffers_on_two_forced_devices():
    """The device-buffer checks above on 2 forced host CPU devices, where the host route
    places each device's share (the count is fixed when JAX starts: a subprocess)."""
    if os.environ.get(FORCED):
        pytest.skip("this is that subprocess")
    proc = helpers.pytest_on_forced_devices(__file__, "test_evicted_sites_free_device_buffers",
                                            FORCED, 2, "-s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\b2 passed", proc.stdout), proc.stdout[-2000:]
    print("\n" + "\n".join(line for line in proc.stdout.splitlines() if "device bytes" in line))


# -- dask workers ----------------------------------------------------------------------


def residents(dask_worker=None) -> dict:
    """Every prepared-data holder alive in a worker process (garbage collected first):
    what it holds is freed, not just forgotten."""
    from parallel_backend.tasks import Resident

    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, Resident)]
    return {"residents": len(alive), "bytes": sum(r.nbytes for r in alive)}


def on_workers(client, ex) -> dict:
    """What ``ex`` keeps on the workers, summed over them, once its release messages
    have arrived: sites, programs, shards, bytes, and the data holders still alive."""
    from parallel_backend.plugins.dask import worker

    ex._wait_released(30)
    out: dict = {}
    for per in (client.run(worker.holdings, ex._plugin), client.run(residents)):
        for held in per.values():
            for k, v in held.items():
                k = "alive_bytes" if k == "bytes" and "residents" in held else k
                out[k] = out.get(k, 0) + v
    return out


def site_bytes(ex) -> int:
    """Bytes of the data of the sites ``ex`` has sent to its workers and still caches."""
    remotes = [s.placed.get("dask.remote") for s in ex.sites()]
    return sum(sum(x.nbytes for x in r.arrays) for r in remotes if r is not None)


@pytest.mark.dask
def test_evicted_sites_leave_the_dask_workers(client):
    """Sites evicted from a ``DaskExecutor``'s cache are forgotten on every worker: its
    workers hold the data of the cached sites only, and after close() (with the
    caller's client, which stays open) nothing."""
    with bounded(pb.DaskExecutor(client=client, dispatch="host"), 2) as ex:
        one_site(ex, 0)
        one_site(ex, 1)
        two = on_workers(client, ex)
        assert two["shards"] == 4 and two["bytes"] == site_bytes(ex) >= 2 * 2 * ROWS * 4
        assert two["residents"] == 4
        for seed in range(2, 8):
            one_site(ex, seed)
        evicted = on_workers(client, ex)
        # Six sites left; all eight share one spec (same fn and shapes): it stays.
        assert evicted == two | {"bytes": site_bytes(ex), "alive_bytes": site_bytes(ex)}, \
            (two, evicted)
        assert evicted["sites"] == 2  # one spec, on each worker
    closed = on_workers(client, ex)
    assert client.status == "running"
    assert closed == {"sites": 0, "programs": 0, "shards": 0, "bytes": 0, "residents": 0,
                      "alive_bytes": 0}, closed
    print(f"\nworker bytes: two sites {two['bytes']}, eight sites in a cache of 2 "
          f"{evicted['bytes']} (without release: {4 * two['bytes']}), closed {closed['bytes']}")


@pytest.mark.dask
def test_sites_sharing_spec_or_data_keep_it_on_the_workers(client):
    """Two sites over the same data share it on the workers: evicting one keeps the data
    the other evaluates (nothing is sent again), and drops the spec no other uses."""
    with bounded(pb.DaskExecutor(client=client, dispatch="host"), 2) as ex:
        one_site(ex, 0, gauss)  # A: gauss over rows 0
        keep = program(ex, 0, gauss_scaled)  # B: another fn over the same rows
        keep(0.3)
        both = on_workers(client, ex)
        assert both["shards"] == 2 and both["sites"] == 4  # one data, two specs, 2 workers
        one_site(ex, 1, gauss_scaled)  # C: evicts A, the only site of fn gauss
        after = on_workers(client, ex)
        assert after["sites"] == 2 and after["shards"] == 4, after
        assert after["bytes"] == 2 * both["bytes"] == site_bytes(ex)
        sent = ex.stats()["data_bytes_sent"]
        keep(0.4)  # B's data stayed on the workers
        assert ex.stats()["data_bytes_sent"] == sent


@pytest.mark.dask
def test_an_evicted_site_still_evaluated_keeps_its_data_until_dropped(client):
    """A program that still holds an evicted site evaluates it on data sent again; that
    data leaves the workers once the program (and so the site) is gone."""
    with bounded(pb.DaskExecutor(client=client, dispatch="host"), 2) as ex:
        keep = program(ex, 0)
        value = float(keep(0.3))
        one_site(ex, 1)
        one_site(ex, 2)  # the first site leaves the cache
        evicted = on_workers(client, ex)
        assert evicted["bytes"] == site_bytes(ex) and evicted["shards"] == 4
        assert float(keep(0.3)) == value  # its data is sent again
        again = on_workers(client, ex)
        assert again["shards"] == 6 and again["bytes"] == evicted["bytes"] * 3 // 2, again
        del keep
        collect()  # the program and the site it holds are gone
        dropped = on_workers(client, ex)
        assert dropped == evicted, (evicted, dropped)


# -- freeing while a chunk runs ----------------------------------------------------------


def test_a_copy_freed_under_a_chunk_is_freed_after_it():
    """``Resident.delete`` while a chunk holds the device copies (``in_use``: fetched,
    its program yet to run) frees them when the chunk is done, not under it; with no
    holder, at once; the numpy arrays stay, so a later view copies again."""
    from parallel_backend.tasks import Resident

    resident = Resident((np.arange(12.0).reshape(3, 4),), 0)
    with resident.in_use():
        view = resident.view(0, 3)
        with resident.in_use():  # a second chunk on the same copies
            resident.delete()
        assert not view[0].is_deleted(), "freed under a chunk that still holds it"
        assert float(jax.jit(lambda a: a.sum())(view[0])) == 66.0
    assert view[0].is_deleted(), "not freed once its last holder was done"
    again = resident.view(1, 3)
    resident.delete()
    assert again[0].is_deleted()
    assert float(resident.view(0, 3)[0].sum()) == 66.0

