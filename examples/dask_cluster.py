"""The logistic regression of ``logistic_regression.py`` on a dask cluster.

    python examples/dask_cluster.py                          # a local cluster of its own
    python examples/dask_cluster.py --address tcp://scheduler:8786 --rows 1000000

``pb.DaskExecutor()`` starts a local cluster (worker processes on this machine) and
closes it afterwards; ``--address`` connects to a running scheduler instead. The data
travels to the workers once; each gradient evaluation sends only the parameters.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from logistic_regression import make_data, pb_model

import parallel_backend as pb


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=None,
                   help="scheduler address, e.g. tcp://host:8786 (default: a local cluster)")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--features", type=int, default=5)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    X, y = make_data(args.rows, args.features, args.seed)
    where = args.address or "a local cluster"
    print(f"logistic regression: {args.rows:,} rows on {where}, {args.chains} chains")
    values = args.chains * args.samples * args.rows
    with pb.DaskExecutor(address=args.address) as ex:
        idata = pb.sample(pb_model, X, y, num_warmup=args.warmup, num_samples=args.samples,
                          num_chains=args.chains, seed=args.seed, executor=ex,
                          arviz_kwargs={"log_likelihood": values <= 50_000_000,
                                        "factor_data": False})
        stats = ex.stats()
    a = idata.attrs
    print(f"warmup {a['warmup_seconds']:.1f} s, sampling {a['sampling_seconds']:.1f} s on "
          f"{a['executor']} ({a['workers']} workers); {stats['calls']} evaluations, "
          f"{stats['bytes_sent']:,} parameter bytes sent")

    import arviz as az

    print(az.summary(idata, var_names=["alpha", "beta"]))
    return idata


if __name__ == "__main__":
    main()
