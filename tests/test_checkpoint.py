"""Checkpoints: a stopped and resumed run equals the uninterrupted one; what is saved, what is refused."""

import dataclasses
import json
import os
import pickle

import pytest
import torch

import abtrain
from abtrain.comm.topology import Topology
from abtrain.config import TrainConfig
from abtrain.methods.ab import ABConfig
from abtrain.run import checkpoint as ckpt
from abtrain.run.train import Trainer
from helpers import run_world

# AB schedule: warm-up steps 0-1, AB 2-6, rebound 7-8, AB 9-11, rebound 12-13, AB 14-15.
AB = dict(warmup_steps=2, sync_every=5, rebound_steps=2, lr_rebound_steps=3, rank_fraction=0.25)
# ab: stop inside an AB phase (groups differ), and inside a rebound; ab-tangent: inside an AB phase, where the
# next sync needs the SVD the factors started from; ab-lowrank: between two syncs, whose second sends what the
# first left in each worker's error memory; ab-update: the same with no rebound and updated SVDs, stopped between
# the syncs at 5 and 10, whose decompositions update the SVD from the parts the sync leaves
STOPS = {"ddp": [5], "ab": [4, 8], "ab-tangent": [4], "ab-lowrank": [8], "ab-update": [8]}


def _cfg(fashion_dir, method, **kw):
    base = dict(method=method, model="mlp", dataset="fashion-mnist", data_dir=str(fashion_dir), steps=16,
                batch_size=16, eval_every=3, limit_test=64, log_every=100, lr=0.05, seed=5, checkpoint_every=3)
    if method == "ab":
        base.update(group_size=1, ab=ABConfig(**AB))
    if method == "ab-tangent":
        base.update(method="ab", group_size=1, ab=ABConfig(**AB, split="tangent", sync="only-learned"))
    if method == "ab-lowrank":
        base.update(method="ab", group_size=1, ab=ABConfig(**AB, split="tangent", sync="only-learned",
                                                           sync_payload="lowrank", sync_rank=2, svd="full"))
    if method == "ab-update":
        base.update(method="ab", group_size=1, ab=ABConfig(**{**AB, "rebound_steps": 0}, split="tangent",
                                                           sync="only-learned", sync_payload="lowrank", sync_rank=2,
                                                           svd="update"))
    base.update(kw)
    return TrainConfig(**base)


def _final(trainer):
    return {"state": {k: v.clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)},
            "history": [{k: v for k, v in row.items() if k not in ("wall_seconds", "eval_seconds")}  # not timings
                        for row in trainer.history],
            "ledger": [[key, {k: v for k, v in row.items() if k != "seconds"}]  # bytes and calls, not timings
                       for key, row in trainer.ledger.state_dict()["rows"]],
            "step": trainer.step,
            "svd_counts": trainer.method.state.svd_counts if trainer.method.name == "ab" else None}


def _sequences(fashion_dir, root):
    """In one world of 2: per method, the uninterrupted run, then each stop followed by a resume."""
    out = {}
    for method, stops in STOPS.items():
        cfg = _cfg(fashion_dir, method)
        topo = Topology.from_env(backend="gloo", device="cpu", group_size=cfg.group_size)
        ref = Trainer(cfg, topo, os.path.join(root, f"{method}-ref"))
        ref.run()
        out[method] = {"ref": _final(ref), "resumed": {}}
        for stop in stops:
            run_dir = os.path.join(root, f"{method}-{stop}")
            first = Trainer(_cfg(fashion_dir, method, stop_after=stop), topo, run_dir)
            assert first.run() is None
            shard = torch.load(os.path.join(ckpt.step_dir(run_dir, stop), f"rank{topo.rank}.pt"), weights_only=True)
            second = Trainer(cfg, topo, run_dir, resume=True)
            assert second.step == stop
            second.run()
            out[method]["resumed"][stop] = {**_final(second), "phase_at_stop": shard["method"].get("t"),
                                            "shard_model": shard["model"]}
    return out


def test_stopped_and_resumed_runs_equal_the_uninterrupted_run(fashion_dir, tmp_path):
    outs = run_world(_sequences, 2, fashion_dir, str(tmp_path))
    for rank_out in outs:
        for method, result in rank_out.items():
            ref = result["ref"]
            for stop, resumed in result["resumed"].items():
                assert resumed["step"] == ref["step"] == 16
                for key, value in ref["state"].items():
                    assert torch.equal(resumed["state"][key], value), f"{method} stop {stop}: {key} differs"
                assert resumed["history"] == ref["history"], f"{method} stop {stop}: evaluations differ"
                assert resumed["ledger"] == ref["ledger"], f"{method} stop {stop}: communication totals differ"
                assert resumed["svd_counts"] == ref["svd_counts"], f"{method} stop {stop}: SVD counts differ"
        # hidden.weight at steps 5, 10 and 15 (the first decomposition, capped where its factors pay, is below
        # full rank, so the SVD after the first sync is updated too)
        assert rank_out["ab-update"]["ref"]["svd_counts"]["updated"] == 3
    # Inside the AB phase (stop 4) the two workers' shards hold different factors: each saved its own.
    a0, a1 = (o["ab"]["resumed"][4]["shard_model"] for o in outs)
    factors = [k for k in a0 if k.endswith(".A") and a0[k].numel()]
    assert factors and any(not torch.equal(a0[k], a1[k]) for k in factors)
    assert outs[0]["ab"]["resumed"][4]["phase_at_stop"] == 4


