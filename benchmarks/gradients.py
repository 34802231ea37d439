"""Per gradient: one value-and-gradient of a likelihood, plain NumPyro against each executor.

Plain is ``value_and_grad`` of ``fn(data, *params).sum()``, the log-density NumPyro
differentiates; every other variant is ``value_and_grad`` of
``pb.reduce_sum(fn, data, *params)`` on one executor. The parameters are traced
arguments and every output is used: each timed call runs ``loop`` evaluations in one
compiled loop (``parallel_backend.routes.in_a_loop``, as a sampler evaluates a
log-density; ``loop=1``: isolated jitted calls), and the record gives seconds per
evaluation. Variants are warmed up (compiled, the chunker settled) and timed in
interleaved rounds by the timing module ``pb.profile`` uses
(``parallel_backend.plugins.numpyro.profile``).

This module owns the subcommands ``gradients``, ``device``, ``observe`` and ``scaling``
(the last runs ``gradients``' plain and host-thread variants in one pinned process per
worker count). Import it only after ``XLA_FLAGS`` is set (``device`` forces host devices).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np

import parallel_backend as pb
from parallel_backend.plugins.numpyro.profile import medians, time_interleaved, warm_up
from parallel_backend.routes import LOOP, in_a_loop

from . import likelihoods, records
from .likelihoods import LIKELIHOODS, MAKERS, parameter_sets

__all__ = [
    "LOOP",
    "device",
    "gradients",
    "observe",
    "parse_likelihoods",
    "scaling",
    "scaling_child",
    "time_variants",
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The variants of ``gradients``, in the order timed (``dask*`` only with a cluster).
GRADIENT_VARIANTS = ("plain", "serial", "thread", "thread_host", "dask", "dask_host")
#: The variants of ``device``: ``*_nocse`` are compiled with XLA's common-subexpression
#: pass off (what ``--xla_disable_hlo_passes=cse``, which makes graph mode bitwise, costs).
DEVICE_VARIANTS = ("plain", "plain_nocse", "serial", "device", "device_host", "device_graph",
                   "device_graph_nocse")
OBSERVE_VARIANTS = ("plain", "factor_serial", "factor_thread", "observe_serial",
                    "observe_thread")
NO_CSE = {"xla_disable_hlo_passes": "cse"}


def parse_likelihoods(text: str, scale: float = 1.0) -> list:
    """``[(name, maker, rows)]`` from a comma list of catalogue names (``hmm_50k``, see
    ``likelihoods.LIKELIHOODS``) or ``model:rows`` (``hmm:3000``, a ``likelihoods.MAKERS``
    key); every row count multiplied by ``scale``."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if ":" in item:
            model, _, rows = item.partition(":")
            if model not in MAKERS:
                raise SystemExit(f"unknown model {model!r}; known: {sorted(MAKERS)}")
            make, n = MAKERS[model], int(rows.replace("_", ""))
        elif item in LIKELIHOODS:
            make, n = LIKELIHOODS[item]
            model = item.rsplit("_", 1)[0]
        else:
            raise SystemExit(f"unknown likelihood {item!r}; known: {sorted(LIKELIHOODS)} "
                             "or MODEL:ROWS with MODEL one of " + str(sorted(MAKERS)))
        out.append((model, make, max(1, int(n * scale))))
    return out


def pick(known, wanted: str | None) -> list:
    """The variants of ``known`` named in the comma list ``wanted`` (all when ``None``),
    in ``known``'s order; plain always first, as every ratio needs it."""
    if not wanted:
        return list(known)
    names = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(known)}")
    return ["plain"] + [k for k in known if k in names and k != "plain"]


def time_variants(variants: dict, args: tuple, rounds: int, loop: int) -> dict:
    """Median seconds per evaluation of each ``(f, executor)`` in ``variants`` at
    ``args``: each warmed up (compiled; its executor's chunker settled), then all timed
    in ``rounds`` interleaved rounds; ``f`` runs ``loop`` evaluations per call."""
    for f, ex in variants.values():
        warm_up(f, args, ex, calls=3)
    times = time_interleaved([f for f, _ in variants.values()], args, rounds=rounds)
    return {k: m / loop for k, m in zip(variants, medians(times))}


