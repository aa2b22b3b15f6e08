"""Checkpoints as DDP users take them, for every method of the registry, in real 4-worker gloo worlds.

Three worlds share the work: one trains every method uninterrupted; one stops each method mid-run and
saves it the ways users do (rank 0's torch.save of the model's and the optimizer's state_dicts, as DDP scripts
do; each worker's own file; torch.distributed.checkpoint of ``{"model": model, "optim": opt}``, and DCP through
the ``get_state_dict`` / ``set_state_dict`` helpers FSDP2 users take); one resumes each from each. Rank 0's
checkpoint resumes every worker: exactly where rank 0 says nothing, otherwise with one line on rank 0 saying
what is given up, every worker ending with one model. Per-rank files, DCP and rank 0's file written after every
worker called ``method.gather_state()`` resume every worker bit for bit.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import abtrain
from abtrain.methods import registry

from helpers import Net, net_batch, run_world

STEPS = 24
STOP = 11  # 3 steps into an AB phase (warm-up 4, a sync every 6 steps, each followed by 2 rebound steps)
AB = {"group_size": 2, "warmup_steps": 4, "sync_every": 6, "rebound_steps": 2}
OPTIONS: dict[str, dict[str, Any]] = {
    "ab": AB, "hlocalsgd": {"group_size": 2, "sync_every": 4}, "localsgd": {"sync_every": 4}, "diloco": {"sync_every": 4},
    "streaming-diloco": {"sync_every": 4, "fragments": 2}, "powersgd": {"warmup_steps": 2}, "ef21": {"warmup_steps": 2},
    "onebit": {"warmup_steps": 2}}
DCP_METHODS = ["ab", "diloco", "streaming-diloco", "sparseloco", "demo", "ef21", "powersgd"]
#: (name, stop): the runs each world takes; AB also stops right after its first decomposition, where every
#: worker's state can be rebuilt from rank 0's
RUNS = [(name, STOP) for name in registry.names()] + [("ab", AB["warmup_steps"])]


class AppState(Stateful):
    """torch's DCP recipe: the model's and the optimizer's state through get_state_dict / set_state_dict."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


class Lines(logging.Handler):
    """What rank 0 says (quiet methods say it to the ``abtrain`` logger) and what is warned."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(name: str, ckpt: str, stop: int | None = None, resume: str | None = None, **options: Any
           ) -> dict[str, Any]:
    """One run of ``name``: from the start, or resumed the way ``resume`` names ("rank0", "dcp", "helpers")
    from the checkpoints of ``ckpt``; stopped after ``stop`` steps (all three saved), else to the end."""
    torch.manual_seed(0)
    method = abtrain.setup(name, total_steps=STEPS, quiet=True, **{**OPTIONS.get(name, {}), **options})
    rank = method.topo.rank
    model = method.prepare(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0 if name == "demo" else 0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
    method.attach(opt)
    lines = Lines()
    logging.getLogger("abtrain").addHandler(lines)
    logging.getLogger("abtrain").setLevel(logging.INFO)
    start, out = 0, {}
    try:
        if resume in ("rank0", "perrank", "gathered"):
            # rank 0's file on every rank (after gather_state(): "gathered"), or each rank its own
            state = torch.load(os.path.join(ckpt, {"rank0": "rank0.pt", "perrank": f"rank{rank}.pt",
                                                   "gathered": "gathered.pt"}[resume]))
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            start = state["step"]
        elif resume in ("dcp", "helpers"):
            app = {"app": AppState(model, opt)} if resume == "helpers" else {"model": model, "optim": opt}
            dcp.load({**app, "sched": sched}, checkpoint_id=os.path.join(ckpt, resume))
            start = method.steps
        if resume is not None:
            out["after_load"] = _inspect(method, opt)
        for step in range(start, STEPS if stop is None else stop):
            x, y = net_batch(step, rank)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        if stop is not None:
            if rank == 0 or (name in DCP_METHODS and stop == STOP):  # rank 0's file; each worker's for some
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "step": stop}, os.path.join(ckpt, f"rank{rank}.pt"))
            if name in DCP_METHODS and stop == STOP:
                dcp.save({"model": model, "optim": opt, "sched": sched}, checkpoint_id=os.path.join(ckpt, "dcp"))
                dcp.save({"app": AppState(model, opt), "sched": sched}, checkpoint_id=os.path.join(ckpt, "helpers"))
            if stop == STOP:
                method.gather_state()  # every worker; then rank 0's file carries each worker's own part
                if rank == 0:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                                "step": stop}, os.path.join(ckpt, "gathered.pt"))
            dist.barrier()
            method.detach(finalize=False)
            return out
        method.detach()
    finally:
        logging.getLogger("abtrain").removeHandler(lines)
    return {**out, "weights": {k: v.clone() for k, v in method.export().items()}, "steps": method.steps,
            "bytes": method.comm.ledger.wire_total, "lines": lines.lines, "ddp": method.ddp is not None}


def _inspect(method: abtrain.Method, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What a worker holds right after a resume: AB's factors, modes, what trains and has optimizer state."""
    records = getattr(method, "records", [])
    return {"role": getattr(method, "role", None),
            "layers": {fp.name: {"mode": fp.mode, "A": fp.A.detach().clone(), "B": fp.B.detach().clone(),
                                 "grad": (fp.A.requires_grad, fp.B.requires_grad, fp.weight.requires_grad),
                                 "state": (bool(opt.state.get(fp.A)), bool(opt.state.get(fp.B)))}
                       for fp in records},
            "bases": {k: (v[0].clone(), v[1].clone()) for k, v in getattr(getattr(method, "state", None),
                                                                            "bases", {}).items()}}


