"""docs/results.md and the README's results table, written from the stored full-budget reports.

    .venv/bin/python benchmarks/results_page.py                 # write docs/results.md and the README's table
    .venv/bin/python benchmarks/results_page.py --check         # exit 1 when either differs from what it would write
    .venv/bin/python benchmarks/results_page.py --readme-table  # print the README's table

A stored report is docs/results/peers-full-<workload>/ab_configs.json, what
`benchmarks/ab_configs.py --method ddp --method ... --seeds 0,1` writes (its first row, DDP, is the
reference), with the plot `front.png` beside it. Every such folder present is a section of the page
and columns of the README's table, in the bench's order of workloads. The README's table sits
between the lines `<!-- results:begin -->` and `<!-- results:end -->`; nothing else in the README
is touched. Reads JSON only: no training, no torch.
"""

import argparse
import json
import shlex
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = Path("docs") / "results.md"
README = Path("README.md")
REPORTS = Path("docs") / "results"
PREFIX = "peers-full-"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

#: The bench's workloads in the order its docs list them; a report of any other workload follows them.
WORKLOAD_ORDER = ("fashion-cnn", "fashion-wide", "fashion-resnet", "shakespeare-gpt", "tiny")
#: The README's rows: the current defaults first, then the peers they are measured against.
README_METHODS = ("ab", "ddp", "powersgd", "diloco", "streaming-diloco", "demo")
#: Bench workloads that belong on the page but have no full-budget report yet, and where to look
#: meanwhile. A note disappears by itself once its folder exists.
PENDING = {
    "shakespeare-gpt": (
        "`shakespeare-gpt` (the character GPT, 2000 AdamW steps) has no full-budget table yet: one run "
        "takes 25–35 minutes on this machine, so the twelve runs of a table take about six hours. Its "
        "quick-budget numbers (60 steps, seed 0) are in "
        "[`docs/methods.md`](methods.md#measured-the-benchs-quick-budgets-one-seed), \"Measured: the "
        "bench's quick budgets, one seed\". Full-budget GPT runs of the defaults against DDP, PowerSGD "
        "and DiLoCo, made before the rank cap and partly on other machines, are in the note "
        "[`docs/notebook/2026-12-the-defaults.md`](notebook/2026-12-the-defaults.md), \"The defaults\"."),
}
MACHINE = ("one machine with 2 CPU cores and no GPU (gloo over loopback), 4 workers in 2 groups, "
           "every method with the flags `abtrain bench` gives it on the workload; the machine ran "
           "other work at the same time, so wall times (in the JSON) are left out")
TIE = ("A difference smaller than the spread of the seeds (the larger of the two methods' spreads) is "
       "a tie: such rows say \"tie\" beside the difference.")


@dataclass
class Report:
    """One stored report: a workload's methods over seeds, the first row being the reference."""
    workload: str      # the bench's name, from the folder: fashion-cnn
    folder: Path       # relative to the repository root
    data: dict
    has_plot: bool     # front.png beside the JSON

    @property
    def perplexity(self) -> bool:
        return self.data["metric"] == "test_perplexity"

    @property
    def rows(self) -> list[dict]:
        return self.data["rows"]

    @property
    def seeds(self) -> list[int]:
        return self.rows[0]["seeds"]

    @property
    def one_seed(self) -> bool:
        """One seed: no spread, so no difference can be called a tie or not."""
        return len(self.seeds) == 1


def load_reports(root: Path = ROOT) -> list[Report]:
    """Every docs/results/peers-full-*/ab_configs.json under root, in the bench's workload order."""
    reports = []
    for path in sorted((root / REPORTS).glob(f"{PREFIX}*/ab_configs.json")):
        data = json.loads(path.read_text())
        if not data.get("rows") or data["rows"][0]["config"] != "ddp":
            raise ValueError(f"{path.relative_to(root)}: the first row must be ddp, the reference of every comparison")
        reports.append(Report(path.parent.name[len(PREFIX):], path.parent.relative_to(root), data,
                              (path.parent / "front.png").exists()))
    rank = {w: i for i, w in enumerate(WORKLOAD_ORDER)}
    return sorted(reports, key=lambda r: (rank.get(r.workload, len(rank)), r.workload))


# -- formatting ------------------------------------------------------------------------------------
def para(text: str) -> list[str]:
    """A paragraph wrapped as the hand-written pages are, at 100 columns."""
    return textwrap.wrap(text, width=100, break_long_words=False, break_on_hyphens=False)


def metric_text(report: Report, value: float) -> str:
    return f"{value:.3f}" if report.perplexity else f"{100 * value:.2f}"


def unit(report: Report) -> str:
    return "" if report.perplexity else " %"


def mean_spread(report: Report, row: dict) -> str:
    mean, spread = row[report.data["metric"]]
    if report.one_seed:
        return f"{metric_text(report, mean)}{unit(report)}"
    return f"{metric_text(report, mean)} ± {metric_text(report, spread)}{unit(report)}"