def compiled(f, loop: int, compiler_options=None):
    """``f`` jitted (``loop == 1``) or ``loop`` evaluations of it in one compiled loop."""
    if loop == 1:
        return jax.jit(f, compiler_options=compiler_options)
    looped = in_a_loop(f, loop)
    return jax.jit(looped, compiler_options=compiler_options) if compiler_options else looped


def _routes(ex) -> str:
    return "/".join(sorted({str(s.get("dispatch")) for s in ex.stats()["sites"]})) or "-"


def _emit(recs, label: str) -> None:
    plain = next((r for r in recs if r["variant"] == "plain"), None)
    base = f"plain={plain['seconds'] * 1e3:.3f}ms " if plain else ""
    others = " ".join(f"{r['variant']}={r['ratio']:.2f}x" + (
        f"({r['info']['route']})" if r["info"].get("route") else "")
        for r in recs if r["variant"] != "plain" and r["ratio"] is not None)
    print(f"{label} {base}{others}", flush=True)


def _gradient_records(env, bench, model, n, dtype, med, rounds, settings, info) -> list:
    return [records.record(env, bench, model, n, dtype, k, v, med.get("plain"), rounds,
                           settings, info.get(k)) for k, v in med.items()]


def gradients(args, env) -> list:
    """The ``gradients`` subcommand: records of every likelihood and variant."""
    wanted = pick(GRADIENT_VARIANTS, args.variants)
    if not (args.dask_workers or args.dask_address):
        wanted = [v for v in wanted if not v.startswith("dask")]
    if any(v.startswith("dask") for v in wanted):
        import cloudpickle

        cloudpickle.register_pickle_by_value(likelihoods)  # workers may not find the module
    out = []
    for model, make, n in parse_likelihoods(args.likelihoods, args.scale):
        recs = _gradients_of(args, env, wanted, model, make, n)
        _emit(recs, f"{model:9s} rows={n:>9,} {args.dtype} cores={env['cores']}")
        out += recs
    return out


def _gradients_of(args, env, wanted, model, make, n) -> list:
    fn, data, params = make(n, np.dtype(args.dtype))
    argnums = tuple(range(len(params)))
    if args.sets:
        params = parameter_sets(params, args.sets)

    def timed(f):
        vg = jax.value_and_grad(f, argnums=argnums)
        return compiled(jax.vmap(vg) if args.sets else vg, args.loop)

    def on(ex):
        return timed(lambda *p: pb.reduce_sum(fn, data, *p, executor=ex))

    executors = _gradient_executors(wanted, args)
    variants = {"plain": (timed(lambda *p: fn(data, *p).sum()), None)}
    variants.update({k: (on(ex), ex) for k, ex in executors.items() if not k.startswith("_")})
    try:
        med = time_variants(variants, params, args.rounds, args.loop)
        info = {k: {"route": _routes(ex)} for k, ex in executors.items()}
        for k in ("dask", "dask_host"):
            if k in executors:
                s = executors[k].stats()
                info[k]["bytes_per_call"] = ((s["bytes_sent"] - s.get("data_bytes_sent", 0))
                                             / max(s["calls"], 1))
    finally:
        for ex in reversed(executors.values()):  # dask_host borrows dask's client
            ex.close()
    settings = {"loop": args.loop, "sets": args.sets}
    if "dask" in executors or "dask_host" in executors:
        settings["dask"] = args.dask_address or (f"local, {args.dask_workers} workers"
                                                   f" x {args.dask_threads} threads")
    return _gradient_records(env, "gradients", model, n, args.dtype, med, args.rounds,
                             settings, info)


def _gradient_executors(wanted, args) -> dict:
    made = {"serial": pb.SerialExecutor, "thread": pb.ThreadExecutor,
            "thread_host": lambda: pb.ThreadExecutor(dispatch="host")}
    out = {k: made[k]() for k in wanted if k in made}
    if "dask" in wanted or "dask_host" in wanted:
        dask = (pb.DaskExecutor(address=args.dask_address) if args.dask_address
                else pb.DaskExecutor(n_workers=args.dask_workers,
                                     threads_per_worker=args.dask_threads))
        if "dask" in wanted:
            out["dask"] = dask
        if "dask_host" in wanted:
            out["dask_host"] = pb.DaskExecutor(client=dask.client, dispatch="host")
        if "dask" not in wanted:
            out["_dask"] = dask  # closed with the others, not timed
    return out


