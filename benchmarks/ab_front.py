"""Every AB-training configuration measured against DDP, on one front: accuracy, compression and global bytes.

    .venv/bin/python benchmarks/ab_front.py                      # docs/results -> docs/results/ab-front
    .venv/bin/python benchmarks/ab_front.py --results benchmarks/results --out /tmp/front

Reads every table that ``benchmarks/ab_configs.py`` wrote under --results (the JSON files with a ``rows``
list) that has a ``ddp`` row, on the three bench workloads (4 workers in 2 groups, full budgets). Each
configuration's point is measured against the DDP row of its own table (the same machine and command):
its mean accuracy minus DDP's in points (the GPT: its mean perplexity above DDP's, in %), its mean
compression, and its global bytes as a share of DDP's. A configuration measured in several tables (the
same flags and seeds) is shown once, from the first table read. A point is on the Pareto front when no
other point of the workload is at least as good on all three (closer to DDP or above it, more compressed,
fewer bytes) and better on one. Prints each workload's front and writes OUT/ab_front.json and
OUT/<workload>.png.
"""
import argparse
import glob
import json
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {  # the start of ab_configs.py's workload description, and the targets for each
    "fashion-cnn": ("cnn on Fashion-MNIST, 4 workers in groups of 2, 3 epochs", "accuracy"),
    "fashion-wide": ("wide on Fashion-MNIST, 4 workers in groups of 2, 3 epochs", "accuracy"),
    "shakespeare-gpt": ("character GPT on Shakespeare, 4 workers in groups of 2, 2000", "perplexity"),
}


def mean_value(row: dict, metric: str) -> float:
    """The row's mean over its seeds (older tables hold only [mean, spread])."""
    per_seed = row.get(f"{metric}_per_seed")
    return statistics.mean(per_seed) if per_seed else row[metric][0]


def points(results: str) -> dict[str, list[dict]]:
    """Every non-DDP row of every table with a DDP row, as a point against that DDP, per workload."""
    found: dict[str, list[dict]] = {w: [] for w in WORKLOADS}
    seen: set[tuple] = set()
    for path in sorted(glob.glob(os.path.join(results, "**", "*.json"), recursive=True)):
        try:
            with open(path) as fh:
                table = json.load(fh)
        except (OSError, ValueError):
            continue
        if not isinstance(table, dict) or not isinstance(table.get("rows"), list) or "workload" not in table:
            continue
        workload = next((w for w, (start, _) in WORKLOADS.items() if table["workload"].startswith(start)), None)
        ddp = next((r for r in table["rows"] if r.get("config") == "ddp"), None)
        if workload is None or ddp is None:
            continue
        metric = table["metric"]
        ref = mean_value(ddp, metric)
        ref_bytes = ddp["global_wire_bytes"][0]
        for row in table["rows"]:
            ratios = row.get("compression_ratio") or []
            ratios = [c for c in (ratios if isinstance(ratios, list) else [ratios]) if c]
            if row is ddp or not ratios or not ref_bytes:
                continue
            value = mean_value(row, metric)
            key = (workload, row["flags"], tuple(row["seeds"]), round(value, 6))
            if key in seen:
                continue
            seen.add(key)
            # "vs DDP", better upwards: accuracy points above DDP, or % of perplexity below DDP's
            vs = 100 * (value - ref) if metric == "test_accuracy" else -100 * (value / ref - 1)
            found[workload].append({
                "table": os.path.relpath(path, results), "config": row["config"], "flags": row["flags"],
                "seeds": row["seeds"], "vs_ddp": vs, "compression": statistics.mean(ratios),
                "global_share": row["global_wire_bytes"][0] / ref_bytes, "global_bytes": row["global_wire_bytes"][0],
                "ddp": ref, "value": value})
    return found


def front(pts: list[dict]) -> list[dict]:
    """The points no other point dominates on (vs_ddp up, compression up, global_share down)."""
    def dominates(a: dict, b: dict) -> bool:
        ge = a["vs_ddp"] >= b["vs_ddp"] and a["compression"] >= b["compression"] and a["global_share"] <= b["global_share"]
        gt = a["vs_ddp"] > b["vs_ddp"] or a["compression"] > b["compression"] or a["global_share"] < b["global_share"]
        return ge and gt
    return [p for p in pts if not any(dominates(q, p) for q in pts if q is not p)]


def plot(workload: str, pts: list[dict], best: list[dict], out: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
    except ImportError:  # the plots extra is not installed: the table and JSON are the result
        return None
    accuracy = WORKLOADS[workload][1] == "accuracy"
    fig, ax = plt.subplots(figsize=(8, 5))
    shares = [100 * p["global_share"] for p in pts]
    sc = ax.scatter([p["compression"] for p in pts], [p["vs_ddp"] for p in pts], c=shares,
                    norm=LogNorm(vmin=min(shares), vmax=max(shares)), cmap="viridis", s=28, zorder=3)
    fig.colorbar(sc, ax=ax, label="global bytes, % of DDP's (log)")
    for p in sorted(best, key=lambda p: p["compression"]):
        ax.scatter([p["compression"]], [p["vs_ddp"]], s=110, facecolors="none", edgecolors="red", zorder=4)
        ax.annotate(p["config"], (p["compression"], p["vs_ddp"]), fontsize=7, xytext=(5, 3), textcoords="offset points")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("compression (dense parameters / exported parameters, log)")
    ax.set_ylabel("accuracy − DDP's (points)" if accuracy else "perplexity below DDP's (%)")
    ax.set_title(f"{workload}: every AB-training configuration against its table's DDP "
                 f"({len(pts)} points, front circled)", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, f"{workload}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=os.path.join(ROOT, "docs", "results"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "ab-front"))
    args = p.parse_args()
    found = points(args.results)
    if not any(found.values()):
        p.error(f"no ab_configs table with a ddp row under {args.results}")
    os.makedirs(args.out, exist_ok=True)
    summary = {}
    for workload, pts in found.items():
        if not pts:
            continue
        best = front(pts)
        unit = "points" if WORKLOADS[workload][1] == "accuracy" else "% of perplexity (+ = below DDP)"
        print(f"\n{workload}: {len(pts)} configurations, {len(best)} on the front; vs DDP in {unit}")
        print(f"  {'vs DDP':>8}  {'compression':>11}  {'global':>8}  config (table)")
        for q in sorted(best, key=lambda q: q["compression"]):
            print(f"  {q['vs_ddp']:+8.2f}  {q['compression']:>9.2f}:1  {100 * q['global_share']:7.2f}%  "
                  f"{q['config']} ({q['table']})")
        path = plot(workload, pts, best, args.out)
        if path:
            print(f"  wrote {path}")
        summary[workload] = {"points": pts, "front": [found[workload].index(q) for q in best]}
    path = os.path.join(args.out, "ab_front.json")
    with open(path, "w") as fh:
        json.dump({"command": "benchmarks/ab_front.py", "results": os.path.relpath(args.results, ROOT),
                   "workloads": summary}, fh, indent=2)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
