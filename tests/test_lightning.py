"""The Lightning strategy in a real 4-worker gloo world: AB-training as abtrain's own loop runs it, bit for bit.

One world (Lightning's import costs each worker seconds) runs, in order: AB-training through the strategy
with gradient clipping, accumulation over 2 micro-batches and a checkpoint after every epoch (Lightning's own,
written by rank 0, with every worker's own part of the method's state); the same run resumed from the first
checkpoint (in the warm-up, where every worker holds one state) and from the second (right after a decomposition);
the same with ``gather_checkpoints=False`` (rank 0's state alone); the same training written as a plain loop
around ``abtrain.setup``; and
abtrain's ``ddp`` method and the other kinds of method through the strategy. The example script runs as a user
types it, Lightning starting its workers.
"""

from __future__ import annotations

import contextlib

import difflib
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

import abtrain
from abtrain.comm.ledger import wire_bytes
from abtrain.integrations.lightning import AbtrainStrategy
from abtrain.methods.resume import unpack
from abtrain.methods.summary import ddp_equivalent

from helpers import run_world

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4
FEATURES, HIDDEN, CLASSES = 16, 64, 4
BATCH, ACCUMULATE, EPOCHS = 8, 2, 3
STEPS_PER_EPOCH = 6  # optimizer steps: 12 micro-batches of 8 samples on each of 4 workers
STEPS = EPOCHS * STEPS_PER_EPOCH
CLIP = 0.05
# Warm-up 7 steps (full-rank gradients averaged in fp32: the workers hold one state), a sync at every multiple of 4
# after it (steps 8, 12, 16), the next decomposition at once; validation at every epoch's end (steps 6, 12, 18): in the
# warm-up, right after a decomposition, and inside an AB phase, where consensus() syncs.
AB = {"warmup_steps": 7, "sync_every": 4, "rebound_steps": 0, "lr_rebound_steps": 0, "min_rank": 2,
      "dense_comm": "fp32"}
GIVES_UP = "a worker resuming from it in place of its own gives up"
#: The other kinds of method, with short schedules, and the ledger phases each one's traffic falls in.
OTHERS = {"powersgd": ({"warmup_steps": 2}, {"setup", "warmup", "train"}),  # DDP's hook
          "ef21": ({}, {"setup", "warmup", "train"}),  # reduce_gradients() before clipping
          "localsgd": ({"sync_every": 4}, {"setup", "average"}),
          "diloco": ({"sync_every": 4}, {"setup", "outer"})}


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(WORLD * BATCH * ACCUMULATE * STEPS_PER_EPOCH, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    return TensorDataset(x, y)


def _grad_norm(optimizer: torch.optim.Optimizer) -> float:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                 nn.Linear(HIDDEN, CLASSES))
        self.norms: list[tuple[float, float]] = []  # each step's gradient norm before and after Lightning's clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        # The last thing before the update: what is left here is what the optimizer steps with.
        before = _grad_norm(optimizer)
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norms.append((before, _grad_norm(optimizer)))


class Watch(Callback):
    """The bytes each micro-batch sent, the layers held low rank after each, the method's step at the start."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, str, float]] = []  # (batch index, phase, bytes sent during the batch)
        self.low_rank: list[int] = []
        self.start_step: int | None = None
        self._before = 0.0

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.start_step = getattr(trainer.strategy.method, "t", None)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, i: int) -> None:
        self._phase = trainer.strategy.method.phase
        self._before = trainer.strategy.method.comm.ledger.wire_total

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, out: Any, batch: Any, i: int) -> None:
        method = trainer.strategy.method
        self.batches.append((i, self._phase, method.comm.ledger.wire_total - self._before))
        self.low_rank.append(sum(fp.mode == "lowrank" for fp in getattr(method, "records", [])))


def _rows(ledger: abtrain.Ledger) -> dict[tuple, tuple[int, int, float]]:
    """The ledger without its timings."""
    return {k: (r.calls, r.payload_bytes, r.wire_bytes) for k, r in ledger.rows.items()}


def _fit(method: str, ckpt_dir: str | None = None, resume: str | None = None, val_check_interval: int | None = None,
         **options: Any) -> dict[str, Any]:
    data = _data()
    strategy = AbtrainStrategy(method, quiet=True, **options)
    model, watch = Net(), Watch()
    callbacks: list[Callback] = [watch]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1,
                                         save_on_train_epoch_end=True))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_epochs=EPOCHS,
                         accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=ckpt_dir is not None,
                         callbacks=callbacks, limit_val_batches=2, num_sanity_val_steps=1,
                         val_check_interval=val_check_interval)
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("abtrain").addHandler(handler)
    logging.getLogger("abtrain").setLevel(logging.INFO)
    try:
        trainer.fit(model, DataLoader(data, batch_size=BATCH), DataLoader(Subset(data, range(64)), batch_size=16),
                    ckpt_path=resume)
    finally:
        logging.getLogger("abtrain").removeHandler(handler)
    m = strategy.method
    return {"export": m.export(), "rows": _rows(m.comm.ledger), "norms": model.norms, "batches": watch.batches,
            "gives_up": [line for line in said if GIVES_UP in line],
            "low_rank": watch.low_rank, "start_step": watch.start_step, "t": getattr(m, "t", None),
            "ranks": getattr(m, "ranks", None), "role": getattr(m, "role", None), "group": m.topo.group.ranks,
            "params": strategy.param_count, "line": strategy.bytes_line(STEPS)}


def _own_loop() -> dict[str, Any]:
    """The same training without Lightning: abtrain's own-loop API, accumulation and clipping by hand."""
    data = _data()
    sampler = DistributedSampler(data, WORLD, dist.get_rank(), shuffle=True, seed=0)  # the one Lightning adds
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    method = abtrain.setup("ab", total_steps=STEPS, quiet=True, **AB)
    model = method.prepare(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    method.attach(opt)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i % ACCUMULATE == 0:
                opt.zero_grad()
            stepping = i % ACCUMULATE == ACCUMULATE - 1
            with method.no_sync() if not stepping else contextlib.nullcontext():
                (F.cross_entropy(model(x), y) / ACCUMULATE).backward()
            if stepping:  # backward() has averaged the accumulated gradient: clip it
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP)
                opt.step()
        method.consensus()  # Lightning's validation at the epoch's end
    method.detach()
    method.consensus()
    out = {"export": method.export(), "rows": _rows(method.comm.ledger)}
    method.close()
    return out


