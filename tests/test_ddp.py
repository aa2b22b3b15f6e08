"""DDP on real gloo worlds: identical workers, exact byte counts, reproducibility."""

import json
import os
import tempfile

import pytest
import torch

from abtrain.comm.topology import Topology
from abtrain.config import TrainConfig
from abtrain.run.train import Trainer
from helpers import run_world


def _train_all(cfg_dicts, run_dir):
    """Train each config in turn in this world (one spawn for several runs)."""
    topo = Topology.from_env(backend="gloo", device="cpu", group_size=TrainConfig.from_dict(cfg_dicts[0]).group_size)
    outs = [_train(topo, cfg_dict, os.path.join(run_dir, str(i))) for i, cfg_dict in enumerate(cfg_dicts)]
    topo.close()
    return outs


def _train(topo, cfg_dict, run_dir):
    cfg = TrainConfig.from_dict(cfg_dict)
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg, topo, run_dir)
    results = trainer.run()
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    out = {"state": state, "summary": trainer.ledger.summary(), "results": results,
           "params": trainer.params, "steps": trainer.step, "evals": len(trainer.history),
           "float_buffers": sum(b.numel() for b in trainer.model.buffers() if b.is_floating_point()),
           "other_buffers_bytes": sum(b.numel() * b.element_size() for b in trainer.model.buffers()
                                      if not b.is_floating_point())}
    return out


def _cfg(fashion_dir, **kw):
    base = dict(method="ddp", model="cnn", dataset="fashion-mnist", data_dir=str(fashion_dir), steps=6,
                batch_size=16, eval_every=3, limit_test=64, log_every=100, lr=0.05, seed=3)
    base.update(kw)
    return base


def _resnet(fashion_dir):
    return _cfg(fashion_dir, model="resnet", steps=4)


@pytest.fixture(scope="module")
def two_workers(fashion_dir):
    """One world of 2: the CNN of the byte checks, then the ResNet of the reproducibility check."""
    with tempfile.TemporaryDirectory() as run_dir:
        return run_world(_train_all, 2, [_cfg(fashion_dir), _resnet(fashion_dir)], run_dir)


@pytest.mark.parametrize("world", [2, 4])
def test_workers_identical_and_bytes_exact(fashion_dir, two_workers, world):
    if world == 2:
        outs = [o[0] for o in two_workers]
    else:
        with tempfile.TemporaryDirectory() as run_dir:
            outs = [o[0] for o in run_world(_train_all, world, [_cfg(fashion_dir, group_size=2)], run_dir)]
    ref = outs[0]["state"]
    for o in outs[1:]:
        assert o["state"].keys() == ref.keys()
        for k in ref:
            assert torch.equal(o["state"][k], ref[k]), f"{k} differs between workers"
    o = outs[0]
    s = o["summary"]
    P, steps = o["params"], o["steps"]
    # Gradients: exactly one fp32 copy of every parameter per step, nothing else in the train phase.
    assert s["by_phase"]["train"]["payload_bytes"] == 4 * P * steps
    assert s["by_phase"]["train"]["wire_bytes"] == pytest.approx(2 * (world - 1) / world * 4 * P * steps)
    # every step sends the same: the peak of one step is one step's global all-reduce (none where the world is
    # one group of workers)
    train = s["by_phase"]["train"]["wire_bytes"] / steps if world == 4 else 0.0
    assert s["peak_global_step_bytes"] == pytest.approx(train)
    # Start: the workers built the same model from the seed, which one all-reduce of a 32-byte digest confirms
    # (4 int64: no broadcast of the model).
    assert s["by_phase"]["setup"]["payload_bytes"] == 32 and s["by_phase"]["setup"]["calls"] == 1
    # Each evaluation: BatchNorm statistics averaged, 7 float64 totals (metrics and bytes so far);
    # at the end each worker's peak RSS and the length of its record (2 float64), then the
    # record (training state by phase and part, multiply-adds by phase) as JSON, padded to the longest; then
    # the results' averaging: an all-gather of 5 totals (payload, wire, global wire, peak step, the end's), a key check (2 int64) and the sums of 5 figures per
    # ledger row (recorded after the snapshot it averages).
    r = o["results"]
    width = max(len(json.dumps({"state": state, "multiply_adds": macs}).encode())
                for state, macs in zip(r["training_state_by_worker"], r["multiply_adds_by_worker"]))
    evals = o["evals"] * (4 * o["float_buffers"] + 7 * 8) + 2 * 8 + width
    assert r["comm"]["by_phase"]["eval"]["payload_bytes"] == evals
    rows = len(r["comm"]["rows"])
    assert s["by_phase"]["eval"]["payload_bytes"] == evals + 5 * 8 + 2 * 8 + 5 * 8 * rows
    assert s["payload_bytes"] == sum(v["payload_bytes"] for v in s["by_phase"].values())
    assert r["comm"]["averaged_over_workers"] and len(r["comm"]["per_worker"]) == world
    assert all(w["wire_bytes"] == pytest.approx(r["comm"]["wire_bytes"]) for w in r["comm"]["per_worker"])
    scope = "global" if world == 4 else "group"  # 4 workers in groups of 2 cross groups; 2 in one group do not
    assert s["by_scope"][scope]["wire_bytes"] == pytest.approx(s["wire_bytes"])
    for key in ("payload_bytes", "wire_bytes", "calls"):  # seconds are each worker's own
        assert r["comm"]["by_phase"]["train"][key] == s["by_phase"]["train"][key]
    # results.json's DDP reference (what other methods' summaries compare with) is this train phase, exactly.
    assert r["ddp_equivalent"]["wire_bytes"] == pytest.approx(s["by_phase"]["train"]["wire_bytes"])
    assert r["ddp_equivalent"]["global_wire_bytes"] == pytest.approx(s["by_phase"]["train"]["wire_bytes"]
                                                                     if scope == "global" else 0.0)
    assert len(r["history"]) == o["evals"] == 2
    assert all(out["results"] is None for out in outs[1:])


def test_same_seed_same_weights(fashion_dir, two_workers):
    # a second world (new processes: nothing carried over in memory) against the first one's run
    with tempfile.TemporaryDirectory() as run_dir:
        again = run_world(_train_all, 2, [_resnet(fashion_dir)], run_dir)[0][0]["state"]
    finals = [two_workers[0][1]["state"], again]
    for k in finals[0]:
        assert torch.equal(finals[0][k], finals[1][k]), k