def device(args, env) -> list:
    """The ``device`` subcommand: plain on the default device against ``DeviceExecutor``
    over every device of the process (forced host devices on a CPU)."""
    wanted = pick(DEVICE_VARIANTS, args.variants)
    devices = jax.devices()
    out = []
    for model, make, n in parse_likelihoods(args.likelihoods, args.scale):
        recs = _device_of(args, env, wanted, devices, model, make, n)
        _emit(recs, f"{model:9s} rows={n:>9,} {args.dtype} "
                    f"{devices[0].platform}x{len(devices)}")
        out += recs
    return out


def _device_of(args, env, wanted, devices, model, make, n) -> list:
    fn, data, params = make(n, np.dtype(args.dtype))
    data = jax.device_put(data, devices[0])
    argnums = tuple(range(len(params)))

    def timed(f, options=None):
        return compiled(jax.value_and_grad(f, argnums=argnums), args.loop, options)

    def plain(*p):
        return fn(data, *p).sum()

    def on(ex):
        return lambda *p: pb.reduce_sum(fn, data, *p, executor=ex)

    made = {"serial": pb.SerialExecutor, "device": pb.DeviceExecutor,
            "device_host": lambda: pb.DeviceExecutor(dispatch="host"),
            "device_graph": lambda: pb.DeviceExecutor(dispatch="graph")}
    executors = {k: made[k]() for k in made if k in wanted
                 or (k == "device_graph" and "device_graph_nocse" in wanted)}
    variants = {}
    for k in wanted:
        if k == "plain":
            variants[k] = (timed(plain), None)
        elif k == "plain_nocse":
            variants[k] = (timed(plain, NO_CSE), None)
        elif k == "device_graph_nocse":
            variants[k] = (timed(on(executors["device_graph"]), NO_CSE),
                           executors["device_graph"])
        else:
            variants[k] = (timed(on(executors[k])), executors[k])
    try:
        med = time_variants(variants, params, args.rounds, args.loop)
        info = {k: {"route": _routes(ex)} for k, (_, ex) in variants.items() if ex}
    finally:
        for ex in executors.values():
            ex.close()
    settings = {"loop": args.loop, "platform": devices[0].platform, "devices": len(devices)}
    return _gradient_records(env, "device", model, n, args.dtype, med, args.rounds,
                             settings, info)


def _observe_problems(n, dtype):
    """NumPyro's own distributions over ``n`` rows: ``{name: (dist_fn, y)}`` and ``X``."""
    import jax.numpy as jnp
    import numpyro.distributions as dist

    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 4)).astype(dtype) / 2
    eta = X @ np.linspace(-0.5, 0.5, 4).astype(dtype)
    mu = np.exp(1.0 + eta)
    cases = {
        "NegativeBinomial2": (lambda X, b, s: dist.NegativeBinomial2(jnp.exp(1.0 + X @ b), s),
                              rng.negative_binomial(5, 5 / (5 + mu)).astype(dtype)),
        "Bernoulli": (lambda X, b, s: dist.Bernoulli(logits=X @ b * s),
                      (rng.random(n) < 1 / (1 + np.exp(-eta))).astype(dtype)),
        "StudentT": (lambda X, b, s: dist.StudentT(4.0, X @ b, s),
                     (eta + rng.standard_t(4, size=n)).astype(dtype)),
    }
    return jnp.asarray(X), {k: (f, jnp.asarray(y)) for k, (f, y) in cases.items()}


