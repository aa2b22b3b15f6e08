"""benchmarks/ab_front.py (every configuration against its table's DDP, the Pareto front) on hand-made tables, and
benchmarks/lowrank_ceiling.py (jointly trained factors) on a small model and the tiny workload."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(__file__))
FRONT = os.path.join(ROOT, "benchmarks", "ab_front.py")
CEILING = os.path.join(ROOT, "benchmarks", "lowrank_ceiling.py")


def _module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(config, flags, per_seed, compression, global_bytes):
    return {"config": config, "flags": flags, "seeds": [0, 1], "test_accuracy_per_seed": per_seed,
            "compression_ratio": compression, "global_wire_bytes": [global_bytes, 0.0]}


def _table(path, rows, workload="cnn on Fashion-MNIST, 4 workers in groups of 2, 3 epochs, SGD lr 0.05"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": "benchmarks/ab_configs.py", "workload": workload,
                                "metric": "test_accuracy", "rows": rows}))


def test_each_point_is_measured_against_its_own_tables_ddp_and_the_front_keeps_the_undominated(tmp_path):
    # two tables whose DDP differ: a point is read against its own table's DDP
    _table(tmp_path / "a" / "one.json", [
        _row("ddp", "--method ddp", [0.92, 0.90], None, 1000.0),
        _row("dense", "--method ab", [0.90, 0.90], [1.0, 1.0], 20.0),       # -1.0, 1:1, 2 %
        _row("small", "--method ab --ab-rank 8", [0.89, 0.89], [4.0, 4.0], 20.0),  # -2.0, 4:1, 2 %
        _row("worse", "--method ab --ab-rank 16", [0.88, 0.88], [2.0, 2.0], 40.0),  # dominated by small
    ])
    _table(tmp_path / "b" / "two.json", [
        _row("ddp", "--method ddp", [0.80, 0.80], None, 500.0),
        _row("dense", "--method ab", [0.90, 0.90], [1.0, 1.0], 20.0),  # the same flags, seeds and value: once
        _row("cheap", "--method ab --x", [0.795, 0.795], [1.0, 1.0], 5.0),  # -0.5, 1:1, 1 %
    ])
    _table(tmp_path / "c" / "no-ddp.json", [_row("alone", "--method ab --y", [0.99, 0.99], [9.0, 9.0], 1.0)])
    _table(tmp_path / "d" / "other.json", [_row("ddp", "--method ddp", [0.5, 0.5], None, 1.0),
                                           _row("elsewhere", "--method ab", [0.9, 0.9], [5.0, 5.0], 1.0)],
           workload="cnn on Fashion-MNIST, 8 workers in groups of 4")
    front = _module(FRONT, "ab_front")
    pts = front.points(str(tmp_path))
    assert not pts["fashion-wide"] and not pts["shakespeare-gpt"]
    got = {p["config"]: p for p in pts["fashion-cnn"]}
    assert sorted(got) == ["cheap", "dense", "small", "worse"]  # no DDP, another layout: not read
    assert got["dense"]["vs_ddp"] == pytest.approx(-1.0) and got["dense"]["global_share"] == pytest.approx(0.02)
    assert got["cheap"]["vs_ddp"] == pytest.approx(-0.5) and got["cheap"]["global_share"] == pytest.approx(0.01)
    assert got["small"]["compression"] == pytest.approx(4.0)
    assert sorted(p["config"] for p in front.front(pts["fashion-cnn"])) == ["cheap", "small"]

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, FRONT, "--results", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "ab_front.json").read_text())
    cnn = data["workloads"]["fashion-cnn"]
    assert sorted(cnn["points"][i]["config"] for i in cnn["front"]) == ["cheap", "small"]
    empty = subprocess.run([sys.executable, FRONT, "--results", str(tmp_path / "c"), "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "no ab_configs table with a ddp row" in empty.stderr


def test_the_ceiling_factorises_what_ab_training_does_and_trains_both_factors():
    ceiling = _module(CEILING, "lowrank_ceiling")
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("stem", torch.nn.Linear(10, 64))
    model.add_module("hidden", torch.nn.Linear(64, 64))
    model.add_module("head", torch.nn.Linear(64, 3))
    w = model.hidden.weight.detach().clone()
    records = ceiling.factorise(model, 100)
    assert [(fp.name, fp.rank) for fp in records] == [("hidden.weight", 31)]  # capped where factors pay: 31·128 < 64·64
    fp = records[0]
    assert fp.A.requires_grad and fp.B.requires_grad and not fp.weight.requires_grad
    u, s, vh = torch.linalg.svd(w)
    assert torch.allclose(fp.A @ fp.B, (u[:, :31] * s[:31]) @ vh[:31], atol=1e-5)  # W's best rank-31 approximation
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trained == 10 * 64 + 64 + 31 * 128 + 64 + 64 * 3 + 3


def test_the_ceiling_script_trains_the_tiny_workload_and_writes_its_table(tmp_path):
    proc = subprocess.run([sys.executable, CEILING, "--workload", "tiny", "--ranks", "0,4", "--seeds", "0",
                           "--threads", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "lowrank_ceiling.json").read_text())
    dense, low = data["rows"]
    assert dense["rank"] == 0 and dense["compression"] == 1.0 and dense["layers"] == []
    assert low["layers"] == ["hidden.weight 256x256: rank 4"] and low["compression"] > 1.0
    assert [r["batch"] for r in data["runs"]] == [32, 32] and [r["steps"] for r in data["runs"]] == [8, 8]
    bad = subprocess.run([sys.executable, CEILING, "--workload", "tiny", "--batch-share", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--batch-share must be in (0, 1]" in bad.stderr
