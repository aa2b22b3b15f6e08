"""What a user's own loop relies on, as under DDP: the averaged gradient in .grad when backward() returns
(clipping), no_sync() for accumulation, torch.compile in both orders, resuming from the model's and the
optimizer's state_dicts, and no DistributedDataParallel whose bytes the ledger cannot see."""

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import abtrain
from abtrain.sidebyside import netns
from abtrain.sidebyside.linkbytes import link_check

from helpers import Net, free_port, net_batch, run_world

STEPS = 24
AB = {"warmup_steps": 4, "sync_every": 6, "rebound_steps": 2}  # warm-up, AB phases, a sync every 6 steps, rebounds
CLIP = 0.05  # well below every gradient norm of this model: every step is clipped


def _method(name: str) -> abtrain.Method:
    options = {"ab": dict(group_size=2, **AB), "hlocalsgd": dict(group_size=2, sync_every=4),
               "ef21": {"warmup_steps": 2}}.get(name, {})
    return abtrain.setup(name, total_steps=STEPS, quiet=True, **options)


def _weights(method: abtrain.Method) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in method.export().items()}


# -- clipping sees the averaged gradient -----------------------------------------------------------------

def _clipped(name: str) -> dict:
    torch.manual_seed(0)
    method = _method(name)
    model = method.prepare(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    # The user's own hook, registered before attach(): it runs before the method's, so it sees .grad as the
    # loop left it after backward() and clipping.
    opt.register_step_pre_hook(lambda o, *_: seen.append(
        (method.phase, torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for g in o.param_groups
                                                             for p in g["params"] if p.grad is not None])).item())))
    method.attach(opt)
    for step in range(STEPS):
        x, y = net_batch(step, method.topo.rank)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    method.detach()
    return {"seen": seen, "weights": _weights(method)}


@pytest.mark.parametrize("name", ["ab", "hlocalsgd", "ef21"])
def test_clipping_after_backward_is_what_the_optimizer_applies(name):
    out = run_world(_clipped, 4, name)
    for rank in out:
        phases = {phase for phase, _ in rank["seen"]}
        if name == "ab":
            assert {"warmup", "ab", "rebound"} <= phases
        for phase, norm in rank["seen"]:
            assert norm == pytest.approx(CLIP, rel=1e-4), (phase, norm)
    for rank in out[1:]:  # and the workers still end with one model
        for key, value in out[0]["weights"].items():
            assert torch.equal(rank["weights"][key], value), key


# -- no_sync(): accumulation sends what one backward sends --------------------------------------------------