def observe(args, env) -> list:
    """The ``observe`` subcommand: NumPyro distributions as plain NumPyro (a plate and an
    observed site), as ``pb.factor`` of the same pointwise log-density and as
    ``pb.observe``, each the ``value_and_grad`` of ``numpyro.infer.util.log_density``."""
    import jax.numpy as jnp
    import numpyro
    from numpyro.infer.util import log_density

    wanted = pick(OBSERVE_VARIANTS, args.variants)
    dtype = np.dtype(args.dtype)
    X, cases = _observe_problems(args.rows, dtype)
    params = (jnp.asarray(np.linspace(-0.4, 0.4, 4), dtype), jnp.asarray(3.0, dtype))
    out = []
    for name, (dist_fn, y) in cases.items():
        def plain(b, s, dist_fn=dist_fn, y=y):
            with numpyro.plate("rows", X.shape[0]):
                numpyro.sample("y", dist_fn(X, b, s), obs=y)

        def factor(b, s, ex, dist_fn=dist_fn, y=y):
            pb.factor("y", lambda rows, b, s: dist_fn(rows["X"], b, s).log_prob(rows["y"]),
                      {"X": X, "y": y}, b, s, executor=ex)

        def observed(b, s, ex, dist_fn=dist_fn, y=y):
            pb.observe("y", dist_fn, X, b, s, obs=y, executor=ex)

        def timed(model, **kw):
            f = jax.value_and_grad(lambda b, s: log_density(model, (b, s), kw, {})[0],
                                   argnums=(0, 1))
            return compiled(f, args.loop)

        executors = {"serial": pb.SerialExecutor(), "thread": pb.ThreadExecutor()}
        variants = {"plain": (timed(plain), None)}
        for label, ex in executors.items():
            for kind, model in (("factor", factor), ("observe", observed)):
                if f"{kind}_{label}" in wanted:
                    variants[f"{kind}_{label}"] = (timed(model, ex=ex), ex)
        try:
            med = time_variants(variants, params, args.rounds, args.loop)
        finally:
            for ex in executors.values():
                ex.close()
        recs = _gradient_records(env, "observe", name, args.rows, args.dtype, med, args.rounds,
                                 {"loop": args.loop}, {})
        _emit(recs, f"{name:18s} rows={args.rows:,} {args.dtype}")
        out += recs
    return out


def scaling_child(spec: dict) -> list:
    """In a process pinned to ``spec["workers"]`` cores: plain (XLA's pool has as many
    threads) and ``ThreadExecutor(workers, dispatch="host")``, for one likelihood."""
    (model, make, n), = parse_likelihoods(spec["likelihood"])
    fn, data, params = make(n, np.dtype(spec["dtype"]))
    argnums = tuple(range(len(params)))
    loop = spec["loop"]

    def timed(f):
        return compiled(jax.value_and_grad(f, argnums=argnums), loop)

    with pb.ThreadExecutor(spec["workers"], dispatch="host") as ex:
        variants = {"plain": (timed(lambda *p: fn(data, *p).sum()), None),
                    "thread_host": (timed(lambda *p: pb.reduce_sum(fn, data, *p, executor=ex)),
                                    ex)}
        med = time_variants(variants, params, spec["rounds"], loop)
    env = dict(records.environment(spec["machine"]))
    return _gradient_records(env, "scaling", model, n, spec["dtype"], med, spec["rounds"],
                             {"loop": loop, "workers": spec["workers"]}, {})


def scaling(args, env) -> list:
    """The ``scaling`` subcommand: per worker count ``w``, a child process pinned to the
    first ``w`` cores (``taskset``) times plain and the host threads on ``w`` workers."""
    cpus = sorted(os.sched_getaffinity(0))
    counts = ([int(w) for w in args.workers.split(",")] if args.workers
              else list(range(1, len(cpus) + 1)))
    too_many = [w for w in counts if w > len(cpus) or w < 1]
    if too_many:
        raise SystemExit(f"--workers {too_many}: this process may use {len(cpus)} cores")
    out = []
    for item in (t for t in args.likelihoods.split(",") if t.strip()):
        parse_likelihoods(item)  # fail here, not in a child
        for w in counts:
            spec = {"likelihood": item, "dtype": args.dtype, "workers": w, "loop": args.loop,
                    "rounds": args.rounds, "machine": env["machine"]}
            cmd = ["taskset", "-c", ",".join(map(str, cpus[:w])), sys.executable, "-m",
                   "benchmarks", "scaling", "--child", json.dumps(spec)]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
            if done.returncode:
                raise SystemExit(f"scaling: the child for {item} on {w} workers failed:\n"
                                 + done.stderr[-3000:])
            recs = [json.loads(line) for line in done.stdout.splitlines()
                    if line.startswith("{")]
            _emit(recs, f"{item:12s} {args.dtype} workers={w}")
            out += recs
    return out
