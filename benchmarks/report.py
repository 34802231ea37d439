"""Markdown tables from benchmark records (:mod:`.records`): ``python -m benchmarks report``.

One table per kind of run and per machine, software versions, precision and settings,
so that a table never divides figures of different runs' settings: ratios are each
record's own (plain NumPyro in the same run), as the harness measured them. Where one
file holds several runs of the same case, the last one is shown. Imports the standard
library only.
"""

from __future__ import annotations

import json
from collections import defaultdict

__all__ = ["render", "table", "tables"]

_PER_EVALUATION = ("gradients", "device", "observe")


def _x(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _ms(seconds) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _settings(s: dict, skip=()) -> str:
    return ", ".join(f"{k} {v}" for k, v in s.items() if k not in skip and v not in (None, 0))


def _heading(bench, recs, settings_text) -> str:
    r = recs[0]
    dates = sorted({x["date"] for x in recs})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    rounds = sorted({x["rounds"] for x in recs})
    what = "runs" if bench == "nuts" else "rounds"
    parts = [f"**{bench}**", r["machine"], f"Python {r['python']}, jax {r['jax']}", r["dtype"],
             settings_text, when, f"medians of {'/'.join(map(str, rounds))} {what}"]
    return " · ".join(p for p in parts if p)


def _groups(records, bench, skip=()):
    out = defaultdict(list)
    for r in records:
        if r["bench"] == bench:
            key = (r["machine"], r["python"], r["jax"], r["dtype"],
                   json.dumps({k: v for k, v in r["settings"].items() if k not in skip},
                              sort_keys=True))
            out[key].append(r)
    return list(out.values())


def _latest(recs, key):
    """``{key(r): {variant: record}}``, the last record of each, in first-seen order."""
    out = {}
    for r in recs:
        out.setdefault(key(r), {})[r["variant"]] = r
    return out


def _variants(recs) -> list:
    seen = []
    for r in recs:
        if r["variant"] not in seen and r["variant"] != "plain":
            seen.append(r["variant"])
    return seen


def _per_evaluation(recs, bench) -> str:
    variants = _variants(recs)
    lines = [_heading(bench, recs, _settings(recs[0]["settings"])), "",
             "| likelihood | rows | plain ms | " + " | ".join(variants) + " |",
             "|---|---:|---:|" + "---:|" * len(variants)]
    for (name, rows), per in _latest(recs, lambda r: (r["likelihood"], r["rows"])).items():
        plain = per.get("plain")
        cells = []
        for v in variants:
            r = per.get(v)
            route = r["info"].get("route") if r else None
            cells.append(_x(r["ratio"] if r else None)
                         + (f" ({route})" if route and v in ("thread", "device") else ""))
        lines.append(f"| {name} | {rows:,} | {_ms(plain['seconds']) if plain else '-'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _scaling(recs) -> str:
    """Workers against plain pinned to as many cores, and against plain on one core."""
    lines = [_heading("scaling", recs, f"loop {recs[0]['settings'].get('loop')}"), "",
             ("| likelihood | rows | w = cores | plain ms on w | threads ms "
              "| threads vs plain on w | threads vs 1-core plain | plain's own scaling |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    cases = _latest(recs, lambda r: (r["likelihood"], r["rows"], r["settings"]["workers"]))
    one = {(n, rows): per["plain"]["seconds"] for (n, rows, w), per in cases.items()
           if w == 1 and "plain" in per}
    for (name, rows, w), per in sorted(cases.items()):
        plain, threads = per.get("plain"), per.get("thread_host")
        if not (plain and threads):
            continue
        base = one.get((name, rows))
        lines.append(
            f"| {name} | {rows:,} | {w} | {_ms(plain['seconds'])} | {_ms(threads['seconds'])} | "
            f"{_x(threads['ratio'])} | {_x(base / threads['seconds'] if base else None)} | "
            f"{_x(base / plain['seconds'] if base else None)} |")
    return "\n".join(lines)


def _nuts(recs) -> str:
    variants = _variants(recs)
    lines = [_heading("nuts", recs, _settings(recs[0]["settings"], skip=("chains",))), "",
             "| likelihood | rows | chains | plain s | " + " | ".join(f"{v} (wall)" for v in variants)
             + " | plain ms/grad | " + " | ".join(f"{v} (per grad)" for v in variants) + " |",
             "|---|---:|---:|---:|" + "---:|" * (2 * len(variants) + 1)]
    cases = _latest(recs, lambda r: (r["likelihood"], r["rows"], r["settings"]["chains"]))
    for (name, rows, chains), per in cases.items():
        plain = per.get("plain")
        ms = plain["info"].get("ms_per_grad") if plain else None
        lines.append(
            f"| {name} | {rows:,} | {chains} | {plain['seconds'] if plain else float('nan'):.1f} | "
            + " | ".join(_x(per[v]["ratio"] if v in per else None) for v in variants)
            + f" | {'-' if ms is None else f'{ms:.2f}'} | "
            + " | ".join(_x(per[v]["info"].get("ratio_per_grad") if v in per else None)
                         for v in variants) + " |")
    return "\n".join(lines)


def table(recs, bench) -> str:
    """One markdown table (with a heading line) of ``recs``, all of one group."""
    if bench == "scaling":
        return _scaling(recs)
    if bench == "nuts":
        return _nuts(recs)
    return _per_evaluation(recs, bench)


def tables(records) -> list:
    """Every table of ``records``: per kind of run, per machine, versions, precision and
    settings (for ``scaling`` and ``nuts`` the worker and chain counts are rows)."""
    out = []
    order = [*_PER_EVALUATION, "scaling", "nuts"]
    benches = order + sorted({r["bench"] for r in records} - set(order))
    for bench in benches:
        skip = {"scaling": ("workers",), "nuts": ("chains",)}.get(bench, ())
        out += [table(g, bench) for g in _groups(records, bench, skip)]
    return out


def render(records) -> str:
    """The tables of ``records``, separated by blank lines."""
    return "\n\n".join(tables(records)) + "\n"
