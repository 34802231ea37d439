"""``python -m benchmarks <subcommand>``: the benchmark harness (see ``benchmarks/__init__.py``).

Every measuring subcommand times plain NumPyro and each variant in the same run, in
interleaved rounds, prints one line per case and, at the end, the markdown table of what
it measured; ``--out FILE`` appends the records (JSON lines) to ``FILE``, which
``report`` and ``plot`` read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import records

DOCS_STATIC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "docs", "_static")


def _common(p, likelihoods: str | None, rounds: int | None, loop: bool = True) -> None:
    if likelihoods is not None:
        p.add_argument("--likelihoods", default=likelihoods,
                       help="comma list: catalogue names (hmm_50k, negbin_1M; see "
                            "benchmarks/likelihoods.py) or MODEL:ROWS (hmm:3000)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds, help="interleaved timing rounds")
    p.add_argument("--variants", default=None,
                   help="comma list of the variants to time (plain is always timed)")
    p.add_argument("--out", default=None, help="append the records (JSON lines) to this file")
    p.add_argument("--machine", default=None,
                   help="how records name the machine (default: CPU model and cores)")
    if loop:
        p.add_argument("--loop", type=int, default=None,
                       help="evaluations per timed call, in one compiled loop (default: "
                            "parallel_backend.routes.LOOP; 1: isolated jitted calls)")
        p.add_argument("--scale", type=float, default=1.0, help="multiply every row count by this")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks",
                                 description="The benchmark harness of parallel_backend.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("gradients", help="per gradient in a compiled loop: plain against "
                       "serial, thread, thread_host (and dask, dask_host)")
    _common(p, "negbin_10k,negbin_1M,logistic_10k,logistic_1M,hmm_1k,hmm_50k,newton_200k,"
               "gp_10k", rounds=15)
    p.add_argument("--sets", type=int, default=0,
                   help="evaluate this many parameter sets at once under vmap, as vectorized "
                        "chains do (0: one set, no vmap)")
    p.add_argument("--dask-workers", type=int, default=0,
                   help="also time DaskExecutor on a local cluster of this many processes")
    p.add_argument("--dask-threads", type=int, default=1,
                   help="threads per process of that local cluster (W processes of C threads "
                        "stand for W machines of C cores)")
    p.add_argument("--dask-address", default=None,
                   help="also time DaskExecutor on the scheduler at this address")

    p = sub.add_parser("device", help="per gradient: plain on the default device against "
                       "DeviceExecutor over every device (forced CPU devices without one)")
    _common(p, "logistic_1M,negbin_1M,hmm_50k,logistic_1k", rounds=15)
    p.add_argument("--cpu-devices", type=int, default=2,
                   help="forced host devices when XLA_FLAGS does not say (CPU only)")

    p = sub.add_parser("observe", help="per gradient: NumPyro distributions as plain NumPyro, "
                       "pb.factor and pb.observe")
    _common(p, None, rounds=11)
    p.add_argument("--rows", type=int, default=200_000)

    p = sub.add_parser("scaling", help="ThreadExecutor(w, dispatch='host') against plain "
                       "pinned to the same w cores (taskset), one process per w")
    _common(p, "hmm_5k,newton_200k,gp_10k,negbin_1M", rounds=9)
    p.add_argument("--workers", default=None,
                   help="comma list of worker counts (default: 1 to all cores)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)

    p = sub.add_parser("nuts", help="NUTS end to end (warmup and compilation included) "
                       "through numpyro.infer.MCMC, plain against pb.factor on each executor")
    _common(p, "negbin_200k,logistic_200k,hmm_1k", rounds=None, loop=False)
    p.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved")
    p.add_argument("--chains", default="1", help="comma list of chain counts")
    p.add_argument("--chain-method", default="vectorized", choices=["vectorized", "sequential"])
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--kernel", default="nuts", choices=["nuts", "hmc"])
    p.add_argument("--num-steps", type=int, default=10, help="leapfrog steps of --kernel hmc")
    p.add_argument("--max-tree-depth", type=int, default=10)
    p.add_argument("--data-as-args", action="store_true",
                   help="the data as the model's argument (traced), not closed over")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="force this many host CPU devices (for the device variants)")
    p.add_argument("--fresh", action="store_true",
                   help="every run in a new process (a first fit: nothing compiled before)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)

    p = sub.add_parser("report", help="markdown tables from records")
    p.add_argument("files", nargs="+", help="JSON-lines files of records ('-': stdin)")
    p.add_argument("--stacks", action="store_true",
                   help="runs on different Python/jax stacks side by side in one table")
    p.add_argument("--bench", default=None,
                   help="comma list: only these kinds of run (gradients, device, nuts...)")

    p = sub.add_parser("plot", help="the plots of docs/performance.md from records")
    p.add_argument("files", nargs="+", help="JSON-lines files of records")
    p.add_argument("--out", default=DOCS_STATIC, help="folder for the PNGs (docs/_static)")
    p.add_argument("--likelihood", default=None,
                   help="the likelihood of the rows plot (default: the one at most sizes)")
    return ap


def _force_cpu_devices(n) -> None:
    """Forced host devices: XLA reads the flag when JAX starts, so before any import."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.command in ("report", "plot"):
        try:
            recs = records.load(args.files)
        except (OSError, ValueError) as e:
            raise SystemExit(f"{args.command}: {e}") from None
        if args.command == "report":
            from .report import render

            benches = args.bench.split(",") if args.bench else None
            print(render(recs, stacks=args.stacks, benches=benches), end="")
        else:
            from .plots import plot

            print("\n".join(plot(recs, args.out, args.likelihood)))
        return 0
    _force_cpu_devices(getattr(args, "cpu_devices", None))

    import jax

    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    if getattr(args, "loop", 0) is None:
        from parallel_backend.routes import LOOP

        args.loop = LOOP
    if args.command == "scaling" and args.child:
        from .gradients import scaling_child

        for rec in scaling_child(json.loads(args.child)):
            print(json.dumps(rec))
        return 0
    if args.command == "nuts" and args.one:
        from .nuts import run_one

        spec, variant, seed = json.loads(args.one)
        print(json.dumps(run_one(spec, variant, seed)))
        return 0
    if args.command == "nuts":
        args.rounds = args.repeats
    accelerator = None
    if args.command == "device" and jax.devices()[0].platform != "cpu":
        accelerator = jax.devices()[0].device_kind
    env = records.environment(args.machine, accelerator)

    from . import gradients, nuts

    run = {"gradients": gradients.gradients, "device": gradients.device,
           "observe": gradients.observe, "scaling": gradients.scaling, "nuts": nuts.nuts}
    recs = run[args.command](args, env)
    records.write(args.out, recs)
    from .report import render

    print("\n" + render(recs), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
