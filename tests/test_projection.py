"""benchmarks/projection.py: time to DDP's metric at real sizes from a hand-made report, checked against the
α-β formula by hand; and the stored reports giving a table that names a method for every cell."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))
SCRIPT = os.path.join(ROOT, "benchmarks", "projection.py")


def _module():
    spec = importlib.util.spec_from_file_location("projection", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(history, payload, calls=100, op="all_reduce", scope="global", group_size=4):
    return {"seed": 0, "steps": 100, "steps_per_epoch": 100, "params": 1000, "world_size": 4, "history": history,
            "comm_rows": [{"op": op, "scope": scope, "phase": "train", "group_size": group_size, "calls": calls,
                           "payload_bytes": payload * calls, "wire_bytes": 1.5 * payload * calls}]}


def _report(tmp_path):
    report = {"command": "benchmarks/ab_configs.py --workload fashion-cnn", "metric": "test_accuracy", "rows": [
        {"config": "ddp", "runs": [_run([[50, 0.80], [100, 0.90]], payload=4000)]},
        # reaches DDP's 0.90 at step 50 with 1/100 of the bytes
        {"config": "fast", "runs": [_run([[50, 0.90], [100, 0.91]], payload=40)]},
        # never reaches 0.90, reaches 0.90 - 0.005 (loose) at step 100
        {"config": "close", "runs": [_run([[50, 0.70], [100, 0.896]], payload=40)]},
    ]}
    path = tmp_path / "ab_configs.json"
    path.write_text(json.dumps(report))
    cost = {"device": "cpu", "date": "today", "rows": [
        {"model": "resnet50", "variant": "none", "amortised_step_seconds": 1.0},
        {"model": "resnet50", "variant": "fast", "amortised_step_seconds": 1.25}]}
    cost_path = tmp_path / "cost.json"
    cost_path.write_text(json.dumps(cost))
    return report, cost, str(path), str(cost_path)


def test_time_to_target_follows_the_formula(tmp_path):
    m = _module()
    report, cost, _, _ = _report(tmp_path)
    args = type("A", (), {"tolerance": 0.5, "compute_ms": {"fashion-cnn": 20.0}, "intra_bw": 150e9,
                          "node_size": 8})()
    p = m.project(report, [cost], [16], args)
    assert p["fractions"]["ddp"] == {"strict": 1.0, "loose": 1.0}
    assert p["fractions"]["fast"] == {"strict": 0.5, "loose": 0.5}
    assert p["fractions"]["close"] == {"strict": None, "loose": 1.0}
    assert p["compute_factors"]["fast"] == {"factor": 1.25, "measured": True}
    assert p["compute_factors"]["close"] == {"factor": 1.0, "measured": False}
    cell = next(c for c in p["grid"] if c["network"] == "10 Gb/s Ethernet")
    # DDP: one all-reduce per step of 4000 B × 25.6e6 / 1000 scaled, over 16 workers between nodes (2 nodes of 8:
    # a global collective of the bench's 4 workers spans all 16): 2(p-1) α + 2(p-1)/p n / β
    n = 4000 * 25.6e6 / 1000
    ddp_comm = 2 * 15 * 10e-6 + 2 * 15 / 16 * n / (10e9 / 8)
    assert cell["step_seconds"]["ddp"]["comm"] == pytest.approx(ddp_comm, rel=1e-9)
    assert cell["step_seconds"]["ddp"]["compute"] == pytest.approx(0.020)
    fast = 0.5 * (0.020 * 1.25 + 2 * 15 * 10e-6 + 2 * 15 / 16 * n / 100 / (10e9 / 8))
    assert cell["strict"]["fast"] == pytest.approx(fast / (0.020 + ddp_comm), rel=1e-9)
    assert cell["strict"]["close"] is None and cell["loose"]["close"] is not None
    lines = m.render(p, [16], 0.5, False)
    assert any(line.startswith("| 10 Gb/s Ethernet | fast 0.") for line in lines)


def test_the_script_writes_its_table_and_json(tmp_path):
    _, _, peers, cost = _report(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, SCRIPT, "--peers", peers, "--cost", cost, "--workers", "8,64",
                           "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "projection.json").read_text())
    assert data["workers"] == [8, 64] and data["models"][0]["model"] == "ResNet-50"
    assert "| 200 Gb/s InfiniBand |" in (out / "projection.md").read_text()
    bad = subprocess.run([sys.executable, SCRIPT, "--peers", peers, "--cost", cost, "--workers", "1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--workers must be 2 or more" in bad.stderr
