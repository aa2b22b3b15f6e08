"""``abtrain bench``: end to end on a tiny workload, the network namespaces, the projection's arithmetic."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from abtrain.methods.summary import human_bytes
from abtrain.sidebyside import BenchConfig, NetworkModel, parse_method_args, run_bench
from abtrain.sidebyside import netns
from abtrain.sidebyside.alphabeta import (collective_seconds, comm_seconds_per_step, compute_per_step, epoch_seconds,
                                      group_size_of, row_group_size)
from abtrain.sidebyside.report import pareto_front, time_to_reach
from abtrain.sidebyside.timing import against_ddp, at_time, reach, training_seconds
from abtrain.config import TrainConfig
from abtrain.run.plan import lr_lambda
from abtrain.sidebyside.workloads import get_workload
from abtrain.cli import build_parser, main

ABTRAIN = [sys.executable, "-m", "abtrain.cli"]
PNG = b"\x89PNG\r\n\x1a\n"


def _env():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        env.pop(var, None)
    return env


# -- end to end ------------------------------------------------------------------

def test_bench_end_to_end_with_a_failing_method(tmp_path):
    out = tmp_path / "bench"
    p = subprocess.run(ABTRAIN + ["bench", "--workload", "tiny", "--methods", "ddp,ab,localsgd,diloco",
                                  "--method-args", "diloco:--diloco-sync-every 0", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, env=_env())
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # 1: a method failed, the report is still written
    assert "[bench 1/4] ddp" in p.stdout and "  ab | " in p.stdout  # progress, and the runs' own lines
    report = json.loads((out / "report.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert [r["method"] for r in report["methods"]] == ["ddp", "ab", "localsgd", "diloco"]
    assert {m: r["status"] for m, r in rows.items()} == {"ddp": "complete", "ab": "complete", "localsgd": "complete",
                                                           "diloco": "failed"}
    assert "diloco-sync-every" in rows["diloco"]["error"]
    for m in ("ddp", "ab", "localsgd"):
        r = rows[m]
        assert 0 <= r["test_accuracy"] <= 1 and r["steps"] == 8 and r["world_size"] == 2
        assert r["global_wire_bytes"] > 0 and r["peak_rss_bytes"] > 0 and r["wall_seconds"] > 0
        assert (out / "runs" / m / "results.json").exists()
    for m in ("ddp", "ab", "localsgd"):  # the peak of one step, as each run's ledger counted it
        run = json.loads((out / "runs" / m / "results.json").read_text())
        assert rows[m]["peak_global_step_bytes"] == run["comm"]["peak_global_step_bytes"] > 0
    assert rows["ddp"]["global_reduction_vs_ddp"] == pytest.approx(1.0)
    assert rows["localsgd"]["global_reduction_vs_ddp"] > 1  # averages every 2 steps instead of every step
    assert rows["ddp"]["time_to_ddp_metric"] is not None
    assert rows["ab"]["compression_ratio"] is not None and "sync" in rows["ab"]["by_phase"]
    assert report["pareto_front"] and set(report["pareto_front"]) <= {"ddp", "ab", "localsgd"}
    assert set(report["projection"]["epoch_seconds"]) == {"ddp", "ab", "localsgd"}
    assert report["projection"]["workers"] == [8, 16, 32, 64, 128, 256]
    for m in ("ddp", "ab", "localsgd"):  # each method's own compute: its wall less its collectives, per step
        run = json.loads((out / "runs" / m / "results.json").read_text())
        assert report["projection"]["compute_seconds_per_step"][m] == pytest.approx(
            max(0.0, run["wall_seconds"] - run["comm"]["seconds"]) / run["steps"])
    from abtrain import __version__
    assert (report["abtrain_version"], report["torch_version"]) == (__version__, torch.__version__)
    assert all(json.loads((out / "runs" / m / "results.json").read_text())["abtrain_version"] == __version__
               for m in ("ddp", "ab", "localsgd"))
    md = (out / "report.md").read_text()
    assert f"- abtrain {__version__}, torch {torch.__version__}" in md
    assert "| diloco | **failed** |" in md and "diloco failed" in md and "a model, not a measurement" in md
    ddp_line = next(line for line in md.splitlines() if line.startswith("| ddp | "))
    assert ddp_line.split(" | ")[3] == human_bytes(rows["ddp"]["peak_global_step_bytes"])  # the peak column
    for png in ("accuracy_vs_global_bytes.png", "accuracy_vs_wall.png", "bytes_by_scope.png", "bytes_by_phase.png",
                "model_and_state.png"):
        assert (out / png).read_bytes().startswith(PNG)


def test_bench_steps_factor_gives_the_methods_that_compress_more_steps(tmp_path):
    out = tmp_path / "bench"
    p = subprocess.run(ABTRAIN + ["bench", "--workload", "tiny", "--methods", "none,ddp,localsgd", "--steps-factor",
                                  "1.5", "--out", str(out)], capture_output=True, text=True, timeout=240, env=_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert {m: r["steps"] for m, r in rows.items()} == {"none": 8, "ddp": 8, "localsgd": 12}
    assert report["steps_factor"] == 1.5
    for m in rows:
        history = json.loads((out / "runs" / m / "results.json").read_text())["history"]
        assert rows[m]["history"] == [{k: h.get(k) for k in rows[m]["history"][0]} for h in history]
        # Each evaluation's own seconds, and the wall between two evaluations holds the first one's.
        assert all(h["eval_seconds"] > 0 for h in history)
        assert all(b["wall_seconds"] - a["wall_seconds"] >= a["eval_seconds"] for a, b in zip(history, history[1:]))
    timing = report["time_to_ddp"]
    assert timing["target"] == rows["ddp"]["test_accuracy"] and set(timing["methods"]) == set(rows)
    assert timing["ddp_seconds"] == pytest.approx(training_seconds(rows["ddp"]["history"])[-1])
    assert timing["methods"]["ddp"]["to_ddp_ratio"] <= 1.0 and timing["methods"]["localsgd"]["steps"] == 12
    md = (out / "report.md").read_text()
    assert "8 steps for DDP and `none` and 1.5× as many (12) for the others" in md
    assert "## Time to DDP's accuracy (on this machine)" in md and "| localsgd | 12 |" in md


@pytest.mark.parametrize("args,message", [
    (["--methods", "ddp,gossip"], "unknown method 'gossip'"),
    (["--method-args", "ab:--ab-rank 2"], "not in --methods"),
    (["--method-args", "--ab-rank 2"], "METHOD:FLAGS"),
    (["--net", "rate=fast"], "rate=fast"),
    (["--net", "bandwidth=1mbit"], "rate=RATE,delay=DELAY"),
    (["--inter-bw", "0"], "--inter-bw must be positive"),
    (["--extra", "--steps 'x"], "cannot split flags"),
])
def test_bad_bench_input_one_line(tmp_path, capsys, args, message):
    code = main(["bench", "--workload", "tiny", "--methods", "ddp", "--out", str(tmp_path / "b"), *args])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("abtrain: error:") and message in lines[0], lines
    assert not (tmp_path / "b").exists()


def test_existing_report_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "report.json").write_text("{}")
    assert main(["bench", "--workload", "tiny", "--out", str(tmp_path / "b")]) == 2
    assert "already holds a bench report" in capsys.readouterr().err


BENCH_FLAGS = {"--workload", "--methods", "--quick", "--out", "--extra", "--method-args", "--net", "--intra-bw",
               "--inter-bw", "--intra-latency", "--inter-latency", "--node-size", "--steps-factor"}


def test_bench_flag_surface_is_frozen():
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    flags = {s for a in bench._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    assert flags == BENCH_FLAGS
    assert all(a.help for a in bench._actions)


def test_workloads_share_flags_and_leave_ab_its_own_schedule():
    w = get_workload("fashion-cnn")
    assert w.steps == 3 * (60000 // 4 // 64)
    args = w.args_for("ab")
    # AB-training's defaults are fractions of the run: the workload adds no schedule of its own
    assert args[args.index("--group-size") + 1] == "2" and not any(a.startswith("--ab-") for a in args)
    assert get_workload("fashion-wide").args_for("ddp")[1] == "wide"
    quick = get_workload("fashion-cnn", quick=True)
    assert "--limit-train" in quick.train_args and quick.steps < w.steps
    assert get_workload("shakespeare-gpt").metric == "perplexity"
    assert parse_method_args(["ab:--ab-rank 2", "ab: --ab-sync full", "ddp:"]) == {
        "ab": "--ab-rank 2 --ab-sync full", "ddp": ""}
    with pytest.raises(ValueError, match="unknown workload"):
        get_workload("imagenet")


# -- report arithmetic ---------------------------------------------------------------

def test_pareto_front_and_time_to_reach():
    points = {"ddp": (0.90, 100.0), "ab": (0.89, 10.0), "localsgd": (0.88, 20.0), "none": (0.70, 0.0)}
    assert pareto_front(points, "accuracy") == {"ddp", "ab", "none"}
    assert pareto_front({"a": (5.0, 10.0), "b": (4.0, 20.0), "c": (6.0, 10.0)}, "perplexity") == {"a", "b"}
    history = [{"test_accuracy": 0.5, "wall_seconds": 1.0}, {"test_accuracy": 0.91, "wall_seconds": 2.0}]
    assert time_to_reach(history, 0.9, "accuracy") == 2.0
    assert time_to_reach(history, 0.95, "accuracy") is None
    assert time_to_reach([{"test_perplexity": 8.0, "wall_seconds": 3.0}], 8.5, "perplexity") == 3.0


def test_times_leave_out_the_evaluations_before_and_are_not_interpolated():
    # Evaluations of 1 s each: the row at wall 12 s has had two before it, so 10 s of training.
    history = [{"step": 5, "test_accuracy": 0.50, "wall_seconds": 4.0, "eval_seconds": 1.0},
               {"step": 10, "test_accuracy": 0.80, "wall_seconds": 8.0, "eval_seconds": 1.0},
               {"step": 15, "test_accuracy": 0.92, "wall_seconds": 12.0, "eval_seconds": 1.0}]
    assert training_seconds(history) == [4.0, 7.0, 10.0]
    assert reach(history, 0.9, "accuracy") == {"step": 15, "seconds": 10.0, "previous_seconds": 7.0, "value": 0.92}
    assert reach(history, 0.3, "accuracy")["previous_seconds"] == 0.0 and reach(history, 0.95, "accuracy") is None
    assert time_to_reach(history, 0.8, "accuracy") == 7.0  # the report's column: the same clock
    assert at_time(history, 9.99, "accuracy")["value"] == 0.80 and at_time(history, 3.0, "accuracy") is None
    ddp = [{"step": 10, "test_accuracy": 0.85, "wall_seconds": 5.0, "eval_seconds": 2.0},
           {"step": 20, "test_accuracy": 0.90, "wall_seconds": 12.0, "eval_seconds": 2.0}]  # 10 s of training
    out = against_ddp({"ddp": {"history": ddp, "steps": 20}, "ab": {"history": history, "steps": 15}}, "accuracy")
    assert (out["target"], out["ddp_seconds"]) == (0.90, 10.0)
    assert out["methods"]["ddp"]["to_ddp_ratio"] == 1.0 and out["methods"]["ddp"]["eval_seconds"] == 4.0
    ab = out["methods"]["ab"]
    assert (ab["to_ddp_seconds"], ab["to_ddp_ratio"], ab["at_ddp_time"], ab["at_ddp_time_step"]) == (10.0, 1.0, 0.92, 15)
    assert against_ddp({"ab": {"history": history}}, "accuracy") is None
    ppl = [{"test_perplexity": 9.0, "wall_seconds": 1.0}, {"test_perplexity": 7.0, "wall_seconds": 2.0}]
    assert reach(ppl, 8.0, "perplexity")["seconds"] == 2.0  # a history without eval_seconds: the wall itself


def test_a_longer_run_follows_the_same_learning_rate_curve():
    """--steps-factor stretches a run: with the warm-up a share of the run, step k of T steps and step F*k of
    F*T steps get the same learning rate (to the rounding of the warm-up to whole steps)."""
    for warm in (0.0, 0.05):
        cfg = TrainConfig(warmup_lr_fraction=warm)
        short, long = lr_lambda(cfg, 2000), lr_lambda(cfg, 3000)
        for k in range(0, 2000, 50):
            assert long(round(1.5 * k)) == pytest.approx(short(k), abs=0.02), (warm, k)
    w = get_workload("shakespeare-gpt")
    assert "--warmup-lr-steps" not in w.train_args  # a warm-up in steps would not stretch
    args = w.args_for("ab", 1.5)
    assert args[len(args) - 2:] == ["--steps", "3000"] and w.args_for("ab") == w.args_for("ab", 1.0)
    assert get_workload("fashion-cnn").args_for("ddp", 1.5)[-2:] == ["--steps", "1053"]  # --steps wins over --epochs


@pytest.mark.parametrize("kwargs,message", [
    ({"steps_factor": 0.5}, "--steps-factor must be between 1 and 100"),
    ({"steps_factor": float("nan")}, "--steps-factor must be between 1 and 100"),
    ({"steps_factor": 1.5, "extra": "--steps 20"}, "drop --steps"),
    ({"steps_factor": 1.5, "method_args": {"ab": "--warmup-lr-steps=3"}}, "drop --warmup-lr-steps"),
])
def test_steps_factor_refuses_what_would_undo_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(workload="tiny", methods=["ddp", "ab"], **kwargs)
    assert BenchConfig(workload="tiny", methods=["ddp"], extra="--steps 20").steps_factor == 1.0


def test_compute_per_step_is_each_runs_own_with_none_as_the_floor():
    runs = {"ddp": {"wall_seconds": 30.0, "steps": 10, "comm": {"seconds": 12.0}},   # 1.8 s of own work a step
            "ab": {"wall_seconds": 40.0, "steps": 10, "comm": {"seconds": 5.0}},     # 3.5 s: decompositions too
            "fast": {"wall_seconds": 20.0, "steps": 10, "comm": {"seconds": 19.0}}}  # 0.1 s: below none's
    none = {"wall_seconds": 15.0, "steps": 10, "comm": {"seconds": 0.0}}
    assert compute_per_step(runs) == pytest.approx({"ddp": 1.8, "ab": 3.5, "fast": 0.1})
    assert compute_per_step(runs, none) == pytest.approx({"ddp": 1.8, "ab": 3.5, "fast": 1.5})


def test_projection_on_hand_computed_numbers():
    # Ring all-reduce of 1 MB over 4 workers: 2(p-1) alpha + 2(p-1)/p n/beta = 6 us + 1.5 ms.
    assert collective_seconds("all_reduce", 1e6, 4, bandwidth=1e9, latency=1e-6) == pytest.approx(6e-6 + 1.5e-3)
    assert collective_seconds("all_gather", 1e6, 4, bandwidth=1e9, latency=0.0) == pytest.approx(3e-3)
    assert collective_seconds("broadcast", 1e6, 1, bandwidth=1e9, latency=1.0) == 0.0
    # The ledger's rows name their group's size; older results.json rows only allow recovering it.
    assert row_group_size({"op": "all_reduce", "group_size": 3, "payload_bytes": 4e6, "wire_bytes": 6e6}, 8) == 3
    assert row_group_size({"op": "all_reduce", "payload_bytes": 4e6, "wire_bytes": 6e6}, 8) == 4
    assert group_size_of("all_reduce", 4e6, 6e6) == 4 and group_size_of("broadcast", 8.0, 7.0) == 8
    assert group_size_of("all_gather", 1.0, 3.0) == 4
    # A run of 4 workers in groups of 2: per step one global all-reduce of 400 kB over all 4 and one
    # group all-reduce of 100 kB over 2; the one-off setup broadcast is left out.
    results = {"steps": 10, "world_size": 4, "steps_per_epoch": 100, "comm": {"rows": [
        {"op": "all_reduce", "group_size": 4, "scope": "global", "phase": "train", "calls": 10,
         "payload_bytes": 4e6, "wire_bytes": 6e6},
        {"op": "all_reduce", "group_size": 2, "scope": "group", "phase": "ab", "calls": 10, "payload_bytes": 1e6,
         "wire_bytes": 1e6},
        {"op": "broadcast", "group_size": 4, "scope": "global", "phase": "setup", "calls": 1, "payload_bytes": 1e9,
         "wire_bytes": 7.5e8}]}}
    model = NetworkModel(intra_bw=1e10, inter_bw=1e9, intra_latency=1e-6, inter_latency=1e-5, node_size=4)
    # 8 workers: global over 8 (2*7 alpha + 2*7/8 * 4e5 / 1e9), group over one node of 4 (6 alpha + 1.5e5 / 1e10).
    global_s = 14 * 1e-5 + 1.75 * 4e5 / 1e9
    group_s = 6 * 1e-6 + 1.5 * 1e5 / 1e10
    assert comm_seconds_per_step(results, 8, model) == pytest.approx(global_s + group_s)
    # An epoch of the run's samples at 8 workers: 100 * 4 / 8 = 50 steps of (10 ms compute + communication).
    assert epoch_seconds(results, 8, model, 0.01) == pytest.approx(50 * (0.01 + global_s + group_s))


# -- network namespaces ------------------------------------------------------------

_NETNS_REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(_NETNS_REASON is not None, reason=f"needs network namespaces: {_NETNS_REASON}")


def _ours(name: str) -> tuple[list[str], str]:
    namespaces = [ns for ns in netns.our_namespaces() if ns.startswith(name)]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return namespaces, links


def _root_links_clean(links: str) -> bool:
    names = {line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ":" in line}
    return not any(n == netns.IFNAME or n == "br0" or (n.startswith("w") and n[1:].isdigit()) for n in names)


@needs_netns
def test_network_setup_and_teardown_leave_nothing():
    links_before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    net = netns.Network(3, netns.NetSpec.parse("rate=50mbit"))
    with net:
        namespaces, _ = _ours(net.name)
        assert sorted(namespaces) == sorted([net.bridge_ns] + [net.namespace(k) for k in range(3)])
        qdiscs = subprocess.run(["tc", "-n", net.namespace(1), "qdisc", "show", "dev", netns.IFNAME],
                                capture_output=True, text=True).stdout
        assert "tbf" in qdiscs and "50Mbit" in qdiscs
        bridge_side = subprocess.run(["tc", "-n", net.bridge_ns, "qdisc", "show", "dev", "w2"],
                                     capture_output=True, text=True).stdout
        assert "tbf" in bridge_side
        assert net.counters()[0]["tx_bytes"] >= 0
    namespaces, links_after = _ours(net.name)
    assert namespaces == [] and links_after.count("\n") == links_before.count("\n") and _root_links_clean(links_after)


@needs_netns
@pytest.mark.parametrize("fail_at,error", [(10, netns.NetworkError), (16, KeyboardInterrupt)])
def test_teardown_after_failure_mid_setup(monkeypatch, fail_at, error):
    real_run = netns._run
    calls = []

    def failing(cmd):
        calls.append(cmd)
        if len(calls) == fail_at:  # the first worker's tc qdisc; the second worker's veth pair
            raise error("simulated failure") if error is netns.NetworkError else error()
        return real_run(cmd)

    monkeypatch.setattr(netns, "_run", failing)
    net = netns.Network(3, netns.NetSpec.parse("rate=10mbit"))
    with pytest.raises(error):
        net.setup()
    assert ["ip", "netns", "add", net.namespace(0)] in calls[:fail_at]  # it failed with namespaces made
    namespaces, links = _ours(net.name)
    assert namespaces == [] and _root_links_clean(links)


@needs_netns
def test_stale_namespaces_of_a_dead_bench_are_removed():
    dead_pid = 2 ** 31 - 2  # above any pid_max: no such process
    name = f"{netns.PREFIX}{dead_pid}-abcdef-w0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.cleanup_stale()
        assert name not in netns.our_namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@needs_netns
def test_bench_through_a_shaped_network_measures_the_counted_bytes(tmp_path, capsys):
    report = run_bench(BenchConfig(workload="tiny", methods=["ddp"], net="rate=200mbit", out=str(tmp_path / "net")))
    row = report["methods"][0]
    assert row["status"] == "complete", row["error"]
    m = row["measured"]
    # tiny's groups are single workers: each worker is a node, and every byte it counts crosses its link.
    assert m["layout"] == "worker" and m["expected_tx_bytes"] == pytest.approx(m["ledger_bytes"])
    print(f"\nddp through 2 namespaces at 200mbit: counted {m['ledger_bytes']:.0f} B/worker, measured tx "
          f"{m['tx_bytes_mean']:.0f} B/worker, ratio {m['ratio']:.3f}", file=sys.stderr)
    # Measured includes TCP/IP headers, acknowledgements and the rendezvous: a few percent above the ledger.
    assert m["within_tolerance"] and 0.9 <= m["ratio"] <= 1.1
    assert "## Measured on the wire" in (tmp_path / "net" / "report.md").read_text()
    namespaces, links = _ours(netns.PREFIX + f"{os.getpid()}-")
    assert namespaces == [] and _root_links_clean(links)


def test_net_without_root_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match="--net needs root"):
        netns.check_available()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None)
    with pytest.raises(ValueError, match="needs iproute2"):
        netns.check_available()


def test_net_spec_parsing():
    spec = netns.NetSpec.parse("rate=100mbit,delay=2ms")
    assert spec.rate_bytes_per_s == pytest.approx(12.5e6) and spec.delay_seconds == pytest.approx(2e-3)
    assert netns.NetSpec.parse("rate=1gbps").rate_bytes_per_s == 1e9
    assert netns.NetSpec.parse("rate=1mbit").node_size(2) == 2  # default: a node is a group of workers
    assert netns.NetSpec.parse("rate=1mbit,layout=worker").node_size(2) == 1
    assert netns.NetSpec.parse("rate=1mbit,layout=node").node_size(1) == 1
    for bad in ("rate=100", "delay=2", "rate=-1mbit", "", "rate=1mbit,jitter=1ms", "rate=1mbit,layout=rack"):
        with pytest.raises(ValueError):
            netns.NetSpec.parse(bad)


# -- the node layout: bytes on the links between nodes ------------------------------

def _row(op, scope, payload, p, calls=1, dtype="float32"):
    from abtrain.comm.ledger import wire_bytes
    return {"op": op, "scope": scope, "phase": "train", "calls": calls, "payload_bytes": payload,
            "wire_bytes": wire_bytes(op, payload, p), "group_size": p, "dtype": dtype}


def test_expected_link_bytes_on_hand_computed_numbers():
    from abtrain.sidebyside.linkbytes import expected_link_tx, link_check
    # 4 workers, nodes of 2 (= groups): a world all-reduce of 400 kB (1.5 x 400 kB per worker), a broadcast of
    # 100 kB from rank 0, a world all-gather of 10 kB each, and an in-group all-reduce of 200 kB.
    rows = [_row("all_reduce", "global", 400_000, 4), _row("broadcast", "global", 100_000, 4),
            _row("all_gather", "global", 10_000, 4), _row("all_reduce", "group", 200_000, 2)]
    # Node links: each node sends one worker's ring share of the all-reduce (600 kB) and all-gather (30 kB);
    # the broadcast crosses once to each of the 2 workers outside node 0 (200 kB); the group stays inside.
    assert expected_link_tx(rows, 4, 2) == pytest.approx(2 * 600_000 + 2 * 30_000 + 200_000)
    # One worker per node: every byte crosses a link, and the total is the ledger's (905 kB per worker).
    assert expected_link_tx(rows, 4, 1) == pytest.approx(4 * (600_000 + 75_000 + 30_000 + 200_000))
    results = {"world_size": 4, "comm": {"rows": rows, "wire_bytes": 905_000,
                                         "by_scope": {"global": {"wire_bytes": 705_000}}}}
    ok = link_check(results, {"layout": "node", "node_size": 2, "tx_bytes": [760_000, 700_000]})
    assert ok["expected_tx_bytes"] == pytest.approx(730_000) and ok["ratio"] == pytest.approx(1.0)
    assert ok["ledger_bytes"] == 705_000 and ok["within_tolerance"]
    assert not link_check(results, {"layout": "node", "node_size": 2, "tx_bytes": [820_000, 820_000]})["within_tolerance"]
    assert link_check(results, {"layout": "worker", "node_size": 1,
                                "tx_bytes": [905_000] * 4})["ratio"] == pytest.approx(1.0)
    # Headers out: 66 bytes per packet sent. 2000 packets per node on 862 kB: 730 kB of payload, the expected.
    packed = link_check(results, {"layout": "node", "node_size": 2, "tx_bytes": [892_000, 832_000],
                                  "tx_packets": [2000, 2000]})
    assert packed["ratio"] == pytest.approx(862 / 730) and not packed["within_tolerance"]
    assert packed["payload_tx_bytes"] == [760_000, 700_000] and packed["payload_ratio"] == pytest.approx(1.0)


def _four_workers_in_two_nodes(script: str, spec: str, port: int) -> list[dict[str, int]]:
    """Run ``script`` as a 4-worker gloo world in 2 nodes of 2; each node's interface counters, after less before."""
    with netns.Network(4, netns.NetSpec.parse(spec), node_size=2) as net:
        before = net.counters()
        procs = [subprocess.Popen(net.exec_prefix(k) + [sys.executable, "-c", script],
                                  env={**os.environ, "RANK": str(k), "WORLD_SIZE": "4", "MASTER_ADDR": net.address(0),
                                       "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": netns.IFNAME,
                                       "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL) for k in range(4)]
        assert [p.wait(timeout=240) for p in procs] == [0] * 4
        after = net.counters()
    return [{k: a[k] - b[k] for k in ("tx_bytes", "tx_packets")} for a, b in zip(after, before)]


def test_gloo_framing_on_hand_computed_numbers():
    from abtrain.sidebyside.linkbytes import FRAME_BYTES, gloo_framing_tx, link_check, ring_allreduce_messages
    assert FRAME_BYTES == 144  # three 48-byte preambles per message
    # Ring all-reduce at p = 4: 8 segments, 6 sent in each half; 1 MiB segments beyond 8 MiB (40 MiB: 40 segments).
    assert ring_allreduce_messages(4_000, 4, 4) == ring_allreduce_messages(8 << 20, 2, 4) == 12
    assert ring_allreduce_messages(40 << 20, 4, 4) == 60
    # One element: 3 hops to reduce it and 3 to hand it round, 6 messages over 4 workers.
    assert ring_allreduce_messages(4, 4, 4) == 1.5 and ring_allreduce_messages(4_000, 4, 1) == 0
    rows = [_row("all_reduce", "global", 400_000, 4, calls=10), _row("broadcast", "global", 100_000, 4),
            _row("all_gather", "global", 10_000, 4), _row("all_to_all", "global", 8_000, 4, calls=2),
            _row("all_reduce", "group", 200_000, 2)]
    # 2 nodes of 2: all-reduce 2 ring edges x 10 calls x 12; broadcast 2 receivers outside node 0; all-gather
    # 2 edges x 6 halves; all-to-all 4 workers x 2 peers on the other node x 2 calls; the group stays inside.
    assert gloo_framing_tx(rows, 4, 2) == 144 * (240 + 2 + 12 + 16)
    # One worker per node: every ring edge crosses (4 per ring), the broadcast reaches 3, the all-to-all 4 x 3 x 2,
    # and the 2 groups' rings of 2 (4 segments, 2 sent in each half) cross too: 4 edges x 4 messages.
    assert gloo_framing_tx(rows, 4, 1) == 144 * (480 + 3 + 24 + 24 + 4 * 4)
    results = {"world_size": 4, "comm": {"rows": rows, "wire_bytes": 0, "by_scope": {"global": {"wire_bytes": 1}}}}
    check = link_check(results, {"layout": "node", "node_size": 2, "tx_bytes": [10**6, 10**6],
                                 "tx_packets": [0, 0]})
    assert check["framing_tx_bytes"] == 144 * 270 / 2
    assert check["framed_payload_ratio"] == pytest.approx(10**6 / (check["expected_tx_bytes"] + 144 * 135))
    # A reduce-scatter between nodes leaves the framing unknown; inside a node it crosses nothing.
    assert gloo_framing_tx(rows + [_row("reduce_scatter", "global", 40_000, 4)], 4, 2) is None
    assert gloo_framing_tx(rows + [_row("reduce_scatter", "group", 40_000, 2)], 4, 2) == 144 * 270
    results["comm"]["rows"] = rows + [_row("reduce_scatter", "global", 40_000, 4)]
    check = link_check(results, {"layout": "node", "node_size": 2, "tx_bytes": [10**6, 10**6],
                                 "tx_packets": [0, 0]})
    assert check["framing_tx_bytes"] is None and check["framed_payload_ratio"] is None
    # Rows without their dtype (results written before rows carried one) leave it unknown too.
    assert gloo_framing_tx([{k: v for k, v in r.items() if k != "dtype"} for r in rows], 4, 2) is None


_FRAMING_OPS = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
for _ in range(300):
    dist.all_reduce(torch.ones(1_000))                   # 4 kB: 12 messages per ring edge
for _ in range(100):
    dist.all_gather([torch.empty(500) for _ in range(4)], torch.ones(500))
    dist.all_to_all_single(torch.empty(2_000), torch.ones(2_000))
    # a gather to rank 0 as the Communicator runs one: the others send 20 kB each, rank 0 nothing
    if dist.get_rank() == 0:
        dist.all_to_all_single(torch.empty(15_000), torch.empty(0), output_split_sizes=[0, 5_000, 5_000, 5_000],
                               input_split_sizes=[0, 0, 0, 0])
    else:
        dist.all_to_all_single(torch.empty(0), torch.ones(5_000), output_split_sizes=[0, 0, 0, 0],
                               input_split_sizes=[5_000, 0, 0, 0])
dist.destroy_process_group()
"""


@needs_netns
@pytest.mark.timeout(300)
def test_node_payload_is_the_counted_data_plus_gloo_framing():
    """Many small collectives between 2 nodes (a gather to rank 0 among them): the TCP payload is the expected data
    plus gloo's 144 B per message."""
    from abtrain.sidebyside.linkbytes import HEADER_BYTES, expected_link_tx, gloo_framing_tx
    sent = _four_workers_in_two_nodes(_FRAMING_OPS, "rate=1gbit", 29535)
    payload = sum(d["tx_bytes"] - HEADER_BYTES * d["tx_packets"] for d in sent)
    rows = [_row("all_reduce", "global", 4_000 * 300, 4, calls=300),
            _row("all_gather", "global", 2_000 * 100, 4, calls=100),
            _row("all_to_all", "global", 8_000 * 100, 4, calls=100),
            _row("gather", "global", 15_000 * 100, 4, calls=100)]  # the mean over the 4 workers
    data, framing = expected_link_tx(rows, 4, 2), gloo_framing_tx(rows, 4, 2)
    print(f"\nnode payload {payload} B: data {data:.0f} + gloo framing {framing:.0f} (ring set-up and the store "
          f"on top)", file=sys.stderr)
    # Both nodes: data 10.40 MB (the gathers 4 MB: ranks 2 and 3 send theirs across), framing 1.44 MB; leaving
    # the framing out would be 12 % short. Connecting the workers and the rendezvous store add about 10 kB.
    assert data + framing <= payload <= (data + framing) * 1.01 + 10_000


_TCP_SINK = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 29611)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0
while b := c.recv(1 << 20):
    n += len(b)
print(n, flush=True)
"""
_TCP_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], 29611))
for _ in range(int(sys.argv[3])):
    c.sendall(b"x" * int(sys.argv[2]))
c.close()
"""


@needs_netns
@pytest.mark.timeout(120)
@pytest.mark.parametrize("message", [2_000, 1_000_000])
def test_link_counters_less_66_bytes_per_packet_are_the_tcp_payload(message):
    """A TCP transfer of known size between two nodes: both interfaces' tx less 66 B per packet is the payload."""
    from abtrain.sidebyside.linkbytes import HEADER_BYTES
    total = 8_000_000
    with netns.Network(2, netns.NetSpec.parse("rate=500mbit")) as net:
        before = net.counters()
        sink = subprocess.Popen(net.exec_prefix(1) + [sys.executable, "-c", _TCP_SINK], stdout=subprocess.PIPE,
                                text=True)
        assert sink.stdout.readline().strip() == "ready"
        subprocess.run(net.exec_prefix(0) + [sys.executable, "-c", _TCP_SOURCE, net.address(1), str(message),
                                             str(total // message)], check=True, timeout=60)
        received = int(sink.communicate(timeout=60)[0])
        after = net.counters()
    assert received == total
    tx = sum(a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before))
    packets = sum(a["tx_packets"] - b["tx_packets"] for a, b in zip(after, before))
    assert all("tcp_retrans_segs" in c for c in after)
    retrans = sum(a["tcp_retrans_segs"] - b["tcp_retrans_segs"] for a, b in zip(after, before))
    # The connection's SYNs carry 8 more bytes of options each: a few dozen bytes over the whole transfer. On a
    # loaded machine acknowledgements may carry SACK blocks (10-34 B each): a few hundred bytes more. A header
    # wrong by one byte a packet would be off by thousands.
    assert abs(tx - HEADER_BYTES * packets - total) < 100 + 0.0002 * total, (tx, packets, retrans)


_OPS = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
group, _ = dist.new_subgroups(group_size=2)
dist.all_reduce(torch.ones(2_000_000))                # 8 MB over the world
dist.broadcast(torch.ones(1_000_000), 0)              # 4 MB from rank 0
dist.all_reduce(torch.ones(2_000_000), group=group)   # 8 MB inside each node
dist.barrier()
dist.destroy_process_group()
"""


@needs_netns
@pytest.mark.timeout(300)
def test_gloo_sends_what_the_link_model_expects_between_nodes():
    """gloo's ring all-reduce crosses each node's link once; its broadcast leaves the root's node only."""
    tx = [d["tx_bytes"] for d in _four_workers_in_two_nodes(_OPS, "rate=2gbit", 29533)]
    print(f"\nnode tx: {tx} (all-reduce 8 MB: 1.5 x 8 MB per node expected; broadcast 4 MB: 2 x 4 MB from node 0)",
          file=sys.stderr)
    assert tx[1] == pytest.approx(1.5 * 8e6, rel=0.05)  # node 1: its ring share of the all-reduce only
    assert tx[0] - tx[1] == pytest.approx(2 * 4e6, rel=0.05)  # node 0 also sends one copy to each of ranks 2, 3


_REDUCE_SCATTER = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.reduce_scatter_tensor(torch.empty(500_000), torch.ones(2_000_000))                  # 8 MB in, 2 MB out
dist.reduce_scatter(torch.empty(500_000), [torch.ones(500_000) for _ in range(4)])       # the same as a list
dist.barrier()
dist.destroy_process_group()
"""


@needs_netns
@pytest.mark.timeout(300)
def test_gloo_reduce_scatter_sends_an_all_reduces_bytes_between_nodes():
    """gloo runs a reduce-scatter as all-reduces (of the whole input, or of each chunk of a list): 1.5 x 8 MB
    leave each node per call, twice the ring reduce-scatter's 0.75 x 8 MB that the ledger's wire model counts
    (docs/bench.md)."""
    tx = [d["tx_bytes"] for d in _four_workers_in_two_nodes(_REDUCE_SCATTER, "rate=2gbit", 29536)]
    print(f"\nnode tx: {tx} (2 reduce-scatters of 8 MB; ring: 2 x 0.75 x 8 MB per node, all-reduce: 2 x 1.5 x 8 MB)",
          file=sys.stderr)
    for sent in tx:
        assert sent == pytest.approx(2 * 1.5 * 8e6, rel=0.05)


@needs_netns
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_node_bench_leaves_no_namespace(tmp_path, sig):
    out, log = tmp_path / "bench", tmp_path / "bench.log"
    p = subprocess.Popen(ABTRAIN + ["bench", "--workload", "tiny", "--methods", "ddp,ab", "--net", "rate=100mbit",
                                    "--extra", "--workers 4 --group-size 2", "--out", str(out)],
                         stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env(),
                         # A shell's background job inherits SIGINT ignored; a user's Ctrl-C is not.
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    prefix = f"{netns.PREFIX}{p.pid}-"
    deadline = time.monotonic() + 120
    while not (out / "runs" / "ddp" / "config.json").exists():  # the workers run inside the namespaces
        assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    nodes = [ns for ns in netns.our_namespaces() if ns.startswith(prefix)]
    assert len(nodes) == 3 and sum(ns.rsplit("-", 1)[1].startswith("n") for ns in nodes) == 2  # 2 nodes + bridge
    p.send_signal(sig)
    p.wait(timeout=120)
    stdout = log.read_text()
    assert p.returncode == 130, stdout[-3000:]
    assert [ns for ns in netns.our_namespaces() if ns.startswith(prefix)] == []
    assert "interrupted" in stdout and (out / "report.json").exists()


def test_time_split_on_hand_computed_numbers(tmp_path):
    """benchmarks/time_split.py: link = counted global bytes at the link's rate, rest = the remainder,
    and the compute speed-up at which the method's time to DDP's metric is half DDP's."""
    def run(method, rows):
        return {"method": method, "status": "complete", "history": [
            {"step": s, "test_accuracy": a, "global_wire_bytes": b, "wall_seconds": w} for s, a, b, w in rows]}
    report = {"command": "hand-made", "workload": {"metric": "accuracy"}, "ddp_target": 0.9,
              "net": {"rate_bytes_per_s": 1000.0},
              "methods": [run("ab", [(10, 0.8, 1000, 30.0), (20, 0.91, 2000, 62.0)]),
                          run("ddp", [(10, 0.85, 50000, 110.0), (20, 0.9, 100000, 220.0)])]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "split.json"
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "time_split.py")
    proc = subprocess.run([sys.executable, script, str(path), "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = {r["method"]: r for r in json.loads(out.read_text())["reports"][str(path)]}
    # ab reaches 0.9 at step 20: 62 s, of which 2000 B / 1000 B/s = 2 s on the link; ddp: 100 s + 120 s
    assert rows["ab"]["parts"] == {"step": 20, "time": 62.0, "link": 2.0, "rest": 60.0}
    assert rows["ddp"]["parts"] == {"step": 20, "time": 220.0, "link": 100.0, "rest": 120.0}
    assert rows["ab"]["ratio"] == pytest.approx(62 / 220)
    # (2 + 60/f) <= 0.5 (100 + 120/f)  <=>  f >= (60 - 60) / (50 - 2) = 0: met at any speed
    assert rows["ab"]["speedup"] == ["any", None]
    assert "| ab | 20 | 62.0 s | 2.0 s | 60.0 s | 0.282 | any (met here) |" in proc.stdout
    # a slower method: 150 s of compute needs (150 - 60) / (50 - 2) = 1.875x faster workers
    report["methods"][0] = run("ab", [(20, 0.95, 2000, 152.0)])
    path.write_text(json.dumps(report))
    subprocess.run([sys.executable, script, str(path), "--out", str(out)], check=True, capture_output=True)
    kind, f = json.loads(out.read_text())["reports"][str(path)][0]["speedup"]
    assert kind == "from" and f == pytest.approx(90 / 48)
    # a bench without --net cannot be split: said on its row, the others kept, exit status 2
    (tmp_path / "plain.json").write_text(json.dumps({**report, "net": None}))
    proc = subprocess.run([sys.executable, script, str(tmp_path / "plain.json"), str(path), "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "cannot split: ValueError('no --net rate in this bench')" in proc.stdout
    assert list(json.loads(out.read_text())["reports"]) == [str(path)]


def test_time_split_speedup_cases():
    """Every case of (l_m + r_m/f) <= t (l_d + r_d/f), and a DDP history short of its own final metric."""
    spec = importlib.util.spec_from_file_location(
        "time_split", os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "time_split.py"))
    ts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ts)
    ddp = {"link": 100.0, "rest": 120.0}
    assert ts.speedup_needed({"link": 2.0, "rest": 150.0}, ddp, 0.5) == ("from", 90 / 48)
    assert ts.speedup_needed({"link": 60.0, "rest": 150.0}, ddp, 0.5) == ("never", None)  # its link alone is too long
    assert ts.speedup_needed({"link": 2.0, "rest": 30.0}, ddp, 0.5) == ("any", None)
    # the method's own link dominates: 70 + 20/f <= 50 + 60/f only for f <= 40/20 = 2
    assert ts.speedup_needed({"link": 70.0, "rest": 20.0}, ddp, 0.5) == ("up to", 2.0)
    assert ts.speedup_needed({"link": 70.0, "rest": 60.0}, ddp, 0.5) == ("never", None)  # 70 + 60/f <= 50 + 60/f
    history = [{"step": 10, "test_accuracy": 0.8, "global_wire_bytes": 1000, "wall_seconds": 10.0}]
    report = {"workload": {"metric": "accuracy"}, "ddp_target": 0.9, "net": {"rate_bytes_per_s": 1000.0},
              "methods": [{"method": "ddp", "status": "complete", "history": history}]}
    with pytest.raises(ValueError, match="never reach its final metric"):
        ts.split(report, 0.5)


def test_comm_bound_summary_of_a_stored_report():
    """benchmarks/comm_bound.py's arithmetic on the stored 20 Mbit/s report: the common level is the worst final
    metric of the methods that communicate, DDP's link share is its wall less none's over its wall."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("comm_bound", os.path.join(root, "benchmarks", "comm_bound.py"))
    cb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cb)
    with open(os.path.join(root, "docs", "results", "comm-bound-fashion-cnn", "s0", "report.json")) as f:
        report = json.load(f)
    s = cb.summarise(report)
    runs = {m["method"]: m for m in report["methods"]}
    assert s["common_target"] == min(m["metric"] for name, m in runs.items() if name != "none")
    ddp, none = runs["ddp"], runs["none"]
    ddp_t, none_t = ddp["history"][-1]["wall_seconds"], none["history"][-1]["wall_seconds"]  # no eval_seconds yet
    assert s["ddp_link_share_measured"] == pytest.approx((ddp_t - none_t) / ddp_t)
    assert s["ddp_link_share_predicted"] == pytest.approx(s["ddp_link_seconds_predicted"]
                                                          / (s["ddp_link_seconds_predicted"] + none_t))
    assert s["ddp_link_seconds_predicted"] == pytest.approx(ddp["global_wire_bytes"] * 8 / 20e6)
    rows = {r["method"]: r for r in s["rows"]}
    assert rows["ddp"]["to_ddp_ratio"] == 1.0 and rows["ab"]["to_ddp"] is None  # AB ends below DDP's final accuracy
    assert all(r["to_common"] is not None for name, r in rows.items() if name != "none")