def per_seed(report: Report, row: dict) -> str:
    return " / ".join(metric_text(report, v) for v in row[f"{report.data['metric']}_per_seed"])


def megabytes(pair: list[float]) -> str:
    mean, spread = pair
    if not spread:
        return f"{mean / 1e6:.1f} MB"
    # a spread below the table's 0.1 MB (a few hundred bytes of bookkeeping) is shown in kB, not as ± 0.0
    return f"{mean / 1e6:.1f} MB ± " + (f"{spread / 1e6:.1f}" if spread >= 5e4 else f"{spread / 1e3:.1f} kB")


def times_fewer(row: dict) -> str:
    ratio = 1 / row["global_share_of_ref"][0]
    return f"{ratio:.0f}×" if ratio >= 10 else f"{ratio:.1f}×"


def is_tie(report: Report, row: dict) -> bool:
    """A mean difference from the reference smaller than the larger spread of the two (one seed: never)."""
    if report.one_seed:
        return False
    metric = report.data["metric"]
    spread = max(row[metric][1], report.rows[0][metric][1])
    return abs(row["delta_vs_ref"][0]) < spread


def versus(report: Report, row: dict) -> str:
    if row is report.rows[0]:
        return "–"
    delta = row["delta_vs_ref"][0]
    text = f"{delta:+.3f}" if report.perplexity else f"{100 * delta:+.2f}"
    return text.replace("-", "−") + (" (tie)" if is_tie(report, row) else "")


def distinct(values: list, fmt: str) -> str:
    """One value when the seeds agree, else each seed's."""
    present = [v for v in values if v is not None]
    if not present:
        return "–"
    texts = list(dict.fromkeys(format(v, fmt) for v in present))
    return " / ".join(texts)


def compression(row: dict) -> str:
    text = distinct(row["compression_ratio"], ".2f")
    return text if text == "–" else f"{text}:1"


# -- the page --------------------------------------------------------------------------------------
def command(report: Report) -> str:
    """The stored command as a reader types it, one flag and its value a line."""
    lines: list[list[str]] = [[".venv/bin/python"]]
    for i, token in enumerate(shlex.split(report.data["command"])):
        if token.startswith("--") and i > 0:
            lines.append([])
        lines[-1].append(shlex.quote(token))
    return " \\\n    ".join(" ".join(line) for line in lines)