def _fresh(name: str = "ab") -> tuple[abtrain.Method, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    method = abtrain.setup(name, total_steps=STEPS, quiet=True, **OPTIONS.get(name, {}))
    model = method.prepare(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    method.attach(opt)
    return method, model, opt


def _refused(call: Any) -> str:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return ""


def _refusals(root: str) -> dict[str, str]:
    """What cannot be resumed, refused in one line on every worker before anything is sent."""
    x, y = net_batch(0, dist.get_rank())
    mid = torch.load(os.path.join(root, f"ab-{STOP}", "rank0.pt"))
    start = torch.load(os.path.join(root, f"ab-{AB['warmup_steps']}", "rank0.pt"))
    out = {}
    method, model, opt = _fresh()  # the model's state_dict of an AB phase, and not the optimizer's
    model.load_state_dict(mid["model"])
    out["model only"] = _refused(lambda: model(x))
    method.detach(finalize=False)
    method, model, opt = _fresh()  # the optimizer's state_dict first
    out["optimizer first"] = _refused(lambda: opt.load_state_dict(start["opt"]))
    method.detach(finalize=False)
    method, model, opt = _fresh()  # rank 0's checkpoint, one step, then its model's state_dict alone
    model.load_state_dict(start["model"])
    opt.load_state_dict(start["opt"])
    F.cross_entropy(model(x), y).backward()  # an AB step: the groups average apart
    opt.step()
    model.load_state_dict(start["model"])
    out["model again"] = _refused(lambda: model(x))  # the B-workers: another role's factors
    method.detach(finalize=False)
    method, model, opt = _fresh("diloco")  # another method's state
    other = torch.load(os.path.join(root, f"localsgd-{STOP}", "rank0.pt"))
    model.load_state_dict(other["model"])
    out["other method"] = _refused(lambda: opt.load_state_dict(other["opt"]))
    method.detach(finalize=False)
    method, model, opt = _fresh("diloco")  # torch.distributed.checkpoint's model without its optimizer
    dcp.load({"model": model}, checkpoint_id=os.path.join(root, f"diloco-{STOP}", "dcp"))
    out["dcp model only"] = _refused(lambda: model(x))
    method.detach(finalize=False)
    return out


def _world(phase: str, ckpt_root: str) -> dict[str, Any]:
    dist.init_process_group("gloo")  # the script's own world: the methods join it, one after the other
    out: dict[str, Any] = {}
    for name, stop in RUNS:
        ckpt = os.path.join(ckpt_root, f"{name}-{stop}")
        os.makedirs(ckpt, exist_ok=True)
        if phase == "whole":
            if stop == STOP:
                out[name] = _train(name, ckpt)
        elif phase == "stop":
            out[(name, stop)] = _train(name, ckpt, stop=stop)
        else:
            for way in ("rank0", "perrank", "dcp", "helpers", "gathered") if name in DCP_METHODS else (
                    "rank0", "gathered"):
                if way == "rank0" or stop == STOP:
                    out[(name, stop, way)] = _train(name, ckpt, resume=way)
    if phase == "resume":
        out["refusals"] = _refusals(ckpt_root)
    dist.destroy_process_group()
    return out


def _two_workers(ckpt_root: str) -> dict[str, Any]:
    """AB-training resumed by 2 workers from the 4 workers' gathered file (another layout)."""
    dist.init_process_group("gloo")
    out = _train("ab", os.path.join(ckpt_root, f"ab-{STOP}"), resume="gathered", group_size=1)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    out = {phase: run_world(_world, 4, phase, root) for phase in ("whole", "stop", "resume")}
    return {**out, "two": run_world(_two_workers, 2, root)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", registry.names())
def test_rank0_checkpoint_resumes_every_worker_exactly_where_rank0_says_nothing(worlds, name):
    whole, resumed = worlds["whole"], worlds["resume"]
    runs = [r[(name, STOP, "rank0")] for r in resumed]
    said = [line for line in runs[0]["lines"] if "a worker resuming from it" in line]
    for rank, run in enumerate(runs):
        assert run["steps"] == STEPS
        assert not [line for line in run["lines"] if "a worker resuming from it" in line] or rank == 0
        if name != "none":  # every worker ends with one model
            assert _equal(run["weights"], runs[0]["weights"])
        if not said:  # nothing given up: every worker resumes as if never stopped
            assert run["bytes"] == whole[rank][name]["bytes"]
            if run["ddp"]:  # bit for bit but for DDP's buckets, which it orders anew after its first step
                for key, value in whole[rank][name]["weights"].items():
                    torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=1e-4)
            else:
                assert _equal(run["weights"], whole[rank][name]["weights"]), rank
    assert len(said) <= 1


def test_rank0_checkpoint_of_ab_says_what_it_gives_up(worlds):
    line = [x for x in worlds["resume"][0][("ab", STOP, "rank0")]["lines"] if "a worker resuming from it" in x]
    assert len(line) == 1, line
    assert line[0].startswith("ab state of step 11, saved by rank 0 of 4 workers in groups of 2: a worker "
                              "resuming from it in place of its own gives up ")
    assert "the B-groups' optimizer state of B" in line[0]
    assert line[0].endswith("or rank 0's file saved after method.gather_state() on every worker) resumes exactly")


def test_gathered_file_in_another_layout_resumes_and_says_what_it_gives_up(worlds):
    """Every worker's part is in the file, but none is a part of a worker of this layout: each adopts the state of
    the worker of its rank there, and rank 0 says in one line what that gives up."""
    runs = worlds["two"]
    said = [[x for x in run["lines"] if "a worker resuming from it" in x] for run in runs]
    assert len(said[0]) == 1 and not said[1], said
    assert said[0][0].startswith("ab state of step 11, saved by rank 0 of 4 workers in groups of 2: ")
    assert said[0][0].endswith("on every worker) in the layout that wrote it resumes exactly")
    assert all(run["steps"] == STEPS for run in runs) and _equal(runs[0]["weights"], runs[1]["weights"])


def test_ab_right_after_its_first_decomposition_resumes_every_worker_exactly(worlds):
    stop = AB["warmup_steps"]
    for rank in range(4):
        run = worlds["resume"][rank][("ab", stop, "rank0")]
        assert not [x for x in run["lines"] if "a worker resuming from it" in x]
        assert _equal(run["weights"], worlds["whole"][rank]["ab"]["weights"]), rank
        assert run["bytes"] == worlds["whole"][rank]["ab"]["bytes"]


def test_a_b_worker_resumed_from_an_a_worker_trains_its_own_split(worlds):
    """Rank 0 (an A-worker) saved mid-phase; rank 2 (a B-worker) rebuilt the tangent split of the phase's start:
    A = U, B = σ·Vᵀ from rank 0's U, σ and Vᵀ, its B trainable, no optimizer state of A or B."""
    a = worlds["resume"][0][("ab", STOP, "rank0")]["after_load"]
    b = worlds["resume"][2][("ab", STOP, "rank0")]["after_load"]
    assert a["role"] == "A" and b["role"] == "B"
    low = [n for n, layer in a["layers"].items() if layer["mode"] == "lowrank"]
    assert low
    for n in low:
        la, lb = a["layers"][n], b["layers"][n]
        assert lb["mode"] == "lowrank" and lb["grad"] == (False, True, False) and la["grad"] == (True, False, False)
        assert lb["state"] == (False, False) and la["state"] == (True, False)
        u, sigma = a["bases"][n]
        vh = la["B"]
        assert torch.equal(lb["A"], u) and torch.equal(lb["B"], sigma[:, None] * vh)
        assert torch.equal(b["bases"][n][0], vh) and torch.equal(b["bases"][n][1], sigma)


EXACT = registry.names()


@pytest.mark.parametrize("name", EXACT)
def test_rank0_file_after_gather_state_resumes_every_worker_as_if_never_stopped(worlds, name):
    for rank in range(4):
        run = worlds["resume"][rank][(name, STOP, "gathered")]
        whole = worlds["whole"][rank][name]
        assert run["steps"] == STEPS and not [x for x in run["lines"] if "a worker resuming from it" in x]
        assert run["bytes"] == whole["bytes"]
        if run["ddp"]:  # bit for bit but for DDP's buckets, which it orders anew after its first step
            for key, value in whole["weights"].items():
                torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=1e-4)
        else:
            assert _equal(run["weights"], whole["weights"]), rank


@pytest.mark.parametrize("way", ["perrank", "dcp", "helpers"])
@pytest.mark.parametrize("name", DCP_METHODS)
def test_per_rank_files_and_dcp_resume_every_worker_as_if_never_stopped(worlds, name, way):
    for rank in range(4):
        run = worlds["resume"][rank][(name, STOP, way)]
        whole = worlds["whole"][rank][name]
        assert run["steps"] == STEPS
        if way != "perrank":  # rank 0 cannot tell its own file from rank 0's file that every worker loads
            assert not [x for x in run["lines"] if "a worker resuming from it" in x]
        if run["ddp"]:  # bit for bit but for DDP's buckets, which it orders anew after its first step
            for key, value in whole["weights"].items():
                torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=1e-4)
        else:
            assert _equal(run["weights"], whole["weights"]), rank
        assert run["bytes"] == whole["bytes"]


