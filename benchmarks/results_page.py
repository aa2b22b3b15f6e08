"""docs/results.md and the README's results table, written from the stored full-budget reports.

    .venv/bin/python benchmarks/results_page.py                 # write docs/results.md and the README's table
    .venv/bin/python benchmarks/results_page.py --check         # exit 1 when either differs from what it would write
    .venv/bin/python benchmarks/results_page.py --readme-table  # print the README's table
    .venv/bin/python benchmarks/results_page.py --plots         # also draw every row of a workload on one plot

A stored report is docs/results/peers-full-<workload>/ab_configs.json, what
`benchmarks/ab_configs.py --method ddp --method ... --seeds 0,1` writes (its first row, DDP, is the
reference), with the plot `front.png` beside it. Every such folder present is a section of the page
and columns of the README's table, in the bench's order of workloads. The README's table sits
between the lines `<!-- results:begin -->` and `<!-- results:end -->`.

Methods measured after a workload's table, by one command of their own on the same machine, workload and
seeds (`benchmarks/ab_configs.py --method M ...`), are stored in docs/results/peers-added-<workload>/
ab_configs.json: their rows follow the table as a table of their own, compared with the stored DDP row seed by
seed, and the README takes from there the methods its table lacks.

The README's second table, between `<!-- time:begin -->` and `<!-- time:end -->`, and the page's
section on time: each method's wall on one machine against DDP's, from
docs/results/wall-vs-ddp/wall_vs_ddp.json (what `benchmarks/wall_vs_ddp.py` writes under
benchmarks/results/wall_vs_ddp/, copied there once run on an idle machine), and its time to DDP's
final metric on a slow network, from every docs/results/comm-bound-steps*-<workload>/comm_bound.json
(what `benchmarks/comm_bound.py --steps-factor F` writes). Nothing else in the README is touched.
Reads JSON only: no training, no torch.
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
ADDED = "peers-added-"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
TIME_BEGIN, TIME_END = "<!-- time:begin -->", "<!-- time:end -->"
WALLS = REPORTS / "wall-vs-ddp" / "wall_vs_ddp.json"
SLOW_NET = "comm-bound-steps*-*/comm_bound.json"

#: The bench's workloads in the order its docs list them; a report of any other workload follows them.
WORKLOAD_ORDER = ("fashion-cnn", "fashion-wide", "fashion-resnet", "shakespeare-gpt", "tiny")
#: The README's rows: the current defaults first, then the peers they are measured against.
README_METHODS = ("ab", "ddp", "powersgd", "diloco", "streaming-diloco", "demo", "sparseloco")
#: Bench workloads that belong on the page but have no full-budget report yet, and where to look
#: meanwhile. A note disappears by itself once its folder exists.
PENDING = {
    "shakespeare-gpt": (
        "`shakespeare-gpt` (the character GPT, 2000 AdamW steps) has no full-budget table yet: one run "
        "takes 25–35 minutes on this machine, so the twelve runs of a table take about six hours. Its "
        "quick-budget numbers (60 steps, seed 0) are in "
        "[`docs/notebook/2026-12-peers-measured.md`](notebook/2026-12-peers-measured.md), \"Measured: the "
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
    added: dict | None = None  # the peers-added-<workload> report: rows measured later, by their own command
    added_plot: bool = False   # front-all.png beside it

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
    def added_rows(self) -> list[dict]:
        """The later rows, their comparisons taken against this report's DDP row (:func:`against`)."""
        return [against(row, self.rows[0], self.data["metric"]) for row in (self.added or {}).get("rows", [])]

    def row(self, config: str) -> dict | None:
        """The method's row: the table's, else the one measured later (where a later row repeats a method of the
        table, the README keeps the table's, so that its row comes from one command on every workload)."""
        return next((r for r in self.rows + self.added_rows if r["config"] == config), None)

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
        workload = path.parent.name[len(PREFIX):]
        added = root / REPORTS / f"{ADDED}{workload}" / "ab_configs.json"
        reports.append(Report(workload, path.parent.relative_to(root), data, (path.parent / "front.png").exists(),
                              json.loads(added.read_text()) if added.exists() else None,
                              (added.parent / "front-all.png").exists()))
    rank = {w: i for i, w in enumerate(WORKLOAD_ORDER)}
    return sorted(reports, key=lambda r: (rank.get(r.workload, len(rank)), r.workload))


def global_bytes(run: dict, phase: str | None = None) -> float:
    """A stored run's global wire bytes per worker (of one phase)."""
    return sum(r["wire_bytes"] for r in run["comm_rows"] if r["scope"] == "global" and phase in (None, r["phase"]))