def _accumulated(name: str, micro: int) -> dict:
    torch.manual_seed(0)
    method = _method(name)
    model = method.prepare(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    method.attach(opt)
    quiet_calls = []
    for step in range(STEPS):
        x, y = net_batch(step, method.topo.rank)
        opt.zero_grad()
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            last = i == micro - 1
            before = method.comm.ledger.summary()["calls"]
            with (method.no_sync() if not last else torch.enable_grad()):
                (F.cross_entropy(model(xs), ys) / micro).backward()
            if not last:
                quiet_calls.append(method.comm.ledger.summary()["calls"] - before)
        opt.step()
    method.detach()
    summary = method.comm.ledger.summary()
    return {"by_phase": {k: v["wire_bytes"] for k, v in summary["by_phase"].items()}, "quiet": quiet_calls,
            "weights": _weights(method)}


@pytest.mark.parametrize("name", ["ab", "ef21", "ddp"])
def test_no_sync_accumulation_sends_what_one_backward_sends(name):
    runs = {micro: run_world(_accumulated, 4, name, micro)[0] for micro in (1, 2, 4)}
    for micro in (2, 4):
        assert set(runs[micro]["quiet"]) == {0}  # no collective inside no_sync()
        assert runs[micro]["by_phase"] == runs[1]["by_phase"]
        for key, value in runs[1]["weights"].items():  # the mean of the micro-batches' gradients: the same step
            torch.testing.assert_close(runs[micro]["weights"][key], value, rtol=0, atol=1e-4)


# -- torch.compile, in both orders -------------------------------------------------------------------------

def _compiled(order: str) -> dict:
    torch.manual_seed(0)
    method = _method("ab")
    net = Net()
    if order == "compile, then prepare":
        model = method.prepare(torch.compile(net, backend="aot_eager"))
    elif order == "prepare, then compile":
        model = torch.compile(method.prepare(net), backend="aot_eager")
    else:
        model = method.prepare(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    method.attach(opt)
    low_rank = 0
    for step in range(STEPS):
        x, y = net_batch(step, method.topo.rank)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        low_rank = max(low_rank, sum(fp.mode == "lowrank" for fp in method.records))
    method.detach()
    return {"bytes": method.comm.ledger.wire_total, "low_rank": low_rank, "kept": method.state.kept,
            "compiled": type(model).__name__, "weights": _weights(method)}


def test_torch_compile_in_either_order_keeps_the_low_rank_layers_and_the_bytes():
    eager = run_world(_compiled, 4, "eager")[0]
    assert eager["low_rank"] == 2 and eager["kept"] == ["out.weight"]
    for order in ("compile, then prepare", "prepare, then compile"):
        out = run_world(_compiled, 4, order)[0]
        assert out["compiled"] == "OptimizedModule"
        assert out["kept"] == eager["kept"] and out["low_rank"] == eager["low_rank"]
        assert out["bytes"] == eager["bytes"]
        for key, value in eager["weights"].items():  # the same names (no _orig_mod.) and the same model
            torch.testing.assert_close(out["weights"][key], value, rtol=0, atol=1e-6)


# -- resuming from the model's and the optimizer's state_dicts ---------------------------------------------

def _resumable(name: str, ckpt_dir: str, stop: int | None, resume: bool, load_optimizer: bool = True) -> dict:
    torch.manual_seed(0)
    method = _method(name)
    model = method.prepare(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
    method.attach(opt)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("abtrain").addHandler(handler)
    path = os.path.join(ckpt_dir, f"rank{method.topo.rank}.pt")
    start = 0
    if resume:
        state = torch.load(path)  # weights_only: what the checkpoint holds is plain data
        model.load_state_dict(state["model"])
        if load_optimizer:
            opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = state["step"]
    for step in range(start, STEPS if stop is None else stop):
        x, y = net_batch(step, method.topo.rank)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    if stop is not None:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "step": stop}, path)
        method.detach(finalize=False)
        return {}
    method.detach()
    return {"weights": _weights(method), "bytes": method.comm.ledger.wire_total, "steps": method.steps,
            "warnings": warnings}


@pytest.mark.parametrize("name", ["ab", "diloco", "sparseloco", "ef21"])
def test_resuming_from_model_and_optimizer_equals_the_uninterrupted_run(name, tmp_path):
    whole = run_world(_resumable, 4, name, str(tmp_path), None, False)
    run_world(_resumable, 4, name, str(tmp_path), 13, False)  # stops inside an AB phase, between two syncs
    resumed = run_world(_resumable, 4, name, str(tmp_path), None, True)
    for a, b in zip(whole, resumed):
        assert b["steps"] == a["steps"] == STEPS and b["bytes"] == a["bytes"] and not b["warnings"]
        for key, value in a["weights"].items():
            assert torch.equal(b["weights"][key], value), key


def test_loading_the_model_without_the_method_state_says_so(tmp_path):
    run_world(_resumable, 4, "ab", str(tmp_path), 13, False)
    out = run_world(_resumable, 4, "ab", str(tmp_path), None, True, False)
    assert len(out[0]["warnings"]) == 1 and "no ab state came with it" in out[0]["warnings"][0]
    assert not out[1]["warnings"]  # rank 0 alone says it


# -- no DistributedDataParallel around a prepared model ----------------------------------------------------

def _ddp_around(name: str) -> str:
    method = _method(name)
    model = torch.nn.parallel.DistributedDataParallel(method.prepare(Net()), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method.attach(opt)
    x, y = net_batch(0, method.topo.rank)
    try:
        F.cross_entropy(model(x), y).backward()
    except RuntimeError as exc:
        return str(exc)
    return "ran"


def _ddp_inside(name: str) -> dict:
    method = _method(name)
    model = method.prepare(torch.nn.parallel.DistributedDataParallel(Net()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method.attach(opt)
    for step in range(3):
        x, y = net_batch(step, method.topo.rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {"type": type(model).__name__, "calls": method.comm.ledger.summary()["calls"]}


@pytest.mark.parametrize("name", ["ab", "ef21", "diloco"])
def test_ddp_around_a_prepared_model_is_refused_and_inside_it_is_dropped(name):
    for message in run_world(_ddp_around, 4, name):
        assert "drop the DDP wrapper" in message and "ledger" in message
    inside = run_world(_ddp_inside, 4, name)[0]
    assert inside["type"] == "Net"  # the DDP handed to prepare() is dropped: only the ledger's collectives run


# -- every parameter's fate, and the summary of one's own loop ----------------------------------------------

class Tied(nn.Module):
    """An embedding tied to the output layer, a kept-by-name head, a norm: every kind of weight left full rank."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 64)
        self.body = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 64)
        self.out = nn.Linear(64, 16, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.head(self.norm(F.relu(self.body(self.embed(x))))))


def _fates() -> dict:
    torch.manual_seed(0)
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("abtrain").addHandler(handler)
    logging.getLogger("abtrain").setLevel(logging.INFO)
    method = abtrain.setup("ab", total_steps=STEPS, quiet=True, group_size=2, **AB)
    model = method.prepare(Tied())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    method.attach(opt)
    for step in range(8):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, 16, (16,), generator=g), torch.randint(0, 16, (16,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"lines": lines, "summary": method.summary(), "results": method.results()}


def test_every_parameter_fate_is_printed_and_the_summary_compares_with_ddp():
    out = run_world(_fates, 4)
    text = "\n".join(out[0]["lines"])
    assert "body.weight (64, 64) as 64x64: rank" in text
    assert "embed.weight: full rank: embedding" in text
    assert "head.weight: full rank: full-rank pattern 'head.*'" in text
    assert "out.weight: full rank: shared by several modules (tied weights)" in text
    assert "parameters of fewer than 2 dims (biases, norms): trained as they are" in text
    assert not out[1]["lines"] or not any("full rank" in line for line in out[1]["lines"])  # rank 0 alone prints
    results, summary = out[0]["results"], out[0]["summary"]
    assert results["steps"] == 8 and results["params"] == sum(
        p.numel() for p in Tied().parameters())  # the dense model, the tied weight counted once
    # DDP for the same 8 steps: a ring all-reduce of every parameter in fp32 over the 4 workers.
    assert results["ddp_equivalent"]["wire_bytes"] == pytest.approx(8 * 2 * 3 / 4 * 4 * results["params"])
    assert results["compression_ratio"] is not None and results["training_state_bytes"] > 0
    # DDP's training state of the dense model with AdamW: parameters, gradients, two moments, a step count a tensor
    tensors = len(list(Tied().parameters()))
    assert results["ddp_equivalent"]["training_state_bytes"] == 4 * 4 * results["params"] + 4 * tensors
    for piece in ("abtrain ab | 4 workers in groups of 2 | 8 steps", "compression", "training state",
                  "by phase", "DDP, same steps", "versus DDP"):
        assert piece in summary, piece


# -- the habits together, as a user's script under torchrun --------------------------------------------------

HABITS = Path(__file__).resolve().parent.parent / "examples" / "own_loop_habits.py"
QUICK = ["--epochs", "3", "--compile", "aot_eager"]  # the eager-graph backend: compiling for speed costs minutes


def _torchrun(*args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(HABITS), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


@pytest.mark.timeout(480)  # seven runs of the script under torchrun
def test_habits_script_clips_keeps_low_rank_accumulates_and_resumes_to_the_same_bits(tmp_path):
    whole = tmp_path / "whole.pt"
    out = _torchrun(*QUICK, "--out", str(whole))
    assert "versus DDP" in out and "training state" in out
    run = torch.load(whole)
    assert run["low_rank"] >= 2 and run["results"]["compression_ratio"] > 1  # compiled, and still low rank
    assert max(run["applied"]) <= 0.5 * (1 + 1e-5)  # clipping holds in every phase
    # Stopped after a checkpoint (4 steps after a sync) and resumed from the model's and the optimizer's
    # state_dicts: from each worker's own file, the same bits; from rank 0's file, which every worker loads, a run
    # that ends as well, rank 0 saying once what the resume gave up.
    _torchrun(*QUICK, "--ckpt-dir", str(tmp_path / "ckpt"), "--stop-after", "20", "--per-rank")
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt0")  # a resumed run checkpoints too: one copy each
    resumed = tmp_path / "resumed.pt"
    _torchrun(*QUICK, "--ckpt-dir", str(tmp_path / "ckpt"), "--resume", "--per-rank", "--out", str(resumed))
    again = torch.load(resumed)
    for key, value in run["weights"].items():
        assert torch.equal(again["weights"][key], value), key
    assert again["results"]["comm"]["wire_bytes"] == run["results"]["comm"]["wire_bytes"]
    from_rank0 = tmp_path / "from_rank0.pt"
    said = _torchrun(*QUICK, "--ckpt-dir", str(tmp_path / "ckpt0"), "--resume", "--out", str(from_rank0))
    assert said.count("a worker resuming from it in place of its own gives up every other group's 4 AB steps "
                      "since step 16") == 1
    other = torch.load(from_rank0)
    assert other["results"]["steps"] == run["results"]["steps"] and other["low_rank"] == run["low_rank"]
    assert other["accuracy"] > run["accuracy"] - 0.05  # the B-groups' 4 steps cost no accuracy worth the name
    # With method.gather_state() on every worker before rank 0 saves, rank 0's file resumes every worker exactly.
    _torchrun(*QUICK, "--ckpt-dir", str(tmp_path / "gathered"), "--stop-after", "20", "--gather")
    gathered = tmp_path / "gathered.pt"
    said = _torchrun(*QUICK, "--ckpt-dir", str(tmp_path / "gathered"), "--resume", "--out", str(gathered))
    assert "a worker resuming from it" not in said
    exact = torch.load(gathered)
    for key, value in run["weights"].items():
        assert torch.equal(exact["weights"][key], value), key
    # One micro-batch per step instead of two: the same bytes (no_sync() sends nothing).
    single = tmp_path / "single.pt"
    _torchrun(*QUICK, "--accumulate", "1", "--out", str(single))
    one = torch.load(single)
    assert {k: v["wire_bytes"] for k, v in one["results"]["comm"]["by_phase"].items()} == {
        k: v["wire_bytes"] for k, v in run["results"]["comm"]["by_phase"].items()}


_NETNS = netns.unavailable_reason()


@pytest.mark.skipif(_NETNS is not None, reason=f"needs network namespaces: {_NETNS}")
def test_habits_script_ledger_equals_the_bytes_on_the_links(tmp_path):
    """Each worker in a network namespace of its own: every byte it sends crosses its link, whose kernel
    counters must match the ledger (nothing sent around it, as a DDP wrapper's all-reduces would be)."""
    network = netns.Network(4, netns.NetSpec.parse("rate=1gbit,layout=worker"), node_size=1)
    out = tmp_path / "run.pt"
    with network:
        before = network.counters()
        port = free_port()
        procs = []
        for rank in range(4):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": network.address(0), "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": netns.IFNAME,
                   "OMP_NUM_THREADS": "1"}
            cmd = network.exec_prefix(rank) + [sys.executable, str(HABITS), *QUICK, "--out", str(out)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=300)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), logs[0][-3000:]
        after = network.counters()
    results = torch.load(out)["results"]
    measured = {"layout": "worker", "node_size": 1,
                "tx_bytes": [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)],
                "tx_packets": [a["tx_packets"] - b["tx_packets"] for a, b in zip(after, before)]}
    check = link_check(results, measured)
    print(f"\nown loop in 4 namespaces: ledger {check['ledger_bytes']:.0f} B/worker, links {check['tx_bytes_mean']:.0f} "
          f"B/worker (ratio {check['ratio']:.3f}; framed payload ratio {check['framed_payload_ratio']:.3f})",
          file=sys.stderr)
    assert check["expected_tx_bytes"] == pytest.approx(check["ledger_bytes"])  # one worker per node
    # The payload on the links (headers taken out) against the ledger's bytes plus gloo's framing: within 5 %.
    assert abs(check["framed_payload_ratio"] - 1) <= 0.05


# A user's script that initialises the world, then compiles: torch.compile imports torch._dynamo, which imports
# torch.distributed.nn, whose default arguments take group.WORLD at import. Without abtrain's care that default
# group outlived destroy_process_group(), as did the subgroup the method's Groups held, and their gloo threads
# met the interpreter's shutdown: now and then a worker aborted at exit after a run that succeeded.
NO_THREADS_LEFT = """
import os, sys
import torch, torch.distributed as dist
from torch import nn
import abtrain
from abtrain.comm import topology

dist.init_process_group("gloo")
method = abtrain.setup("ab", total_steps=6, quiet=True, warmup_steps=2, sync_every=2)
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
model = torch.compile(method.prepare(net), backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
method.attach(opt)
for _ in range(6):
    opt.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
method.detach()
if sys.argv[1] == "close":
    method.close()
dist.destroy_process_group()
if sys.argv[1] == "exit":
    topology._release_at_exit()  # what runs at exit, before the interpreter's shutdown
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
sys.stdout.write(f"gloo threads left {sum(n.startswith(('pt_gloo', 'gloo')) for n in names)}\\n")  # one write
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads in /proc")
@pytest.mark.parametrize("ending", ["close", "exit"])
def test_no_process_group_outlives_the_script_that_compiles_after_init(tmp_path, ending):
    """Closed, or only destroyed and at exit: no gloo thread is left once the script destroyed its world."""
    script = tmp_path / "script.py"
    script.write_text(NO_THREADS_LEFT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script), ending]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # the 4 workers' lines share one pipe and may run into each other
    assert re.findall(r"gloo threads left (\d+)", p.stdout) == ["0"] * 4, p.stdout  # a subgroup of 2 on every worker


def _exported_in_consensus() -> dict:
    torch.manual_seed(0)
    method = _method("ab")
    model = method.prepare(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    method.attach(opt)
    for step in range(15):  # inside an AB phase, between two syncs
        x, y = net_batch(step, method.topo.rank)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with method.consensus():
        mid = _weights(method)
    method.detach()
    return {"mid": mid, "end": _weights(method)}


def test_a_loop_ending_in_consensus_exports_one_model_bit_for_bit():
    out = run_world(_exported_in_consensus, 4)
    for rank in out[1:]:
        for when in ("mid", "end"):
            for key, value in out[0][when].items():
                assert torch.equal(rank[when][key], value), (when, key)