def workload_section(report: Report) -> list[str]:
    name = "test perplexity" if report.perplexity else "test accuracy"
    better = "lower is better" if report.perplexity else "higher is better"
    seeds = " / ".join(str(s) for s in report.seeds)
    folder = report.folder.relative_to("docs").as_posix()
    lines = [f"## `{report.workload}`", ""]
    over = ("one run per method (one seed has no spread, so no difference below is called a tie or a "
            "win; the second seed is still to be run)" if report.one_seed else
            "mean ± spread (max − min) over the seeds, and each seed's")
    lines += para(
        f"The workload: {report.data['workload']}; seed{'' if report.one_seed else 's'} "
        f"{', '.join(str(s) for s in report.seeds)}. {name.capitalize()} "
        f"({better}): {over}; \"vs DDP\" the "
        f"{'' if report.one_seed else 'mean '}difference from DDP's; wire bytes per worker, \"global\" between the groups (between nodes "
        "in a deployment), \"total\" with the traffic inside a group; \"compression\" the size of "
        "AB-training's model against the dense one; \"state\" the most training state a worker held "
        "(parameters, gradients, optimizer and method state), as a multiple of DDP's.")
    lines += [
        "",
        f"| method | {name} | seed {seeds} | vs DDP | global wire | fewer than DDP | total wire | compression | state |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report.rows:
        lines.append(
            f"| `{row['config']}` | {mean_spread(report, row)} | {per_seed(report, row)} | {versus(report, row)} "
            f"| {megabytes(row['global_wire_bytes'])} | {times_fewer(row)} | {megabytes(row['total_wire_bytes'])} "
            f"| {compression(row)} | {distinct(row['state_vs_ddp'], '.2f')} |")
    flags = [f"`{r['config']}` `{r['flags']}`" for r in report.rows if r["flags"] != f"--method {r['config']}"]
    lines += [""] + para(
        "Every method ran with `--method NAME` and the workload's shared flags"
        + (f", with the flags its registration adds: {'; '.join(flags)}." if flags else "."))
    lines += [""] + para(
        "The command that made this report (it reuses each run's `results.json` it finds under `--out`, "
        "so an interrupted sweep continues):")
    lines += ["", "```bash", command(report), "```", ""]
    lines += para(
        f"Stored in [`docs/{folder}/`]({folder}/): `ab_configs.json` (what the command wrote: the "
        "table's source, with the command, the wall times and AB-training's ranks at every "
        "decomposition), `table.txt` (the table it printed)"
        + (" and `front.png` (the plot below)." if report.has_plot else "."))
    if report.has_plot:
        lines += [""] + para(f"{name.capitalize()} against global wire bytes per worker "
                             f"([`front.png`]({folder}/front.png)): each method's mean, the seeds' spread as a bar, "
                             "and AB-training's compression in the legend:")
        lines += ["", f"![{report.workload}: {name} against global wire bytes per worker]({folder}/front.png)"]
    return lines + [""]


def results_page(reports: list[Report]) -> str:
    """docs/results.md: one section per stored report, then the workloads still without one."""
    present = {r.workload for r in reports}
    names = ", ".join(f"`{r.workload}`" for r in reports)
    lines = [
        "# Results: every method at the full budget",
        "",
        "<!-- Written by benchmarks/results_page.py from docs/results/peers-full-*/ab_configs.json; "
        "edit that script or the reports, not this page. -->",
        "",
    ]
    lines += para(
        "AB-training with its defaults (`--method ab`) against DDP and the methods a user would pick "
        f"instead, at the bench's full budgets on {names}. Every number comes from a stored report: "
        "`.venv/bin/python benchmarks/results_page.py` writes this page and the README's table from "
        "them; `--check` and `tests/test_results_page.py` fail when either differs from them.")
    lines += [""] + para(f"Measured on {MACHINE}. {TIE}") + [""]
    for report in reports:
        lines += workload_section(report)
    pending = [w for w in PENDING if w not in present]
    if pending:
        lines += ["## Not measured at the full budget yet", ""]
        for w in pending:
            lines += para(PENDING[w]) + [""]
    lines += ["## Elsewhere", ""] + para(
        "What each method sends, its byte formula, and what these tables say method by method: "
        "[`docs/methods.md`](methods.md). AB-training's defaults and why: "
        "[`docs/ab-training.md`](ab-training.md). How to reproduce these tables: "
        "[`docs/benchmarks.md`](benchmarks.md). The runs that chose the defaults, AB-training's other "
        "configurations and the runs through a shaped network between nodes, as dated notes: "
        "[`docs/notebook/`](notebook/README.md).")
    return "\n".join(lines) + "\n"


def readme_table(reports: list[Report]) -> str:
    """The README's table: the defaults and their peers, accuracy and global bytes per workload."""
    head = ["method"]
    for r in reports:
        head += [f"`{r.workload}` {'perplexity' if r.perplexity else 'accuracy'}", "global wire"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    by_workload = [{row["config"]: row for row in r.rows} for r in reports]
    for method in README_METHODS:
        if not any(method in rows for rows in by_workload):
            continue
        cells = [f"`{method}`" + (" (defaults)" if method == "ab" else "")]
        for report, rows in zip(reports, by_workload):
            row = rows.get(method)
            if row is None:
                cells += ["–", "–"]
                continue
            fewer = "" if row is report.rows[0] else f" ({times_fewer(row)} fewer)"
            cells += [mean_spread(report, row), megabytes(row["global_wire_bytes"]) + fewer]
        lines.append("| " + " | ".join(cells) + " |")
    seeds = sorted({s for r in reports for s in r.seeds})
    single = [f"`{r.workload}`: seed {r.seeds[0]} only, no spread" for r in reports if r.one_seed]
    lines += [""] + para(
        f"Mean ± spread (max − min) over seeds {' and '.join(map(str, seeds))}"
        + (f" ({'; '.join(single)})" if single else "") + ", 4 workers in 2 groups "
        "on one 2-core CPU machine; global wire bytes per worker, between the groups. A difference "
        "smaller than the spread is a tie. Each seed, total bytes, model size, training state and "
        "the commands: [`docs/results.md`](docs/results.md).")
    return "\n".join(lines) + "\n"


def with_readme_table(readme: str, table: str) -> str:
    """The README with the text between the markers replaced by the table."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise ValueError(f"README.md must hold one {BEGIN} line and one {END} line after it")
    before, rest = readme.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    return f"{before}{BEGIN}\n{table}{END}{after}"


def expected(root: Path = ROOT) -> dict[Path, str]:
    """What the two files should hold, by path relative to root."""
    reports = load_reports(root)
    return {PAGE: results_page(reports), README: with_readme_table((root / README).read_text(), readme_table(reports))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs from what it would write")
    p.add_argument("--readme-table", action="store_true", help="print the README's table and write nothing")
    p.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this script's)")
    args = p.parse_args(argv)
    if args.readme_table:
        print(readme_table(load_reports(args.root)), end="")
        return 0
    stale = []
    for rel, text in expected(args.root).items():
        path = args.root / rel
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(str(rel))
        else:
            path.write_text(text)
            print(f"wrote {rel}")
    if stale:
        print(f"out of date with docs/results/{PREFIX}*/ab_configs.json: {', '.join(stale)}; "
              "run .venv/bin/python benchmarks/results_page.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
