"""Markdown tables from benchmark records (:mod:`.records`): ``python -m benchmarks report``.

One table per kind of run and per machine, software versions, precision and settings,
so that a table never divides figures of different runs' settings: ratios are each
record's own (plain NumPyro in the same run), as the harness measured them. With
``stacks=True`` (``--stacks``) the runs of one machine, precision and settings on
different Python/jax stacks share a table, one group of columns per stack. Where one
file holds several runs of the same case, the last one is shown. A table's heading
names the machine, the versions, the precision, the settings and the rounds; the date
stays in the records. Imports the standard library only.

The tables of ``docs/performance.md`` are this module's output for the records each
cites, and ``tests/unit/test_docs_hygiene.py`` checks that they still are.
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


def _stack(r) -> str:
    return f"Python {r['python']}, jax {r['jax']}"


def _version(r) -> tuple:
    """A stack's sort key: Python's version, then jax's, as numbers."""
    return tuple(tuple(int(p) if p.isdigit() else p for p in r[k].split("."))
                 for k in ("python", "jax"))


def _heading(bench, recs, settings_text) -> str:
    r = recs[0]
    stacks = "; ".join(dict.fromkeys(_stack(x) for x in sorted(recs, key=_version)))
    rounds = sorted({x["rounds"] for x in recs})
    what = "runs" if bench == "nuts" else "rounds"
    parts = [f"**{bench}**", r["machine"], stacks, r["dtype"], settings_text,
             f"medians of {'/'.join(map(str, rounds))} {what}"]
    return " · ".join(p for p in parts if p)


def _groups(records, bench, skip=(), stacks=False):
    out = defaultdict(list)
    for r in records:
        if r["bench"] == bench:
            versions = () if stacks else (r["python"], r["jax"])
            key = (r["machine"], *versions, r["dtype"],
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


def _grid_per_evaluation(recs, variants):
    """Key columns, value columns and ``{key cells: value cells}`` of a per-evaluation run."""
    rows = {}
    for (name, n), per in _latest(recs, lambda r: (r["likelihood"], r["rows"])).items():
        plain = per.get("plain")
        cells = [_ms(plain["seconds"]) if plain else "-"]
        for v in variants:
            r = per.get(v)
            route = r["info"].get("route") if r else None
            cells.append(_x(r["ratio"] if r else None)
                         + (f" ({route})" if route and v in ("thread", "device") else ""))
        rows[(name, f"{n:,}")] = cells
    return ["likelihood", "rows"], ["plain ms", *variants], rows


def _grid_nuts(recs, variants):
    rows = {}
    cases = _latest(recs, lambda r: (r["likelihood"], r["rows"], r["settings"]["chains"]))
    for (name, n, chains), per in cases.items():
        plain = per.get("plain")
        ms = plain["info"].get("ms_per_grad") if plain else None
        rows[(name, f"{n:,}", str(chains))] = (
            [f"{plain['seconds'] if plain else float('nan'):.1f}"]
            + [_x(per[v]["ratio"] if v in per else None) for v in variants]
            + ["-" if ms is None else f"{ms:.2f}"]
            + [_x(per[v]["info"].get("ratio_per_grad") if v in per else None)
               for v in variants])
    values = (["plain s", *(f"{v} (wall)" for v in variants), "plain ms/grad",
               *(f"{v} (per grad)" for v in variants)])
    return ["likelihood", "rows", "chains"], values, rows


def _markdown(heading, keys, values, rows) -> str:
    lines = [heading, "", "| " + " | ".join(keys + values) + " |",
             "|---|" + "---:|" * (len(keys) - 1 + len(values))]
    lines += ["| " + " | ".join([*k, *v]) + " |" for k, v in rows.items()]
    return "\n".join(lines)


def _stack_label(recs_of_stack, all_recs) -> str:
    """``py3.11`` where the Python minor versions tell the stacks apart, else ``jax X``."""
    minor = {".".join(r["python"].split(".")[:2]) for r in all_recs}
    stacks = {(r["python"], r["jax"]) for r in all_recs}
    r = recs_of_stack[0]
    if len(minor) == len(stacks):
        return "py" + ".".join(r["python"].split(".")[:2])
    return f"jax {r['jax']}"


def _side_by_side(recs, bench, grid) -> str:
    """One table of several stacks' runs: one group of value columns per stack."""
    per_stack = defaultdict(list)
    for r in recs:
        per_stack[(r["python"], r["jax"])].append(r)
    variants = _variants(recs)
    keys, values, rows = None, [], {}
    parts = [per_stack[k] for k in sorted(per_stack, key=lambda k: _version(per_stack[k][0]))]
    for i, part in enumerate(parts):
        keys, vals, got = grid(part, variants)
        label = _stack_label(part, recs)
        values += [f"{label} {v}" for v in vals]
        for k in got:
            rows.setdefault(k, [["-"] * len(vals) for _ in parts])[i] = got[k]
    flat = {k: [c for cells in v for c in cells] for k, v in rows.items()}
    skip = ("chains",) if bench == "nuts" else ()
    return _markdown(_heading(bench, recs, _settings(recs[0]["settings"], skip=skip)), keys,
                     values, flat)


def _per_evaluation(recs, bench) -> str:
    keys, values, rows = _grid_per_evaluation(recs, _variants(recs))
    return _markdown(_heading(bench, recs, _settings(recs[0]["settings"])), keys, values, rows)


def _nuts(recs) -> str:
    keys, values, rows = _grid_nuts(recs, _variants(recs))
    return _markdown(_heading("nuts", recs, _settings(recs[0]["settings"], skip=("chains",))),
                     keys, values, rows)


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


def table(recs, bench, stacks: bool = False) -> str:
    """One markdown table (with a heading line) of ``recs``, all of one group; with
    ``stacks``, the group may hold several Python/jax stacks, side by side."""
    if bench == "scaling":
        return _scaling(recs)
    if stacks and len({(r["python"], r["jax"]) for r in recs}) > 1:
        return _side_by_side(recs, bench,
                             _grid_nuts if bench == "nuts" else _grid_per_evaluation)
    if bench == "nuts":
        return _nuts(recs)
    return _per_evaluation(recs, bench)


def tables(records, stacks: bool = False, benches=None) -> list:
    """Every table of ``records``: per kind of run, per machine, versions (unless
    ``stacks``), precision and settings (for ``scaling`` and ``nuts`` the worker and chain
    counts are rows). ``benches``: only these kinds of run."""
    out = []
    order = [*_PER_EVALUATION, "scaling", "nuts"]
    kinds = order + sorted({r["bench"] for r in records} - set(order))
    for bench in kinds:
        if benches and bench not in benches:
            continue
        skip = {"scaling": ("workers",), "nuts": ("chains",)}.get(bench, ())
        together = stacks and bench != "scaling"
        out += [table(g, bench, together) for g in _groups(records, bench, skip, together)]
    return out


def render(records, stacks: bool = False, benches=None) -> str:
    """The tables of ``records``, separated by blank lines."""
    return "\n\n".join(tables(records, stacks, benches)) + "\n"
