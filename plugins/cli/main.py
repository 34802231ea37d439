"""The ``parallel-backend`` command: ``demo`` (the main job) and ``profile``.

The command line is the only place that changes global JAX settings (``--float64``).
Imports argparse at module level; jax, numpy, the facade and :mod:`.demo` when a
command runs.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["NOT_CONVERGED", "main", "profile_command"]

#: The demo's exit status when a fit did not converge (it printed which, and why).
NOT_CONVERGED = 2


def _positive(name):
    def check(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be positive, got {value}")
        return value

    return check


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="parallel-backend",
                                     description="Parallel gradients for one NumPyro chain.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fit a built-in model with plain NumPyro and with "
                                       "parallel_backend and compare (exit status 2 when a "
                                       "fit did not converge)")
    demo.add_argument("--model", choices=["hmm", "negbin"], default="hmm",
                      help="hmm: a 4-state Gaussian HMM over many sequences (default); "
                           "negbin: a negative-binomial regression")
    demo.add_argument("--sequences", type=_positive("--sequences"), default=3000,
                      help="HMM sequences of 100 steps (50000 for the full problem)")
    demo.add_argument("--rows", type=_positive("--rows"), default=200_000,
                      help="rows of the negbin model's data")
    demo.add_argument("--warmup", type=_positive("--warmup"), default=50, help="NUTS warmup iterations")
    demo.add_argument("--samples", type=_positive("--samples"), default=50, help="NUTS draws")
    demo.add_argument("--chains", type=_positive("--chains"), default=1,
                      help="vectorized chains")
    demo.add_argument("--workers", type=_positive("--workers"), default=None,
                      help="threads (default: all cores)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--init", choices=["laplace", "heuristic"], default="laplace",
                      help="laplace: both fits start from draws of the Laplace approximation "
                           "at the MAP (found through parallel_backend first) and sample with "
                           "its covariance as the mass matrix (default); heuristic: the HMM "
                           "from the data's quantiles, the mass matrix adapted in warmup")
    demo.add_argument("--map-steps", type=_positive("--map-steps"), default=200,
                      help="Adam steps of the MAP search (--init laplace)")
    demo.add_argument("--float64", action="store_true",
                      help="run in double precision (the HMM needs it from about 11,000 "
                           "sequences: the demo says when)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    prof = sub.add_parser("profile", help="time one gradient in plain NumPyro and on each "
                                          "executor, and say which to use")
    prof.add_argument("script", nargs="?", default=None,
                      help="a Python file that defines `model` (and optionally `model_args`, "
                           "`model_kwargs`); default: the demo's negbin model")
    prof.add_argument("--rows", type=_positive("--rows"), default=200_000,
                      help="rows of the demo model's data")
    prof.add_argument("--chains", type=_positive("--chains"), default=1,
                      help="vectorized chains each evaluation carries")
    prof.add_argument("--float64", action="store_true", help="run in double precision")
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_enable_x64", bool(args.float64))
    if args.command == "profile":
        print(profile_command(args.script, n_rows=args.rows, chains=args.chains))
    if args.command == "demo":
        from .demo import run_demo

        out = run_demo(model=args.model, sequences=args.sequences, rows=args.rows,
                       num_warmup=args.warmup, num_samples=args.samples,
                       num_chains=args.chains, workers=args.workers, seed=args.seed,
                       init=args.init, map_steps=args.map_steps,
                       progress_bar=not args.no_progress and sys.stderr.isatty())
        if not out["converged"]:  # a script or CI running the demo sees it too
            return NOT_CONVERGED
    return 0


def profile_command(script=None, n_rows: int = 200_000, chains: int = 1):
    """What ``parallel-backend profile [script.py]`` runs.

    Without ``script``, profiles the demo's negative-binomial regression on ``n_rows``
    synthetic rows. With ``script``, runs that file (not as ``__main__``) and profiles
    its ``model`` with its ``model_args`` (a tuple, default empty) and ``model_kwargs``
    (a dict, default empty). The precision is the caller's (the command line sets it).
    ``chains``: vectorized chains (``pb.profile``'s ``chains``).
    """
    import os
    import runpy

    import jax
    import numpy as np

    from parallel_backend import profile

    if script is None:
        from .demo import make_negbin_data, negbin_parallel

        data, _ = make_negbin_data(n_rows, dtype=np.float64 if jax.config.jax_enable_x64
                                   else np.float32)
        return profile(negbin_parallel, data, chains=chains)
    if not os.path.isfile(script):
        raise FileNotFoundError(f"profile: no such script {script!r}")
    namespace = runpy.run_path(script, run_name="__parallel_backend_profile__")
    model = namespace.get("model")
    if not callable(model):  # or missing: a bad script, not a bad type (TRY004)
        raise ValueError(f"profile: {script} must define a callable `model` (a NumPyro model "  # noqa: TRY004
                         "with pb.factor sites), and `model_args` / `model_kwargs` for its "
                         "arguments")
    args = namespace.get("model_args", ())
    kwargs = namespace.get("model_kwargs", {})
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise TypeError(f"profile: in {script}, model_args must be a tuple and model_kwargs a "
                        f"dict, got {type(args).__name__} and {type(kwargs).__name__}")
    return profile(model, *args, chains=chains, **kwargs)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