def _world(ckpt_dir: str) -> dict[str, Any]:
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning_fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*(sync_dist|LeafSpec|isinstance).*")
    dirs = {way: os.path.join(ckpt_dir, way) for way in ("gathered", "resumed", "resumed_again", "plain", "again")}
    out = {"ab": _fit("ab", ckpt_dir=dirs["gathered"], **AB)}
    dist.barrier()
    first, second = (os.path.join(dirs["gathered"], f"epoch={e}-step={(e + 1) * STEPS_PER_EPOCH}.ckpt")
                     for e in (0, 1))
    if dist.get_rank() == 0:
        saved = torch.load(first, weights_only=False)
        parts = saved["optimizer_states"][0]["param_groups"][0]["abtrain"]
        shared, own = (unpack(parts[key]) for key in ("shared", "worker1"))
        out["checkpoint"] = {"keys": sorted(saved), "parts": sorted(parts), "method": shared["method"],
                             "writer": own["writer"]["rank"], "t": shared["state"]["t"]}
    # the resumed runs checkpoint as the uninterrupted one did
    out["resumed"] = _fit("ab", ckpt_dir=dirs["resumed"], resume=first, **AB)
    out["resumed_again"] = _fit("ab", ckpt_dir=dirs["resumed_again"], resume=second, **AB)
    # rank 0's state alone: every worker goes on, the B-workers from what the workers share
    out["plain"] = _fit("ab", ckpt_dir=dirs["plain"], gather_checkpoints=False, **AB)
    dist.barrier()
    if dist.get_rank() == 0:
        saved = torch.load(os.path.join(dirs["plain"], f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"), weights_only=False)
        method = saved["optimizer_states"][0]["abtrain"]
        out["plain_checkpoint"] = {"method": method["method"], "writer": method["writer"]["rank"],
                                   "t": method["state"]["t"]}
    out["plain_again"] = _fit("ab", ckpt_dir=dirs["again"], gather_checkpoints=False, **AB,
                              resume=os.path.join(dirs["plain"], f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"))
    out["own"] = _own_loop()
    out["ddp"] = _fit("ddp")
    out["others"] = {name: _fit(name, **options) for name, (options, _) in OTHERS.items()}
    try:
        _fit("ab", val_check_interval=3, **AB)
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(_world, WORLD, str(tmp_path_factory.mktemp("lightning")))


def test_ab_trains_low_rank_and_ends_with_one_model(world):
    ab = [r["ab"] for r in world]
    assert max(ab[0]["low_rank"]) == 2  # both hidden layers factorised (the output layer is kept full rank)
    cuts = [r for layers in (d["layers"] for d in ab[0]["ranks"]) for r in layers.values() if r is not None]
    assert cuts and min(cuts) < min(FEATURES, HIDDEN)  # truncated below full rank
    for other in ab[1:]:
        assert other["export"].keys() == ab[0]["export"].keys()
        assert all(torch.equal(other["export"][k], ab[0]["export"][k]) for k in ab[0]["export"])
    assert {r["role"] for r in ab} == {"A", "B"}


def test_clipping_sees_the_averaged_gradient(world):
    for r in world:
        norms = r["ab"]["norms"]
        assert len(norms) == STEPS
        assert all(after <= CLIP * (1 + 1e-5) for _, after in norms)
        assert sum(before > CLIP for before, _ in norms) >= STEPS // 2  # clipping was at work
    # The norm before clipping is that of the gradient averaged over the workers the step's phase averages
    # over: the same on every worker of the world in warm-up, on every worker of a group in AB steps.
    phases = [p for i, p, _ in world[0]["ab"]["batches"] if i % ACCUMULATE == ACCUMULATE - 1]
    for step, phase in enumerate(phases):
        same = world if phase != "ab" else [r for r in world if r["ab"]["group"] == world[0]["ab"]["group"]]
        assert len({r["ab"]["norms"][step][0] for r in same}) == 1, (step, phase)


def _without_checkpoints(rows: dict[tuple, Any]) -> dict[tuple, Any]:
    return {key: row for key, row in rows.items() if key[5] != "checkpoint"}


def test_lightning_sends_and_computes_what_the_own_loop_does(world):
    for r in world:
        # the own loop takes no checkpoint; Lightning's gathers the workers' parts to rank 0 at each (3 epochs: 3
        # times): all-gathers of the tensors' digests and of lengths, then a gather of what rank 0 lacks
        assert _without_checkpoints(r["ab"]["rows"]) == r["own"]["rows"]
        gathers = {key: row for key, row in r["ab"]["rows"].items() if key[5] == "checkpoint"}
        assert {key[0] for key in gathers} == {"all_gather", "gather"}
        assert sum(calls for key, (calls, _, _) in gathers.items() if key[0] == "all_gather") == 3 * 3
        (calls, payload, wire), = [row for key, row in gathers.items() if key[0] == "gather"]
        assert calls == 3 and wire == wire_bytes("gather", payload, WORLD) and (payload == 0) == (r is world[0])
        assert r["plain"]["rows"] == r["own"]["rows"]  # gather_checkpoints=False sends nothing at checkpoints
        assert all(torch.equal(r["ab"]["export"][k], r["own"]["export"][k]) for k in r["own"]["export"])


def test_accumulation_sends_nothing_between_steps(world):
    params = world[0]["ddp"]["params"]
    for r in world:
        quiet = [b for i, phase, b in r["ddp"]["batches"] if i % ACCUMULATE != ACCUMULATE - 1]
        assert len(quiet) == STEPS and not any(quiet)
        # AB-training too: the micro-batches that do not step run inside method.no_sync().
        ab = [b for i, phase, b in r["ab"]["batches"] if i % ACCUMULATE != ACCUMULATE - 1]
        assert not any(ab)
        # DDP's bytes are its formula: the setup digest (the workers built the same model) and one all-reduce of
        # every parameter per step.
        by_phase: dict[str, float] = {}
        for key, (_, _, wire) in r["ddp"]["rows"].items():
            by_phase[key[5]] = by_phase.get(key[5], 0.0) + wire
        assert by_phase == {"setup": wire_bytes("all_reduce", 32, WORLD),
                            "train": ddp_equivalent(params, WORLD, WORLD, STEPS)["wire_bytes"]}


def test_ab_sends_less_than_ddp(world):
    for r in world:
        ab = sum(wire for _, _, wire in r["ab"]["rows"].values())
        ddp = sum(wire for _, _, wire in r["ddp"]["rows"].values())
        assert 0 < ab < ddp
    assert world[0]["ab"]["line"].startswith("ab sent ") and "DDP would send" in world[0]["ab"]["line"]


@pytest.mark.parametrize("name", OTHERS)
def test_other_methods_end_with_one_model(world, name):
    runs = [r["others"][name] for r in world]
    for run in runs:
        assert all(torch.equal(run["export"][k], runs[0]["export"][k]) for k in runs[0]["export"])
        assert {key[5] for key in run["rows"]} == OTHERS[name][1]
        ddp = ddp_equivalent(run["params"], WORLD, WORLD, STEPS)["wire_bytes"]
        assert 0 < sum(wire for _, _, wire in run["rows"].values()) < ddp
        assert all(after <= CLIP * (1 + 1e-5) for _, after in run["norms"]) and len(run["norms"]) == STEPS


def test_validation_between_micro_batches_is_refused(world):
    for r in world:
        assert r["refused"].startswith("validation fell between two micro-batches of one optimizer step")


def test_rank0s_checkpoint_resumes_every_worker_exactly(world):
    # Lightning's file as rank 0 writes it: one model and optimizer, the method's state in the optimizer's, with
    # every worker's own part
    saved = world[0]["checkpoint"]
    assert "abtrain" not in saved["keys"] and (saved["method"], saved["writer"], saved["t"]) == ("ab", 1, 6)
    assert saved["parts"] == ["shared", "tensors"] + [f"worker{r}" for r in range(WORLD)]
    # from the warm-up, where the workers hold one state, and right after a decomposition, where the groups hold
    # their own: the uninterrupted run, bit for bit, and nothing said
    for way, start in (("resumed", STEPS_PER_EPOCH), ("resumed_again", 2 * STEPS_PER_EPOCH)):
        for r in world:
            run = r[way]
            assert run["start_step"] == start and not run["gives_up"], way
            assert run["t"] == r["ab"]["t"] == STEPS
            assert run["ranks"] == r["ab"]["ranks"]
            # the same bytes, and every checkpoint's gather but that of the checkpoint it resumed from (a
            # checkpoint's state is taken before its own gather)
            assert _without_checkpoints(run["rows"]) == _without_checkpoints(r["ab"]["rows"])
            assert {k: v[0] for k, v in run["rows"].items() if k not in _without_checkpoints(run["rows"])} == {
                k: calls * (EPOCHS - 1) // EPOCHS for k, (calls, _, _) in r["ab"]["rows"].items() if k[5] == "checkpoint"}
            assert all(torch.equal(run["export"][k], r["ab"]["export"][k]) for k in r["ab"]["export"]), way


def test_rank0s_state_alone_resumes_every_worker(world):
    saved = world[0]["plain_checkpoint"]
    assert (saved["method"], saved["writer"], saved["t"]) == ("ab", 0, 6)
    # right after a decomposition: every worker goes on, rank 0 says what the B-workers give up, one model at the end
    runs = [r["plain_again"] for r in world]
    assert len(runs[0]["gives_up"]) == 1 and "the B-groups' optimizer state of B" in runs[0]["gives_up"][0]
    # the line names the checkpoint that resumes every worker exactly under Lightning, not one of a user's loop
    assert runs[0]["gives_up"][0].endswith("(Lightning's checkpoint with AbtrainStrategy(gather_checkpoints=True), "
                                           "the default) resumes exactly")
    for run in runs:
        assert run["start_step"] == 2 * STEPS_PER_EPOCH and run["t"] == STEPS
        assert all(torch.equal(run["export"][k], runs[0]["export"][k]) for k in runs[0]["export"])
    assert not any(run["gives_up"] for run in runs[1:])
    # and it is another run than the uninterrupted one (the B-workers' optimizer state was rebuilt)
    assert any(not torch.equal(runs[0]["export"][k], world[0]["plain"]["export"][k]) for k in runs[0]["export"])


def test_the_strategy_refuses_what_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        AbtrainStrategy("nope")
    with pytest.raises(ValueError, match="does not run 'streaming-diloco'"):
        AbtrainStrategy("streaming-diloco")
    path = tmp_path / "other.ckpt"
    torch.save({"state_dict": {}, "optimizer_states": [{"abtrain": {"method": "localsgd"}}]}, path)
    with pytest.raises(ValueError, match="written by 'localsgd', this run trains 'ab': resume it with the method"):
        AbtrainStrategy("ab").load_checkpoint(path)


def test_the_example_converts_in_three_lines_and_runs_as_typed(tmp_path):
    block = re.search(r"```diff\n(.*?)```", (ROOT / "docs" / "lightning.md").read_text(), re.S)[1].splitlines()
    before = [ln[1:] for ln in block if ln[:1] in (" ", "-", "")]
    after = [ln[1:] for ln in block if ln[:1] in (" ", "+", "")]
    ops = difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes()
    added = sum(j2 - j1 for tag, _, _, j1, j2 in ops if tag in ("replace", "insert"))
    removed = sum(i2 - i1 for tag, i1, i2, _, _ in ops if tag in ("replace", "delete"))
    assert (added, removed) == (3, 2)  # docs/lightning.md's diff: the import, the strategy, the export
    example = ROOT / "examples" / "lightning_trainer.py"
    marked = [ln for ln in example.read_text().splitlines() if re.search(r"\S  # abtrain( \(was: .*\))?$", ln)]
    assert len(marked) == 3
    p = subprocess.run([sys.executable, str(example)], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"validation accuracy ([\d.]+); plain Net from the exported weights ([\d.]+); "
                  r"compression ([\d.]+):1", p.stdout)
    assert m, p.stdout[-3000:]
    assert float(m[1]) > 0.6 and abs(float(m[1]) - float(m[2])) <= 0.002  # one model, loaded into the plain class
    assert float(m[3]) > 1.5
    assert p.stdout.count("AB-training schedule") == 1  # rank 0 only
    assert "one node of 4 workers: 2 groups of 2" in p.stdout  # Lightning's devices: the workers of one node
    assert re.search(r"^abtrain: ab sent [\d.]+ [kM]B from rank 0 in 96 optimizer steps \(ab .*; DDP would send ",
                     p.stdout, re.M)
