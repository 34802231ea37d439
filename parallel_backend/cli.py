"""The ``parallel-backend`` command: ``demo`` (the main job) and ``profile``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="parallel-backend",
                                     description="Parallel gradients for one NumPyro chain.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fit a built-in model with plain NumPyro and with "
                                       "parallel_backend and compare")
    demo.add_argument("--rows", type=int, default=200_000, help="rows of synthetic data")
    demo.add_argument("--warmup", type=int, default=200, help="NUTS warmup iterations")
    demo.add_argument("--samples", type=int, default=200, help="NUTS draws")
    demo.add_argument("--workers", type=int, default=None, help="threads (default: all cores)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--float64", action="store_true", help="run in double precision")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    prof = sub.add_parser("profile", help="time one gradient in plain NumPyro and on each "
                                          "executor, and say which to use")
    prof.add_argument("script", nargs="?", default=None,
                      help="a Python file that defines `model` (and optionally `model_args`, "
                           "`model_kwargs`); default: the demo model")
    prof.add_argument("--rows", type=int, default=200_000, help="rows of the demo model's data")
    prof.add_argument("--float64", action="store_true", help="run in double precision")
    args = parser.parse_args(argv)
    if args.command == "profile":
        if args.rows < 1:
            parser.error("--rows must be positive")
        from .plugins.numpyro.profile import profile_command  # numpyro only when asked for

        print(profile_command(args.script, n_rows=args.rows, float64=args.float64))
    if args.command == "demo":
        if args.rows < 1 or args.warmup < 1 or args.samples < 1:
            parser.error("--rows, --warmup and --samples must be positive")
        from .demo import run_demo

        run_demo(n_rows=args.rows, num_warmup=args.warmup, num_samples=args.samples,
                 workers=args.workers, seed=args.seed, float64=args.float64,
                 progress_bar=not args.no_progress and sys.stderr.isatty())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