def against(row: dict, ref: dict, metric: str) -> dict:
    """``row`` (another command's) with its "vs" columns taken against ``ref`` seed by seed, as ab_configs.py
    takes them against its own first row: the mean and spread of the per-seed differences and byte ratios."""
    def stats(values: list[float]) -> list[float]:
        return [sum(values) / len(values), max(values) - min(values) if len(values) > 1 else 0.0]

    ref_runs = {run["seed"]: run for run in ref["runs"]}
    ref_value = dict(zip(ref["seeds"], ref[f"{metric}_per_seed"]))
    seeds = [s for s in row["seeds"] if s in ref_value]
    if seeds != row["seeds"]:
        raise ValueError(f"{row['config']}: seeds {row['seeds']}, the reference has {ref['seeds']}")
    value = dict(zip(row["seeds"], row[f"{metric}_per_seed"]))
    runs = {run["seed"]: run for run in row["runs"]}
    return {**row, "delta_vs_ref": stats([value[s] - ref_value[s] for s in seeds]),
            "global_share_of_ref": stats([global_bytes(runs[s]) / global_bytes(ref_runs[s]) for s in seeds])}


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
    lines += table_rows(report, report.rows)
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
    if report.added:
        lines += added_section(report, name, seeds)
    return lines + [""]


def table_rows(report: Report, rows: list[dict]) -> list[str]:
    return [f"| `{row['config']}` | {mean_spread(report, row)} | {per_seed(report, row)} | {versus(report, row)} "
            f"| {megabytes(row['global_wire_bytes'])} | {times_fewer(row)} | {megabytes(row['total_wire_bytes'])} "
            f"| {compression(row)} | {distinct(row['state_vs_ddp'], '.2f')} |" for row in rows]