def test_what_cannot_be_resumed_is_refused_in_one_line(worlds):
    for rank, out in enumerate(r["refusals"] for r in worlds["resume"]):
        assert out["model only"] == (
            "the model's state_dict holds AB-training's low-rank factors and this AB-training has no state of them: "
            "load the optimizer's state_dict saved with it (after the model's, and after method.attach(opt)); it "
            "carries the method's state")
        assert out["optimizer first"] == (
            "the model does not hold the factors the optimizer's state_dict was saved with (a.weight): load the "
            "model's state_dict first, then the optimizer's, both of one checkpoint")
        # an A-worker goes on (its own role's factors: rank 0 says the method's state did not come); a B-worker
        # would train another role's split
        assert out["model again"] == ("" if rank < 2 else
            "the model's state_dict holds the factors of a worker that trains A (a.weight), this worker trains B: "
            "load the optimizer's state_dict saved with it too, after the model's (it carries what this worker "
            "rebuilds its own factors from), or each worker's own checkpoint")
        assert out["other method"] == ("the checkpoint was saved by method 'localsgd', this run uses 'diloco': "
                                       "resume with the method that wrote it")
        assert out["dcp model only"].startswith("the model's state_dict was saved by torch.distributed.checkpoint "
                                                "with some tensors in the optimizer's state")
