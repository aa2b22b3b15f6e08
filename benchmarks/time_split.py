"""Split a node-network bench's time to DDP's final metric into link time and the rest.

    .venv/bin/python benchmarks/time_split.py REPORT.json [REPORT.json ...] [--target 0.5]

REPORT.json is the report of an `abtrain bench ... --net rate=...` run with DDP among its methods
(docs/results/*/report.json are such reports). For every other method and for DDP: the wall
seconds at the first evaluation as good as DDP's final accuracy or perplexity, split into

- link: the global wire bytes per worker the ledger counted up to that evaluation (what each node's
  link carries under gloo's ring, docs/bench.md), at the node link's rate;
- rest: the remainder (compute, decompositions, evaluation, the unshaped traffic inside nodes).

Then the compute speed-up f at which the method's time would be --target × DDP's, if the rest of
both runs took 1/f of its time and the link stayed as it is: (l_m + r_m/f) = target·(l_d + r_d/f)
gives f = (r_m − target·r_d) / (target·l_d − l_m). A model from measured parts, not a measurement.
Prints a table; writes benchmarks/results/time_split.json (--out). Exits with 2 when a report
could not be split (the others are still written).
"""
import argparse
import json
import os

from abtrain.sidebyside.report import first_reaching

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def speedup_needed(m, d, t):
    """The compute speed-ups f at which (l_m + r_m/f) <= t·(l_d + r_d/f), as (kind, f).

    The condition is num/f <= den with num = r_m − t·r_d and den = t·l_d − l_m:
    ("from", f) for every f >= f, ("any", None) at every speed, ("never", None) at none,
    ("up to", f) only at f or slower (the method's own link time dominates)."""
    num = m["rest"] - t * d["rest"]
    den = t * d["link"] - m["link"]
    if num > 0:
        return ("from", num / den) if den > 0 else ("never", None)
    if den >= 0:
        return ("any", None)
    return ("up to", num / den) if num < 0 else ("never", None)


def split(report, target_ratio):
    rate = (report.get("net") or {}).get("rate_bytes_per_s")
    if not rate:
        raise ValueError("no --net rate in this bench")
    metric = report["workload"]["metric"]
    goal = report["ddp_target"]
    runs = {m["method"]: m for m in report["methods"] if m["status"] == "complete"}
    if "ddp" not in runs or goal is None:
        raise ValueError("DDP did not complete in this bench")

    def parts(run):
        row = first_reaching(run["history"], goal, metric)
        if row is None:
            return None
        link = row["global_wire_bytes"] / rate
        return {"step": row["step"], "time": row["wall_seconds"], "link": link, "rest": row["wall_seconds"] - link}

    ddp = parts(runs["ddp"])
    if ddp is None:
        raise ValueError("DDP's evaluations never reach its final metric")
    rows = []
    for name, run in runs.items():
        p = parts(run)
        row = {"method": name, "ddp_target": goal, "metric": metric, "parts": p}
        if p is not None and name != "ddp":
            row["ratio"] = p["time"] / ddp["time"]
            row["speedup"] = speedup_needed(p, ddp, target_ratio)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="+", help="report.json of a bench run with --net and DDP")
    ap.add_argument("--target", type=float, default=0.5, help="ratio to DDP's time (default 0.5)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "time_split.json"),
                    help="JSON with every row (default: benchmarks/results/time_split.json)")
    args = ap.parse_args()
    everything = {"target_ratio": args.target, "reports": {}}
    failed = 0
    print("| report | method | step | time to DDP's final | link | rest | ratio to DDP | compute speed-up for ≤ target |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for path in args.reports:
        try:
            with open(path) as f:
                rows = split(json.load(f), args.target)
        except (OSError, ValueError, KeyError) as err:  # unreadable, not JSON, not a bench report, no DDP or rate
            print(f"| {path} | cannot split: {err!r} | | | | | | |")
            failed += 1
            continue
        for r in rows:
            p = r["parts"]
            if p is None:
                print(f"| {path} | {r['method']} | – | not reached | – | – | – | – |")
                continue
            ratio, f_text = "1", "–"
            if "ratio" in r:
                kind, f_min = r["speedup"]
                ratio = f"{r['ratio']:.3f}"
                f_text = kind if f_min is None else f"{kind} {f_min:.3f}×"
                if r["ratio"] <= args.target:
                    f_text += " (met here)"
            print(f"| {path} | {r['method']} | {p['step']} | {p['time']:.1f} s | {p['link']:.1f} s | "
                  f"{p['rest']:.1f} s | {ratio} | {f_text} |")
        everything["reports"][path] = rows
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(everything, f, indent=1)
    print(f"wrote {args.out}")
    return 2 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
