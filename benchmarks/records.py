"""The one results format of the harness: JSON lines, one record per variant measured.

Every subcommand that measures writes records of one schema (:data:`FIELDS`), and
``report`` and ``plot`` read only these. A record::

    {"bench": "gradients", "machine": "Intel(R) Xeon(R) Processor, 2 cores",
     "date": "2026-11-26", "python": "3.11.7", "jax": "0.10.2", "numpyro": "0.22.0",
     "likelihood": "hmm", "rows": 50000, "dtype": "float32", "variant": "thread",
     "seconds": 0.168, "ratio": 2.12, "rounds": 5, "cores": 2,
     "settings": {"loop": 4, "sets": 0}, "info": {"route": "host"}}

``seconds`` is the median over ``rounds`` interleaved rounds (per evaluation for the
gradient benchmarks, per run for ``nuts``); ``ratio`` is plain NumPyro's median in the
same run divided by this variant's (above 1: faster than plain; plain's own record has
1.0). ``settings`` are what the run was asked for (records compare only with equal
settings); ``info`` is what it observed (the route a site took, milliseconds per gradient
inside NUTS, bytes sent). Imports the standard library only (jax's version is read from
its metadata), so that ``report`` runs without JAX.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from importlib import metadata

__all__ = ["FIELDS", "check", "environment", "load", "machine", "record", "write"]

#: Every record has these keys (``settings`` and ``info`` are dicts, maybe empty).
FIELDS = ("bench", "machine", "date", "python", "jax", "numpyro", "likelihood", "rows",
          "dtype", "variant", "seconds", "ratio", "rounds", "cores", "settings", "info")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cores() -> int:
    """CPUs this process may run on (``taskset`` lowers it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine(label: str | None = None, accelerator: str | None = None) -> str:
    """``label`` if given, else the CPU model and its cores (and ``accelerator``, the
    device kind, when the run used one): how tables name the machine."""
    if label:
        return label
    name = f"{_cpu_model()}, {cores()} cores"
    return f"{name}, {accelerator}" if accelerator else name


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def environment(label: str | None = None, accelerator: str | None = None) -> dict:
    """The fields every record of this process shares: machine, date, versions, cores."""
    return {"machine": machine(label, accelerator),
            "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
            "python": platform.python_version(), "jax": _version("jax"),
            "numpyro": _version("numpyro"), "cores": cores()}


def record(env: dict, bench: str, likelihood: str, rows: int, dtype: str, variant: str,
           seconds: float, plain: float | None, rounds: int, settings=None, info=None) -> dict:
    """One record; ``plain`` is plain NumPyro's median of the same run (``None``: no plain
    in this run, ``ratio`` is then ``None``)."""
    out = {"bench": bench, **env, "likelihood": likelihood, "rows": int(rows), "dtype": dtype,
           "variant": variant, "seconds": float(seconds),
           "ratio": None if plain is None else float(plain) / float(seconds),
           "rounds": int(rounds), "settings": dict(settings or {}), "info": dict(info or {})}
    return {k: out[k] for k in FIELDS}


def check(rec: dict) -> dict:
    """``rec`` if it has every field of :data:`FIELDS`; a ``ValueError`` naming what
    is missing otherwise."""
    missing = [k for k in FIELDS if k not in rec]
    if missing:
        raise ValueError(f"not a benchmark record: missing {missing} in {sorted(rec)}; "
                         "records are written by `python -m benchmarks <subcommand> --out FILE`")
    return rec


def write(path: str | None, records) -> None:
    """Append ``records`` to ``path`` as JSON lines (``None``: nowhere)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(check(rec)) + "\n" for rec in records)


def load(paths) -> list:
    """Every record of the JSON-lines files ``paths`` (``-``: standard input), in order."""
    out = []
    for path in paths:
        if path == "-":
            out += _read(sys.stdin, path)
        else:
            with open(path, encoding="utf-8") as fh:
                out += _read(fh, path)
    return out


def _read(lines, path) -> list:
    out = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(check(json.loads(line)))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return out
