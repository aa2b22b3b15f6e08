"""Baselines (ddp-bf16, powersgd, localsgd, diloco, none): equivalences, exact byte counts, one model at the end.

One spawned gloo world of 2 workers trains every configuration in turn (a
Trainer per run, sharing the process group), so the file stays fast.
"""

import dataclasses
import json
import os
import tempfile

import pytest
import torch

from abtrain.cli import build_parser, config_from_args
from abtrain.comm.communicator import Communicator
from abtrain.comm.topology import Topology
from abtrain.config import TrainConfig, read_config_file
from abtrain.methods import build_method, registry
from abtrain.methods.diloco import DiLoCoConfig
from abtrain.methods.localsgd import LocalSGDConfig
from abtrain.methods.powersgd import PowerSGDConfig
from helpers import run_world

STEPS = 6
PLAIN_SGD = dict(momentum=0.0, weight_decay=0.0)


def _cfg(fashion_dir, method, **kw):
    base = dict(method=method, model="mlp", dataset="fashion-mnist", data_dir=str(fashion_dir), steps=STEPS,
                batch_size=16, eval_every=100, limit_test=64, log_every=100, lr=0.05, seed=5)
    base.update(kw)
    return base


def _torch_powersgd_method():
    """PowerSGD with torch's own, uncounted powerSGD_hook: the numerical reference for ours."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from abtrain.methods.base import Method
    from abtrain.methods.ddp import _no_buffer_broadcast
    from abtrain.methods.powersgd import PowerSGD

    class TorchPowerSGD(PowerSGD):
        def prepare(self, model):
            model = Method.prepare(self, model)
            cfg = self.cfg
            self.state = PowerSGDState(process_group=self.topo.world.pg, matrix_approximation_rank=cfg.rank,
                                       start_powerSGD_iter=cfg.warmup_steps, min_compression_rate=cfg.min_compression_rate,
                                       orthogonalization_epsilon=cfg.orthogonalization_epsilon, random_seed=cfg.seed)
            ddp = DistributedDataParallel(model, init_sync=False, process_group=self.topo.world.pg,
                                          bucket_cap_mb=self.bucket_cap_mb, **_no_buffer_broadcast)
            ddp.register_comm_hook(self.state, powerSGD_hook)
            self.ddp = ddp  # the method's own DDP: the one allowed to call the prepared module
            return ddp

        def extra_results(self):
            rate, before, after = self.state.compression_stats()
            return {"powersgd": {"compression_rate": rate, "numel_before_compression": before,
                                 "numel_after_compression": after}}

    return TorchPowerSGD


def _run_all(runs, run_dir):
    from abtrain.run.train import Trainer

    topo = Topology.from_env(backend="gloo", device="cpu")
    out = {}
    for name, cfg_dict in runs.items():
        cfg = TrainConfig.from_dict(cfg_dict)
        original = registry.get("powersgd")
        if name == "torch-powersgd":
            registry.register(dataclasses.replace(original, build=_torch_powersgd_method()))
        try:
            os.makedirs(os.path.join(run_dir, name), exist_ok=True)
            trainer = Trainer(cfg, topo, os.path.join(run_dir, name))
            results = trainer.run()
        finally:
            registry.register(original)
        method = trainer.method
        out[name] = {
            "state": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "summary": trainer.ledger.summary(),
            "params": trainer.params,
            "evals": len(trainer.history),
            "results": results,  # rank 0's; None on the others
            "extra": method.extra_results(),
            "stats": tuple(method.extra_results()["powersgd"][k] for k in
                           ("compression_rate", "numel_before_compression", "numel_after_compression"))
            if name.endswith("powersgd") else None,
        }
    topo.close()
    return out


@pytest.fixture(scope="module")
def runs(fashion_dir):
    configs = {
        "ddp": _cfg(fashion_dir, "ddp", **PLAIN_SGD),
        "localsgd-h1": _cfg(fashion_dir, "localsgd", localsgd={"sync_every": 1}, **PLAIN_SGD),
        "diloco-h1": _cfg(fashion_dir, "diloco", diloco={"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
                          **PLAIN_SGD),
        "powersgd": _cfg(fashion_dir, "powersgd", powersgd={"rank": 2, "warmup_steps": 2}),
        "torch-powersgd": _cfg(fashion_dir, "powersgd", powersgd={"rank": 2, "warmup_steps": 2}),
        "ddp-bf16": _cfg(fashion_dir, "ddp-bf16"),
        "none": _cfg(fashion_dir, "none"),
        # BatchNorm buffers, momentum, and a last partial period that finalize must close.
        "localsgd-h4": _cfg(fashion_dir, "localsgd", model="cnn", localsgd={"sync_every": 4}),
        "diloco-h4": _cfg(fashion_dir, "diloco", model="cnn", optimizer="adamw", lr=1e-3, momentum=0.9,
                          diloco={"sync_every": 4}),
    }
    with tempfile.TemporaryDirectory() as run_dir:
        return run_world(_run_all, 2, configs, run_dir)


def _max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("name", ["localsgd-h1", "diloco-h1"])
def test_h1_with_plain_sgd_equals_ddp(runs, name):
    assert _max_diff(runs[0][name]["state"], runs[0]["ddp"]["state"]) < 1e-6


@pytest.mark.parametrize("name", ["ddp-bf16", "powersgd", "localsgd-h1", "diloco-h1", "localsgd-h4", "diloco-h4"])
def test_one_model_after_finalize(runs, name):
    a, b = runs[0][name]["state"], runs[1][name]["state"]
    for k in a:
        assert torch.equal(a[k], b[k]), f"{name}: {k} differs between workers"


def _state_json_width(results):
    """Bytes of the longest worker's record (training state and multiply-adds by phase) as JSON: what the end of
    a run gathers."""
    return max(len(json.dumps({"state": state, "multiply_adds": macs}).encode())
               for state, macs in zip(results["training_state_by_worker"], results["multiply_adds_by_worker"]))


def test_none_never_communicates_while_training(runs):
    s = runs[0]["none"]["summary"]
    assert set(s["by_phase"]) == {"setup", "eval"}
    # No buffer averaging at evaluation either: 7 float64 totals per evaluation; at the end each worker's
    # peak RSS and the length of its record (2 float64), then the record as JSON (padded to
    # the longest); then the results' averaging over workers: an all-gather of 5 totals, a
    # 2-int64 key check and 5 numbers per ledger row of the snapshot it averages (the one in results.json).
    rows_before = len(runs[0]["none"]["results"]["comm"]["rows"])
    assert s["by_phase"]["eval"]["payload_bytes"] == (runs[0]["none"]["evals"] * 7 * 8 + 2 * 8
                                                      + _state_json_width(runs[0]["none"]["results"])
                                                      + 5 * 8 + 2 * 8 + 5 * 8 * rows_before)
    assert _max_diff(runs[0]["none"]["state"], runs[1]["none"]["state"]) > 0  # the workers drifted apart


def test_ddp_bf16_sends_two_bytes_per_gradient(runs):
    o = runs[0]["ddp-bf16"]
    rows = [r for r in o["summary"]["rows"] if r["phase"] == "train"]
    assert {r["dtype"] for r in rows} == {"bfloat16"}
    assert sum(r["payload_bytes"] for r in rows) == 2 * o["params"] * STEPS
    assert _max_diff(o["state"], runs[0]["ddp"]["state"]) < 0.05  # momentum differs from ddp's run; same scale


def test_powersgd_counts_equal_the_hook_statistics(runs):
    o = runs[0]["powersgd"]
    by_phase = o["summary"]["by_phase"]
    _, before, after = o["stats"]
    start = 2
    assert before == o["params"] * (STEPS - start)  # every gradient element seen once per compressed step
    assert by_phase["train"]["payload_bytes"] == 4 * after  # uncompressed tensors + every P and Q
    assert by_phase["warmup"]["payload_bytes"] == 4 * o["params"] * start
    assert after < before / 2
    assert o["extra"]["powersgd"]["numel_after_compression"] == after
    ddp_train = runs[0]["ddp"]["summary"]["by_phase"]["train"]["payload_bytes"]
    assert by_phase["train"]["payload_bytes"] + by_phase["warmup"]["payload_bytes"] < ddp_train


def test_powersgd_computes_what_torchs_hook_computes(runs):
    assert runs[0]["torch-powersgd"]["stats"] == runs[0]["powersgd"]["stats"]
    assert _max_diff(runs[0]["powersgd"]["state"], runs[0]["torch-powersgd"]["state"]) == 0  # the same bits


def test_phases_and_sync_counts(runs):
    s = runs[0]["localsgd-h4"]["summary"]
    assert set(s["by_phase"]) == {"setup", "average", "eval"}
    assert s["by_phase"]["average"]["calls"] == 2  # step 4, then finalize at step 6
    assert runs[0]["localsgd-h4"]["extra"]["localsgd"]["syncs"] == 2
    s = runs[0]["diloco-h4"]["summary"]
    assert set(s["by_phase"]) == {"setup", "outer", "eval"}
    assert s["by_phase"]["outer"]["calls"] == 2
    assert runs[0]["diloco-h4"]["extra"]["diloco"]["syncs"] == 2


@pytest.mark.parametrize("name", ["ddp-bf16", "powersgd", "localsgd", "diloco", "none", "ef21", "onebit", "hlocalsgd"])
def test_single_process_is_the_same_code(name):
    """A world of one: no process group, nothing counted, training still runs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    comm = Communicator()
    method = build_method(name, comm, Topology())
    forward = method.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with method.attach(opt):
        for _ in range(5):
            loss = torch.nn.functional.cross_entropy(forward(torch.randn(4, 8)), torch.randint(0, 3, (4,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert method.in_consensus()
    assert comm.ledger.rows == {}


def test_options_from_flags_and_config_file(tmp_path):
    path = tmp_path / "run.toml"
    # A table per method, or the flag's name as a top-level key.
    path.write_text('method = "diloco"\npowersgd-rank = 1\n[diloco]\nsync-every = 7\nouter-lr = 0.5\n[localsgd]\nsync-every = 3\n')
    ns = build_parser().parse_args(["train", "--config", str(path), "--diloco-outer-momentum", "0.5",
                                    "--powersgd-warmup-steps", "5"])
    cfg = config_from_args(ns)
    assert cfg.diloco == DiLoCoConfig(sync_every=7, outer_lr=0.5, outer_momentum=0.5)
    assert cfg.localsgd == LocalSGDConfig(sync_every=3)
    assert cfg.powersgd == PowerSGDConfig(rank=1, warmup_steps=5)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert read_config_file(str(path))["diloco"] == {"sync_every": 7, "outer_lr": 0.5}


@pytest.mark.parametrize("args, message", [
    (["--localsgd-sync-every", "0"], "--localsgd-sync-every must be a positive integer"),
    (["--diloco-outer-momentum", "1"], "--diloco-outer-momentum must be in [0, 1)"),
    (["--powersgd-warmup-steps", "1"], "--powersgd-warmup-steps must be an integer >= 2"),
])
def test_bad_options_say_how_to_fix_them(args, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        config_from_args(build_parser().parse_args(["train", *args]))