# -- single process: layout, atomicity, refusals -------------------------------------------------
def _single(tmp_path, **kw):
    cfg = TrainConfig(method="ddp", model="mlp", dataset="synthetic", steps=10, batch_size=32, log_every=100,
                      eval_every=5, **kw)
    return cfg, str(tmp_path / "run")


def test_checkpoint_layout_and_contents(tmp_path):
    cfg, run_dir = _single(tmp_path, checkpoint_every=3)
    Trainer(cfg, Topology(), run_dir).run()
    root = ckpt.checkpoint_root(run_dir)
    manifest = json.loads(open(os.path.join(root, "latest.json")).read())
    assert manifest["step"] == 10 and manifest["world_size"] == 1 and manifest["method"] == "ddp"
    # Older checkpoints are gone once a newer one is complete; no temporary files are left.
    assert sorted(os.listdir(root)) == ["latest.json", "step-00000010"]
    assert os.listdir(os.path.join(root, "step-00000010")) == ["rank0.pt"]
    state = ckpt.load_shard(os.path.join(root, "step-00000010", "rank0.pt"))
    assert set(state) >= {"model", "optimizer", "scheduler", "method", "ledger", "rng", "data", "history",
                          "wall_seconds"}
    assert state["rng"]["torch"].dtype == torch.uint8
    assert state["data"] == {"epoch": 0, "batch": 10}
    final = torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)
    assert torch.equal(final["stem.weight"], torch.load(os.path.join(root, "step-00000010", "rank0.pt"),
                                                        weights_only=True)["model"]["stem.weight"])


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    cfg, run_dir = _single(tmp_path, checkpoint_every=3, stop_after=6)
    trainer = Trainer(cfg, Topology(), run_dir)
    trainer.run()
    with torch.no_grad():
        trainer.model.stem.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"stem.weight holds inf or nan.*last good checkpoint, of step 6"):
        trainer.save_checkpoint()
    assert ckpt.read_manifest(run_dir)["step"] == 6
    resumed = Trainer(dataclasses.replace(cfg, stop_after=None), Topology(), run_dir, resume=True)
    assert resumed.step == 6 and bool(torch.isfinite(resumed.model.stem.weight).all())


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    cfg, run_dir = _single(tmp_path, stop_after=4)
    Trainer(cfg, Topology(), run_dir).run()
    marker = tmp_path / "pwned"
    shard = os.path.join(ckpt.step_dir(run_dir, 4), "rank0.pt")
    with open(shard, "wb") as fh:
        pickle.dump({"format": ckpt.FORMAT, "payload": _Payload(str(marker))}, fh)
    manifest_path = os.path.join(ckpt.checkpoint_root(run_dir), "latest.json")
    manifest = json.loads(open(manifest_path).read())
    manifest["files"]["rank0.pt"] = os.path.getsize(shard)
    manifest["sha256"]["rank0.pt"] = ckpt.sha256_file(shard)  # a forger who rewrites the manifest too
    open(manifest_path, "w").write(json.dumps(manifest))
    with pytest.raises(ValueError, match="safe load refuses"):
        Trainer(dataclasses.replace(cfg, stop_after=None), Topology(), run_dir, resume=True)
    assert not marker.exists()


def test_truncated_and_foreign_checkpoints_are_refused(tmp_path):
    cfg, run_dir = _single(tmp_path, stop_after=4)
    Trainer(cfg, Topology(), run_dir).run()
    plain = dataclasses.replace(cfg, stop_after=None)
    with pytest.raises(ValueError, match="written for method 'ddp', this run has 'localsgd'"):
        Trainer(dataclasses.replace(plain, method="localsgd"), Topology(), run_dir, resume=True)
    shard = os.path.join(ckpt.step_dir(run_dir, 4), "rank0.pt")
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        Trainer(plain, Topology(), run_dir, resume=True)
    # Same size, changed bytes: the manifest's checksum refuses it, in one line.
    open(shard, "wb").write(data[: len(data) // 2] + b"\0" * (len(data) - len(data) // 2))
    with pytest.raises(ValueError, match="is corrupt: its sha256 differs") as err:
        Trainer(plain, Topology(), run_dir, resume=True)
    assert "\n" not in str(err.value)


def test_a_checkpoint_of_another_format_is_refused_naming_the_abtrain_that_wrote_it(tmp_path):
    """A checkpoint carries its format version and the abtrain that wrote it; any other version than this
    abtrain's is refused in one line, older or newer, before a shard is read."""
    cfg, run_dir = _single(tmp_path, stop_after=4)
    Trainer(cfg, Topology(), run_dir).run()
    path = os.path.join(ckpt.checkpoint_root(run_dir), ckpt.MANIFEST)
    manifest = json.loads(open(path).read())
    assert manifest["version"] == ckpt.VERSION and manifest["abtrain"] == abtrain.__version__
    assert ckpt.read_manifest(run_dir)["step"] == 4
    older = {k: v for k, v in manifest.items() if k != "abtrain"}  # written before checkpoints named their abtrain
    for written, writer in (({**older, "version": ckpt.VERSION - 1}, "an earlier one"),
                            ({**manifest, "version": ckpt.VERSION + 1, "abtrain": "9.9.9"}, "9.9.9")):
        open(path, "w").write(json.dumps(written))
        with pytest.raises(ValueError) as err:
            Trainer(dataclasses.replace(cfg, stop_after=None), Topology(), run_dir, resume=True)
        assert str(err.value) == (f"checkpoint {path} has format version {written['version']}, this abtrain "
                                  f"({abtrain.__version__}) reads version {ckpt.VERSION}: resume it with the abtrain "
                                  f"that wrote it ({writer})")
