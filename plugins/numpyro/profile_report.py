"""``pb.profile``'s report: one row per variant (:class:`ProfileRow`) and the table,
DataFrame and plot of them (:class:`ProfileReport`). Imports numpy; pandas and
matplotlib only for ``to_dataframe`` and ``plot``.
"""

from __future__ import annotations

from typing import NamedTuple

# -- the report -------------------------------------------------------------------------


class ProfileRow(NamedTuple):
    """One variant's measurement.

    Attributes
    ----------
    executor : str
        Label: ``"plain NumPyro"`` or the executor with its settings.
    kind : str
        ``"plain"`` or the executor's registered name (``"serial"``, ``"thread"``,
        ``"dask"``, ``"device"``).
    workers : int
        Tasks that can run at once (1 for plain NumPyro).
    dispatch : str
        Where the block loop ran: ``"graph"`` (inside the XLA program), ``"host"``
        (chunks on the executor's workers), ``"-"`` for plain NumPyro.
    seconds : float
        Median seconds of one value-and-gradient evaluation of the log-density.
    speedup : float
        Plain NumPyro's seconds divided by ``seconds``: above 1 is faster than plain.
    efficiency : float or None
        Parallel efficiency: seconds of the one-worker thread executor (host
        dispatch) divided by ``workers * seconds`` for executors whose chunks ran on
        workers; for a ``shard_map`` (``DeviceExecutor(dispatch="graph")``),
        ``SerialExecutor``'s seconds divided by
        ``workers * seconds``; ``None`` where it does not apply.
    overhead : float or None
        Share of the workers' time not spent evaluating chunks (task dispatch,
        callbacks, idle workers): ``1 - busy / (workers_used * seconds)``; ``None``
        where no chunk ran on workers (graph dispatch, plain NumPyro).
    chunk_rows : tuple of int
        Rows per chunk at which the executor ran (the settled chunker's choice, or
        the model's ``grainsize``); empty for plain NumPyro.
    identical : bool or None
        Whether value and gradient are bitwise equal to ``SerialExecutor``'s
        (``None`` for plain NumPyro, whose arithmetic is not blocked).
    """

    executor: str
    kind: str
    workers: int
    dispatch: str
    seconds: float
    speedup: float
    efficiency: float | None
    overhead: float | None
    chunk_rows: tuple
    identical: bool | None


class ProfileReport:
    """What :func:`parallel_backend.profile` measured, and its recommendation.

    ``repr(report)`` is a table; ``to_dataframe()`` and ``plot()`` need pandas and
    matplotlib.

    Attributes
    ----------
    rows : list of ProfileRow
        Plain NumPyro first, then each executor in the order profiled.
    sites : list of dict
        Per ``pb.factor`` site: ``name``, ``rows`` (N) and ``block_rows``.
    recommendation : str
        One sentence: the executor and grainsize to use, or to stay with plain
        NumPyro. An executor is recommended only when it beats plain NumPyro by
        ``MARGIN`` (10%) both in the median and in the fastest timed round.
    best : ProfileRow or None
        The recommended row; ``None`` when plain NumPyro is recommended.
    samples : dict
        Per variant (by ``executor`` label): the seconds of every timed round, in
        order, whose median is the row's ``seconds``.
    nuts : dict or None
        When an executor beat plain NumPyro per isolated gradient: the short NUTS runs
        that checked it, ``{label: NutsTiming}`` for plain NumPyro and that executor
        (milliseconds per gradient inside the sampler); ``None`` otherwise.
    chains : int
        Vectorized chains each evaluation carried (``profile(..., chains=)``).
    """

    def __init__(self, rows, sites, recommendation, best, samples=None, nuts=None, chains=1):
        self.rows = list(rows)
        self.chains = chains
        self.nuts = nuts
        self.samples = samples or {}
        self.sites = list(sites)
        self.recommendation = recommendation
        self.best = best

    def to_dataframe(self):
        """The rows as a ``pandas.DataFrame``, one row per variant."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError('ProfileReport.to_dataframe needs pandas: '
                              'pip install "parallel-backend[plot]"') from e
        return pd.DataFrame([r._asdict() for r in self.rows])

    def plot(self, ax=None):
        """A bar chart of speedup over plain NumPyro per variant; returns the axes."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError('ProfileReport.plot needs matplotlib: '
                              'pip install "parallel-backend[plot]"') from e
        if ax is None:
            _, ax = plt.subplots(figsize=(7, 0.45 * len(self.rows) + 1.2))
        labels = [r.executor for r in self.rows]
        speedups = [r.speedup for r in self.rows]
        colors = ["tab:gray" if r.kind == "plain" else
                  "tab:green" if r is self.best else "tab:blue" for r in self.rows]
        ax.barh(labels, speedups, color=colors)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("speedup over plain NumPyro (per gradient evaluation)")
        ax.set_title(self.recommendation, fontsize=9, wrap=True)
        return ax

    def __repr__(self) -> str:
        head = ["executor", "workers", "dispatch", "ms/grad", "speedup", "efficiency",
                "overhead", "chunk rows", "= serial"]
        table = [head]
        for r in self.rows:
            table.append([
                r.executor, str(r.workers), r.dispatch, f"{r.seconds * 1e3:.3f}",
                f"{r.speedup:.2f}x", _fmt(r.efficiency, "{:.2f}"), _fmt(r.overhead, "{:.0%}"),
                ",".join(f"{c:,}" for c in r.chunk_rows) or "-",
                {None: "-", True: "yes", False: "NO"}[r.identical]])
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(row, widths))) for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        sites = "; ".join(f"{s['name']}: {s['rows']:,} rows in blocks of {s['block_rows']:,}"
                          for s in self.sites)
        nuts = []
        if self.nuts:
            nuts = ["inside NUTS (" + ", ".join(
                f"{label}: {t.ms_per_gradient:.3f} ms/grad over {t.gradients} gradients"
                for label, t in self.nuts.items()) + ")"]
        what = ("one value-and-gradient evaluation" if self.chains == 1 else
                f"one value-and-gradient evaluation of {self.chains} vectorized chains")
        return "\n".join([f"pb.profile: {what} ({sites})", *lines,
                          *nuts, f"recommendation: {self.recommendation}"])

    __str__ = __repr__


def _fmt(x, spec):
    return "-" if x is None else spec.format(x)
