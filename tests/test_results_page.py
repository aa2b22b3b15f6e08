"""docs/results.md and the README's results table agree with the stored reports (benchmarks/results_page.py)."""
import copy
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "results_page.py"


def _load():
    spec = importlib.util.spec_from_file_location("results_page", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rp = _load()


def test_results_page_matches_the_stored_reports():
    reports = rp.load_reports(ROOT)
    assert [r.workload for r in reports][:2] == ["fashion-cnn", "fashion-wide"]
    text = (ROOT / "docs" / "results.md").read_text()
    assert text == rp.expected(ROOT)[rp.PAGE], "docs/results.md is stale: run .venv/bin/python benchmarks/results_page.py"


def test_readme_table_matches_the_stored_reports():
    readme = (ROOT / "README.md").read_text()
    table = rp.readme_table(rp.load_reports(ROOT))
    assert readme == rp.with_readme_table(readme, table), \
        "the README's table between the results markers is stale: run .venv/bin/python benchmarks/results_page.py"
    time = rp.time_table(rp.load_slow_nets(ROOT), rp.load_walls(ROOT))
    assert readme == rp.with_readme_table(readme, time, rp.TIME_BEGIN, rp.TIME_END), \
        "the README's table between the time markers is stale: run .venv/bin/python benchmarks/results_page.py"


def test_figures_come_from_the_json():
    """Spot checks against the stored JSON, so a formatting slip cannot hide behind a regenerated page."""
    reports = {r.workload: r for r in rp.load_reports(ROOT)}
    cnn = reports["fashion-cnn"]
    ab = next(row for row in cnn.rows if row["config"] == "ab")
    page = rp.results_page(list(reports.values()))
    assert f"| `ab` | {100 * ab['test_accuracy'][0]:.2f} ± {100 * ab['test_accuracy'][1]:.2f} %" in page
    assert f"{ab['global_wire_bytes'][0] / 1e6:.1f} MB" in page
    assert cnn.data["command"].split()[0] == "benchmarks/ab_configs.py"
    for token in cnn.data["command"].split()[1:]:
        assert token in page
    assert "is a tie" in page and "shakespeare-gpt" in page


def _fake_gpt(folder: Path, seeds: tuple[int, ...] = (0, 1)) -> None:
    """A perplexity report shaped like ab_configs.py's, in place of the stored one if there is one."""
    def row(config, ppl, glob, ref_glob=12.0e9, ref_ppl=(4.360, 4.400)):
        ppl, ref_ppl = ppl[:len(seeds)], ref_ppl[:len(seeds)]
        mean = sum(ppl) / len(ppl)
        n = len(seeds)
        return {"config": config, "flags": f"--method {config}", "seeds": list(seeds),
                "test_perplexity": [mean, max(ppl) - min(ppl)], "test_perplexity_per_seed": list(ppl),
                "global_wire_bytes": [glob, 0.0], "total_wire_bytes": [glob * 2, 0.0],
                "delta_vs_ref": [mean - sum(ref_ppl) / n, 0.0], "global_share_of_ref": [glob / ref_glob, 0.0],
                "wall_seconds": [1.0, 0.0], "compression_ratio": [None] * n, "model_params": [1] * n,
                "training_state_bytes": [1] * n, "state_vs_ddp": [1.0] * n, "ranks": [[]] * n}
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(folder.parent / "peers-added-shakespeare-gpt", ignore_errors=True)  # rows of the stored table's
    folder.mkdir(parents=True)
    (folder / "ab_configs.json").write_text(json.dumps({
        "command": f"benchmarks/ab_configs.py --workload shakespeare-gpt --seeds {','.join(map(str, seeds))} "
                   "--method ddp --method ab",
        "workload": "gpt on Shakespeare", "metric": "test_perplexity",
        "rows": [row("ddp", (4.360, 4.400), 12.0e9), row("ab", (4.343, 4.367), 0.2e9)]}))


def _copy_tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for pattern in ("peers-full-*", "peers-added-*", "comm-bound-steps*-*", "wall-vs-ddp"):
        for report in (ROOT / "docs" / "results").glob(pattern):
            shutil.copytree(report, root / "docs" / "results" / report.name)
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copy(ROOT / "docs" / "results.md", root / "docs" / "results.md")
    return root


def test_a_gpt_report_is_picked_up(tmp_path):
    root = _copy_tree(tmp_path)
    _fake_gpt(root / "docs" / "results" / "peers-full-shakespeare-gpt")
    reports = rp.load_reports(root)
    assert [r.workload for r in reports] == ["fashion-cnn", "fashion-wide", "shakespeare-gpt"]
    page = rp.results_page(reports)
    assert "## `shakespeare-gpt`" in page and "Not measured at the full budget yet" not in page
    assert "| `ab` | 4.355 ± 0.024 | 4.343 / 4.367 | −0.025 (tie) |" in page
    table = rp.readme_table(reports)
    assert "`shakespeare-gpt` perplexity" in table.splitlines()[0]
    diloco = next(line for line in table.splitlines() if line.startswith("| `diloco` |"))
    assert diloco.endswith("| – | – |")  # no GPT run of diloco: two empty cells


def test_a_one_seed_report_calls_nothing_a_tie(tmp_path):
    """One seed has no spread: the page shows each value alone, says so, and calls no difference a tie."""
    root = _copy_tree(tmp_path)
    _fake_gpt(root / "docs" / "results" / "peers-full-shakespeare-gpt", seeds=(0,))
    reports = rp.load_reports(root)
    page = rp.results_page(reports)
    section = page[page.index("## `shakespeare-gpt`"):]
    assert "| `ab` | 4.343 | 4.343 | −0.017 |" in section and "no spread" in section and "(tie)" not in section
    table = rp.readme_table(reports)
    ab = next(line for line in table.splitlines() if line.startswith("| `ab` (defaults) |"))
    assert "| 4.343 |" in ab and "`shakespeare-gpt`: seed 0 only, no spread" in table


def test_check_fails_on_a_stale_page_and_write_fixes_it(tmp_path):
    root = _copy_tree(tmp_path)
    run = [sys.executable, str(SCRIPT), "--root", str(root)]
    assert subprocess.run([*run, "--check"], capture_output=True).returncode == 0
    data = json.loads((root / "docs/results/peers-full-fashion-cnn/ab_configs.json").read_text())
    changed = copy.deepcopy(data)
    changed["rows"][-1]["test_accuracy"][0] += 0.001
    (root / "docs/results/peers-full-fashion-cnn/ab_configs.json").write_text(json.dumps(changed))
    stale = subprocess.run([*run, "--check"], capture_output=True, text=True)
    assert stale.returncode == 1 and "docs/results.md" in stale.stderr and "README.md" in stale.stderr
    assert subprocess.run(run, capture_output=True).returncode == 0
    assert subprocess.run([*run, "--check"], capture_output=True).returncode == 0


def test_readme_markers_are_required():
    try:
        rp.with_readme_table("no markers here\n", "| a |\n")
    except ValueError as e:
        assert "results:begin" in str(e)
    else:
        raise AssertionError("a README without the markers must be refused")


def test_a_spread_of_bytes_below_the_tables_precision_is_shown_in_kilobytes():
    assert rp.megabytes([746914965.0, 0.0]) == "746.9 MB"
    assert rp.megabytes([746914965.0, 810.0]) == "746.9 MB ± 0.8 kB"
    assert rp.megabytes([746914965.0, 2.5e6]) == "746.9 MB ± 2.5"


def _fake_slow_net(folder: Path) -> None:
    """A comm_bound.json shaped like benchmarks/comm_bound.py's: two seeds, AB reaching DDP's accuracy on one."""
    def row(method, steps, metric, to, ratio, at):
        return {"method": method, "steps": steps, "metric": metric, "global_wire_bytes": 40e6, "wall_seconds": 300.0,
                "training_seconds": 290.0, "eval_seconds": 10.0, "evaluations": 18, "to_ddp": to,
                "to_ddp_previous": None if to is None else to - 20.0, "to_ddp_step": None, "to_ddp_ratio": ratio,
                "at_ddp_time": at, "at_ddp_time_step": 1053, "to_common": 100.0, "to_common_ratio": 0.2,
                "tx_vs_ledger": 1.04, "payload_vs_expected": 1.01}

    def seed(ab_to, ab_ratio):
        return {"metric": "accuracy", "rate_bytes_per_s": 2.5e6, "steps_factor": 1.5, "ddp_target": 0.92,
                "ddp_seconds": 900.0, "common_target": 0.90, "ddp_link_seconds_predicted": 720.0,
                "ddp_link_share_measured": 0.845, "ddp_link_share_predicted": 0.833, "none_wall": 144.0,
                "rows": [row("ddp", 702, 0.92, 900.0, 1.0, 0.92), row("ab", 1053, 0.921, ab_to, ab_ratio, 0.921),
                         row("diloco", 1053, 0.905, None, None, 0.905)]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "comm_bound.json").write_text(json.dumps({
        "command": "benchmarks/comm_bound.py --steps-factor 1.5", "workload": "fashion-cnn",
        "description": "cnn on Fashion-MNIST", "methods": "ddp,ab,diloco", "steps_factor": 1.5, "eval_every": 58,
        "rate": "20mbit", "seeds": {"0": seed(270.0, 0.3), "1": seed(None, None)}}))


def test_the_time_table_comes_from_the_stored_sweeps(tmp_path):
    root = _copy_tree(tmp_path)
    for old in (root / "docs" / "results").glob("comm-bound-steps*-*"):
        shutil.rmtree(old)
    shutil.rmtree(root / "docs" / "results" / "wall-vs-ddp", ignore_errors=True)
    assert rp.time_table(rp.load_slow_nets(root), rp.load_walls(root)).startswith("No time measurements")
    _fake_slow_net(root / "docs" / "results" / "comm-bound-steps15-fashion-cnn")
    (root / "docs" / "results" / "wall-vs-ddp").mkdir(parents=True)
    (root / "docs" / "results" / "wall-vs-ddp" / "wall_vs_ddp.json").write_text(json.dumps({
        "command": "benchmarks/wall_vs_ddp.py", "date": "2026-12-07 10:00", "ab_flags": "", "rows": [
            {"workload": "fashion-cnn", "seed": 0, "ddp": {"wall_seconds": 100.0}, "ab": {"wall_seconds": 110.0},
             "ratio": 1.1},
            {"workload": "fashion-cnn", "seed": 1, "ddp": {"wall_seconds": 100.0}, "ab": {"wall_seconds": 120.0},
             "ratio": 1.2}]}))
    nets, walls = rp.load_slow_nets(root), rp.load_walls(root)
    table = rp.time_table(nets, walls)
    head, _, *rows = table.splitlines()
    assert head == ("| method | one machine `fashion-cnn`: wall ÷ DDP's | `fashion-cnn` at 20 Mbit/s: to DDP's accuracy "
                    "÷ DDP's time | accuracy at DDP's time |")
    by_method = {r.split(" | ")[0][2:]: r for r in rows if r.startswith("| `")}
    assert by_method["`ab` (defaults)"] == "| `ab` (defaults) | 1.10× / 1.20× | 0.30× / not reached | 92.10 % / 92.10 % |"
    assert by_method["`diloco`"] == "| `diloco` | – | not reached / not reached | 90.50 % / 90.50 % |"
    assert by_method["`ddp`"].startswith("| `ddp` | 1.00× / 1.00× | 1.00× / 1.00× |")
    assert "(DDP's run 84% / 84% link time)" in " ".join(table.split())
    page = rp.results_page(rp.load_reports(root), rp.time_section(nets, walls))
    assert "### `fashion-cnn` at 20 Mbit/s, 1.5× DDP's steps" in page
    assert "| `ab` | 1053 | 92.10 % | 40.0 MB | 300.0 s | 270.0 s (250.0 s) | 0.30 |" in page
    assert "sudo .venv/bin/python benchmarks/comm_bound.py --steps-factor 1.5" in page and "ab 1.10× / 1.20×" in page
    run = [sys.executable, str(SCRIPT), "--root", str(root)]
    assert subprocess.run([*run, "--check"], capture_output=True).returncode == 1  # the README and page are stale
    assert subprocess.run(run, capture_output=True).returncode == 0
    readme = (root / "README.md").read_text()
    assert table in readme and readme.index("<!-- results:end -->") < readme.index("<!-- time:begin -->")


def test_rows_measured_later_are_compared_with_the_tables_ddp_row_seed_by_seed(tmp_path):
    root = _copy_tree(tmp_path)
    stored = json.loads((root / "docs/results/peers-full-fashion-cnn/ab_configs.json").read_text())
    ddp = stored["rows"][0]
    ddp_global = [sum(r["wire_bytes"] for r in run["comm_rows"] if r["scope"] == "global") for run in ddp["runs"]]
    later = {"config": "sparseloco", "flags": "--method sparseloco", "seeds": [0, 1],
             "test_accuracy": [0.905, 0.002], "test_accuracy_per_seed": [0.904, 0.906],
             "global_wire_bytes": [3.0e6, 1.0e6], "total_wire_bytes": [3.0e6, 1.0e6], "delta_vs_ref": [0.0, 0.0],
             "global_share_of_ref": [1.0, 0.0], "wall_seconds": [1.0, 0.0], "compression_ratio": [None, None],
             "model_params": [1, 1], "training_state_bytes": [1, 1], "state_vs_ddp": [1.25, 1.25], "ranks": [[], []],
             "runs": [{"seed": s, "comm_rows": [
                 {"op": "all_gather", "scope": "global", "phase": "outer", "group_size": 4, "calls": 1,
                  "payload_bytes": 1, "wire_bytes": g},
                 {"op": "all_reduce", "scope": "global", "phase": "setup", "group_size": 4, "calls": 1,
                  "payload_bytes": 32, "wire_bytes": 48.0}]} for s, g in ((0, 2.5e6 - 48), (1, 3.5e6 - 48))]}
    folder = root / "docs/results/peers-added-fashion-cnn"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    (folder / "ab_configs.json").write_text(json.dumps({
        "command": "benchmarks/ab_configs.py --workload fashion-cnn --seeds 0,1 --method sparseloco",
        "workload": "cnn", "metric": "test_accuracy", "rows": [later]}))
    reports = rp.load_reports(root)
    cnn = reports[0]
    row = cnn.row("sparseloco")
    deltas = [0.904 - ddp["test_accuracy_per_seed"][0], 0.906 - ddp["test_accuracy_per_seed"][1]]
    assert row["delta_vs_ref"] == pytest.approx([sum(deltas) / 2, abs(deltas[1] - deltas[0])])
    shares = [2.5e6 / ddp_global[0], 3.5e6 / ddp_global[1]]
    assert row["global_share_of_ref"] == pytest.approx([sum(shares) / 2, abs(shares[1] - shares[0])])
    page = rp.results_page(reports)
    section = page[page.index("### `fashion-cnn`: measured later"):]
    assert section.index("| `sparseloco` | 90.50 ± 0.20 % | 90.40 / 90.60 |") < section.index("## `fashion-wide`")
    assert "--method sparseloco" in section and "48 bytes" in section
    assert any(line.startswith("| `sparseloco` | 90.50 ± 0.20 % | 3.0 MB ± 1.0 (") for line in
               rp.readme_table(reports).splitlines())
    ddp_demo = next(r for r in stored["rows"] if r["config"] == "demo")["test_accuracy_per_seed"]
    again = {**copy.deepcopy(later), "config": "demo", "flags": "--method demo", "test_accuracy_per_seed": [0.5, 0.5]}
    (folder / "ab_configs.json").write_text(json.dumps({"command": "x", "workload": "cnn", "metric": "test_accuracy",
                                                        "rows": [later, again]}))
    reports = rp.load_reports(root)
    assert reports[0].row("demo")["test_accuracy_per_seed"] == ddp_demo  # the table's row, not the later one
    assert "`demo` also has a row in the table above" in rp.results_page(reports)
    later["seeds"] = [0, 2]
    (folder / "ab_configs.json").write_text(json.dumps({"command": "x", "workload": "cnn", "metric": "test_accuracy",
                                                        "rows": [later]}))
    with pytest.raises(ValueError, match="seeds"):
        rp.load_reports(root)[0].added_rows