def added_section(report: Report, name: str, seeds: str) -> list[str]:
    """The rows measured later by a command of their own, against the table's DDP row."""
    added = report.added
    folder = (REPORTS / f"{ADDED}{report.workload}").relative_to("docs").as_posix()
    setup = [global_bytes(run, "setup") for run in report.rows[0]["runs"]]
    later = [global_bytes(run, "setup") for row in added["rows"] for run in row["runs"]]
    lines = ["", f"### `{report.workload}`: measured later", ""]
    lines += para(
        "These rows come from a later command of their own, on the same machine, workload, flags and seeds; "
        "\"vs DDP\" and \"fewer than DDP\" are taken against the DDP row above, seed by seed. "
        f"The rows above include a start-up broadcast of the model ({max(setup) / 1e6:.2f} MB of global wire per "
        f"worker in DDP's row); these were run by an abtrain that confirms the model with a digest instead "
        f"({max(later):.0f} bytes) and broadcasts only on a mismatch, so their global bytes lack that one-off "
        "part.")
    lines += ["", f"| method | {name} | seed {seeds} | vs DDP | global wire | fewer than DDP | total wire | "
                  "compression | state |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += table_rows(report, report.added_rows)
    again = [f"`{r['config']}`" for r in added["rows"] if any(o["config"] == r["config"] for o in report.rows)]
    if again:
        lines += [""] + para(f"{', '.join(again)} also {'has a row' if len(again) == 1 else 'have rows'} in the "
                             "table above, run by an earlier abtrain (its default may have changed since: "
                             "docs/methods.md); the README keeps the table's.")
    flags = [f"`{r['config']}` `{r['flags']}`" for r in added["rows"] if r["flags"] != f"--method {r['config']}"]
    if flags:
        lines += [""] + para(f"Flags beyond `--method NAME` and the workload's: {'; '.join(flags)}.")
    lines += [""] + para("The command:") + ["", "```bash", command(Report(report.workload, Path(), added, False)),
                                            "```", ""]
    plot = report.added_plot
    lines += para(f"Stored in [`docs/{folder}/`]({folder}/): `ab_configs.json` and `table.txt` (its own "
                  "\"vs\" columns are against its own first row)"
                  + (", and `front-all.png`, every row of both tables (`--plots` draws it):" if plot else "."))
    if plot:
        lines += ["", f"![{report.workload}: every method, {name} against global wire bytes per worker]"
                      f"({folder}/front-all.png)"]
    return lines


def front_plot(report: Report, path: Path) -> bool:
    """Both tables' rows on one plot: the metric's mean (the seeds' spread as a bar) against global wire bytes per
    worker; False where matplotlib is not installed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plots import front

    scale = 1.0 if report.perplexity else 100.0
    later = {r["config"] for r in report.added_rows}
    rows = [(r, "o") for r in report.rows if r["config"] not in later] + [(r, "s") for r in report.added_rows]
    points = [(row["config"] + (" (later)" if marker == "s" else ""), row["global_wire_bytes"][0] / 1e6,
               scale * row[report.data["metric"]][0], scale * row[report.data["metric"]][1], marker)
              for row, marker in rows]
    return front(points, path, title=f"{report.workload}: every method, seeds {', '.join(map(str, report.seeds))}",
                 ylabel=("test perplexity" if report.perplexity else "test accuracy (%)") + " (mean; bar: spread)")


def results_page(reports: list[Report], time: list[str] | None = None) -> str:
    """docs/results.md: one section per stored report, the workloads still without one, the section on time."""
    present = {r.workload for r in reports}
    names = ", ".join(f"`{r.workload}`" for r in reports)
    lines = [
        "# Results: every method at the full budget",
        "",
        "<!-- Written by benchmarks/results_page.py from docs/results/peers-full-*/ab_configs.json, "
        "comm-bound-steps*-*/comm_bound.json and wall-vs-ddp/wall_vs_ddp.json; edit that script or the reports, "
        "not this page. -->",
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
    lines += time or []
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
    for method in README_METHODS:
        if not any(r.row(method) for r in reports):
            continue
        cells = [f"`{method}`" + (" (defaults)" if method == "ab" else "")]
        for report in reports:
            row = report.row(method)
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


def with_readme_table(readme: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """The README with the text between the markers replaced by the table."""
    if readme.count(begin) != 1 or readme.count(end) != 1 or readme.index(begin) > readme.index(end):
        raise ValueError(f"README.md must hold one {begin} line and one {end} line after it")
    before, rest = readme.split(begin, 1)
    _, after = rest.split(end, 1)
    return f"{before}{begin}\n{table}{end}{after}"


# -- time: one machine and a slow network ------------------------------------------------------------
@dataclass
class SlowNet:
    """One stored `benchmarks/comm_bound.py` sweep: a workload through a shaped link, seed by seed."""
    folder: Path       # relative to the repository root
    data: dict

    @property
    def workload(self) -> str:
        return self.data["workload"]

    @property
    def seeds(self) -> list[str]:
        return sorted(self.data["seeds"], key=int)

    @property
    def perplexity(self) -> bool:
        return self.data["seeds"][self.seeds[0]]["metric"] == "perplexity"

    @property
    def mbit(self) -> str:
        return f"{self.data['seeds'][self.seeds[0]]['rate_bytes_per_s'] * 8 / 1e6:g} Mbit/s"

    def row(self, seed: str, method: str) -> dict | None:
        return next((r for r in self.data["seeds"][seed]["rows"] if r["method"] == method), None)

    def show(self, value: float | None) -> str:
        if value is None:
            return "–"
        return f"{value:.3f}" if self.perplexity else f"{100 * value:.2f} %"


def load_slow_nets(root: Path = ROOT) -> list[SlowNet]:
    """Every docs/results/comm-bound-steps*-*/comm_bound.json under root, in the bench's workload order."""
    found = [SlowNet(p.parent.relative_to(root), json.loads(p.read_text()))
             for p in sorted((root / REPORTS).glob(SLOW_NET))]
    rank = {w: i for i, w in enumerate(WORKLOAD_ORDER)}
    return sorted(found, key=lambda n: (rank.get(n.workload, len(rank)), n.workload))


def load_walls(root: Path = ROOT) -> dict | None:
    """The stored wall_vs_ddp.json, or None before it is measured."""
    path = root / WALLS
    return json.loads(path.read_text()) if path.exists() else None


def wall_ratios(walls: dict | None) -> dict[str, dict[str, list[float]]]:
    """workload -> method -> its wall ÷ DDP's on one machine, one value per seed (every method the JSON holds)."""
    out: dict[str, dict[str, list[float]]] = {}
    for row in (walls or {}).get("rows", []):
        runs = {k: v for k, v in row.items() if isinstance(v, dict) and "wall_seconds" in v}
        for method, run in runs.items():
            out.setdefault(row["workload"], {}).setdefault(method, []).append(
                run["wall_seconds"] / runs["ddp"]["wall_seconds"])
    return out


def unfinished(walls: dict) -> str:
    """What the stored sweep left out, where it stopped before its end (the same command goes on from it)."""
    if walls.get("complete", True):
        return ""
    return f"; stopped before its end after {len(walls['rows'])} pairs of runs: the same command goes on with the rest"


def ratios(values: list[float | None], missing: str = "–") -> str:
    """Per-seed ratios, ``missing`` for a seed without one (a target never reached); "–" for none at all."""
    if not values:
        return "–"
    return " / ".join(missing if v is None else f"{v:.2f}×" for v in values)


def time_table(nets: list[SlowNet], walls: dict | None) -> str:
    """The README's time table: each method's wall on one machine against DDP's, and on each slow network its
    time to DDP's final metric against DDP's time and its metric at DDP's time."""
    one = wall_ratios(walls)
    if not nets and not one:
        return ("No time measurements are stored yet (`benchmarks/wall_vs_ddp.py`, "
                "`benchmarks/comm_bound.py --steps-factor 1.5`).\n")
    head = ["method"] + [f"one machine `{w}`: wall ÷ DDP's" for w in one]
    for n in nets:
        name = "perplexity" if n.perplexity else "accuracy"
        head += [f"`{n.workload}` at {n.mbit}: to DDP's {name} ÷ DDP's time", f"{name} at DDP's time"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    present = set().union(*(r.keys() for r in one.values()), *(
        {row["method"] for s in n.seeds for row in n.data["seeds"][s]["rows"]} for n in nets))
    for method in (m for m in README_METHODS if m in present):
        cells = [f"`{method}`" + (" (defaults)" if method == "ab" else "")]
        cells += [ratios(one[w].get(method, [])) for w in one]
        for n in nets:
            rows = [n.row(s, method) for s in n.seeds]
            cells.append("–" if all(r is None for r in rows) else
                         ratios([None if r is None else r["to_ddp_ratio"] for r in rows], "not reached"))
            cells.append(" / ".join("–" if r is None else n.show(r["at_ddp_time"]) for r in rows))
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if one:
        notes.append(f"One machine: the training loop's wall of each seed, 4 workers on 2 CPU cores "
                     f"(`{walls['command']}`, {walls['date']}{unfinished(walls)}).")
    else:
        notes.append("One machine: not measured on an idle machine yet (`benchmarks/wall_vs_ddp.py`).")
    for n in nets:
        d = n.data
        share = " / ".join(f"{d['seeds'][s].get('ddp_link_share_measured', 0):.0%}" for s in n.seeds)
        notes.append(
            f"`{n.workload}` through {n.mbit} links between nodes, one per group of workers (DDP's run {share} "
            f"link time), seeds {' / '.join(n.seeds)}: every method but DDP ran "
            f"{d['seeds'][n.seeds[0]]['steps_factor']:g}× DDP's steps, its learning-rate schedule stretched over "
            "them.")
    if nets:
        notes.append("Times on a slow network are training seconds (wall less evaluations), to the first "
                     "evaluation at least as good as DDP's final value (not interpolated); \"not reached\": not "
                     "within the longer run.")
    lines += [""] + para(" ".join(notes) + " Each seed, the bytes and the commands: "
                         "[`docs/results.md`](docs/results.md#time-to-ddps-result-where-the-network-is-slow).")
    return "\n".join(lines) + "\n"


def time_section(nets: list[SlowNet], walls: dict | None) -> list[str]:
    """docs/results.md's section on time: the one-machine walls and each slow-network sweep, seed by seed."""
    lines = ["## Time to DDP's result where the network is slow", ""]
    lines += para(
        "Bytes are what the methods save; time is what a user feels. On a slow link between nodes a method "
        "that compresses may run more steps than DDP and still finish first: each sweep below gives every "
        "method but DDP (and `none`, where no worker communicates) more steps, its learning-rate schedule "
        "stretched over them, and asks when it first reached DDP's final value. Times are training seconds: "
        "the wall at an evaluation less the evaluations before it, so the evaluation interval does not weigh "
        "on them; a time is that of the first evaluation at least as good (not interpolated), and the value "
        "was reached after the previous evaluation, whose time is in brackets. \"At DDP's time\": the value "
        "of the last evaluation at or before the end of DDP's training.")
    one = wall_ratios(walls)
    lines += [""]
    if one:
        lines += para(f"On one machine (`{walls['command']}`, {walls['date']}{unfinished(walls)}): each method's "
                      "training-loop wall "
                      "as a multiple of DDP's, seed by seed: "
                      + "; ".join(f"`{w}` " + ", ".join(f"{m} {ratios(v)}" for m, v in one[w].items() if m != "ddp")
                                  for w in one) + ".")
    else:
        lines += para("On one machine: not measured on an idle machine yet; `benchmarks/wall_vs_ddp.py` "
                      "measures it and its JSON, copied to `docs/results/wall-vs-ddp/wall_vs_ddp.json`, "
                      "fills this paragraph and the README's table.")
    for n in nets:
        d = n.data
        folder = n.folder.relative_to("docs").as_posix()
        name = "perplexity" if n.perplexity else "accuracy"
        lines += ["", f"### `{n.workload}` at {n.mbit}, {d['steps_factor']:g}× DDP's steps", ""]
        derivation = d.get("rate_derivation")
        how = (f" The rate is the one at which DDP's run is {derivation['link_share']:.0%} link time: DDP's "
               f"{derivation['ddp_global_wire_bytes'] / 1e6:.1f} MB of global wire bytes per worker over "
               f"`none`'s {derivation['none_wall']:.1f} s of training × {derivation['link_share']:.2f} / "
               f"{1 - derivation['link_share']:.2f}." if derivation else "")
        lines += para(f"{d['description']}; each group of workers in a node of its own, the nodes joined by "
                      f"{n.mbit} links (`abtrain bench --net`); an evaluation every {d['eval_every']} steps, every "
                      f"method.{how}")
        for seed in n.seeds:
            s = d["seeds"][seed]
            lines += [""] + para(
                f"Seed {seed}: DDP's final {name} {n.show(s['ddp_target'])} after {s['ddp_seconds']:.1f} s of "
                f"training; DDP's link share {s.get('ddp_link_share_measured', 0):.1%} measured "
                f"({s.get('ddp_link_share_predicted', 0):.1%} predicted from the ledger's bytes and `none`'s time).")
            lines += ["", f"| method | steps | {name} | global wire | wall | to DDP's {name} | ÷ DDP's time | "
                          f"at DDP's time | evaluations | tx ÷ ledger |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r in s["rows"]:
                to = "not reached" if r["to_ddp"] is None else f"{r['to_ddp']:.1f} s ({r['to_ddp_previous']:.1f} s)"
                ratio = "–" if r["to_ddp_ratio"] is None else f"{r['to_ddp_ratio']:.2f}"
                tx = "–" if r.get("tx_vs_ledger") is None else f"{r['tx_vs_ledger']:.3f}"
                lines.append(f"| `{r['method']}` | {r['steps']} | {n.show(r['metric'])} | "
                             f"{r['global_wire_bytes'] / 1e6:.1f} MB | {r['wall_seconds']:.1f} s | {to} | {ratio} | "
                             f"{n.show(r['at_ddp_time'])} | {r['evaluations']} ({r['eval_seconds']:.0f} s) | {tx} |")
        lines += [""] + para("The command (as root: it builds network namespaces; a seed whose report exists is "
                             "reused):") + ["", "```bash", f"sudo .venv/bin/python {d['command']}", "```", ""]
        lines += para(f"Stored in [`docs/{folder}/`]({folder}/): `comm_bound.json` (this section's source), "
                      "`table.md` (what the command printed) and each seed's bench report (`sS/report.md`, "
                      "`report.json`, the plots).")
    return lines + [""]


def expected(root: Path = ROOT) -> dict[Path, str]:
    """What the two files should hold, by path relative to root."""
    reports, nets, walls = load_reports(root), load_slow_nets(root), load_walls(root)
    readme = with_readme_table((root / README).read_text(), readme_table(reports))
    readme = with_readme_table(readme, time_table(nets, walls), TIME_BEGIN, TIME_END)
    return {PAGE: results_page(reports, time_section(nets, walls)), README: readme}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs from what it would write")
    p.add_argument("--readme-table", action="store_true", help="print the README's table and write nothing")
    p.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this script's)")
    p.add_argument("--plots", action="store_true", help="also draw each workload's front-all.png (every row of its "
                   "table and of the rows measured later) into its peers-added-<workload>/ folder")
    args = p.parse_args(argv)
    if args.plots:
        for report in load_reports(args.root):
            path = args.root / REPORTS / f"{ADDED}{report.workload}" / "front-all.png"
            if report.added and front_plot(report, path):
                print(f"wrote {path.relative_to(args.root)}")
    if args.readme_table:
        print(readme_table(load_reports(args.root)), end="")
        print(time_table(load_slow_nets(args.root), load_walls(args.root)), end="")
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
        print(f"out of date with the stored reports under docs/results/: {', '.join(stale)}; "
              "run .venv/bin/python benchmarks/results_page.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
