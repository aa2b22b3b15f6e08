"""The own-loop API: attach/detach, consensus, export, the LR applied, setup's manners, the README snippet."""

import contextlib
import difflib
import io
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import abtrain
from abtrain.methods.ab import lowrank
from abtrain.api import as_keywords
from abtrain.comm.communicator import Communicator
from abtrain.comm.topology import Topology
from abtrain.methods import METHODS, ABConfig, ABTraining, Method, NoCommunication, build_method

from helpers import run_world

ROOT = Path(__file__).resolve().parent.parent


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _single(name: str) -> Method:
    if name == "ab":  # one process: only-b is the layout AB-training allows there
        return ABTraining(Communicator(), Topology(), ABConfig(sync="only-b", warmup_steps=1, sync_every=2,
                                                               min_rank=1))
    # Streaming DiLoCo's default 4 fragments need 4 modules with parameters; this MLP has 3.
    return build_method(name, Communicator(), Topology(), **({"fragments": 2} if name == "streaming-diloco" else {}))


@pytest.mark.parametrize("name", list(METHODS))
def test_attach_is_a_plain_call_until_detach(name):
    method = _single(name)
    model = method.prepare(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    method.after_step = lambda o, f=method.after_step: (calls.append(1), f(o))  # count the hook's calls
    method.attach(opt)
    assert method.attached
    with pytest.raises(ValueError, match="already attached"):
        method.attach(opt)
    _steps(model, opt, 3)
    with method.consensus():  # every method answers it; a world of one always agrees afterwards
        assert method.in_consensus()
    method.detach()
    assert not method.attached and len(calls) == 3
    _steps(model, opt, 2)  # no hooks any more
    assert len(calls) == 3
    method.detach()  # a second detach does nothing
    with method.attach(opt) as same:  # still a context manager
        assert same is method
        _steps(model, opt, 1)
    assert not method.attached and len(calls) == 4


def test_none_is_honest_about_consensus():
    method = NoCommunication(Communicator(), Topology(rank=0, world_size=2, local_world_size=2))
    assert method.in_consensus()
    method.after_step(None)
    assert not method.in_consensus()  # the workers drifted apart
    assert method.ready_for_evaluation()  # the trainer still evaluates each worker's own model


def test_export_loads_into_the_plain_class():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 16, 3, groups=2)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.classifier = nn.Linear(16, 4)

        def forward(self, x):
            h = self.conv(x).flatten(2).transpose(1, 2)
            return self.classifier(self.attn(h, h, h)[0].mean(1))

    torch.manual_seed(0)
    model = Net()
    records = lowrank.prepare_model(model, full_rank_patterns=(), min_rank=1)
    for fp in records:
        lowrank.decompose(fp, 2)  # low rank: the forward uses A·B
    method = Method(Communicator(), Topology())
    method.prepare(model)
    state = method.export()
    assert not any("parametrizations" in k for k in state)
    plain = Net()
    plain.load_state_dict(state)  # strict: same keys and shapes as the user's class
    x = torch.randn(2, 8, 6, 6)
    with torch.no_grad():
        assert torch.allclose(plain(x), model(x), atol=1e-5)


def test_last_lr_is_the_lr_applied():
    cfg = ABConfig(sync="only-b", warmup_steps=2, sync_every=4, rebound_steps=0, lr_rebound_steps=4, min_rank=1,
                   lr_floor=0.0)
    method = ABTraining(Communicator(), Topology(), cfg)
    model = method.prepare(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert method.last_lr is None
    with method.attach(opt):
        _steps(model, opt, 3)  # the third step is the first after the decomposition at step 2: the ramp's first
        assert method.last_lr == pytest.approx(0.1 / 4)
        assert opt.param_groups[0]["lr"] == 0.1  # the optimizer keeps the scheduled value
        assert method.lr_scale() == pytest.approx(2 / 4)  # what the next step will apply


def test_quiet_and_printed_once(capsys):
    abtrain.setup("ab", total_steps=40, sync="only-b")
    out = capsys.readouterr().out
    # 1 % of the 40 steps, and 1.5 % of them (every 1) raised to the floor
    assert out.count("AB-training schedule: warm-up 0 steps, sync every 16 (the floor, --ab-min-sync-every: "
                     "--ab-sync-fraction gives every 2 in a run this short)") == 1
    abtrain.setup("ab", total_steps=40, sync="only-b", quiet=True)
    abtrain.setup("ab", sync="only-b", warmup_steps=4, sync_every=4, quiet=True)  # planned while built
    assert capsys.readouterr().out == ""


def test_library_errors_name_keywords():
    with pytest.raises(ValueError) as err:
        abtrain.setup("ab", total_steps=10)  # one process
    assert "world of one process" in str(err.value) and "torchrun --nproc-per-node 2" in str(err.value)
    assert "sync='only-b'" in str(err.value) and "--ab" not in str(err.value)
    with pytest.raises(ValueError, match=r"^warmup_steps must be an integer >= 0") as err:
        abtrain.setup("ab", total_steps=10, sync="only-b", warmup_steps=-1)
    assert "--ab" not in str(err.value)
    assert as_keywords("pass e.g. --group-size 2, or --no-ab-keep-output", "ab") == "pass e.g. group_size=2, or keep_output=False"


def test_unknown_keywords_are_one_line_each():
    """Not Python's TypeError from inside the build: the misspelt name with the closest, one an earlier abtrain
    had as any other; a build's own parameters (DDP's bucket size) are options too."""
    with pytest.raises(ValueError, match=r"^setup\('ab'\) has no option 'tua'; did you mean tau\?$"):
        abtrain.setup("ab", tua=0.1)
    with pytest.raises(ValueError, match=r"^setup\('ab'\) has no option 'sync_flush'"):
        abtrain.setup("ab", sync_flush=True)
    with pytest.raises(ValueError, match=r"^setup\('ddp'\) has no option 'rank'; its options: bucket_cap_mb$"):
        abtrain.setup("ddp", rank=3)
    with pytest.raises(ValueError, match=r"has no option 'rnk'; did you mean rank\?"):
        abtrain.setup("powersgd", rnk=2)
    abtrain.setup("ddp", bucket_cap_mb=1.0).close()  # one process: communication skipped


def _setup_in_users_world(steps: int, split: str) -> dict:
    """The user's script initialised the world; abtrain joins it and leaves it to them."""
    dist.init_process_group("gloo")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # phases of several steps (the defaults' sync every 1.5 % of 100 steps would leave one step between syncs)
        method = abtrain.setup("ab", total_steps=steps, rank_fraction=0.5, min_rank=1, split=split,
                               warmup_fraction=0.5, sync_fraction=0.06)
    torch.manual_seed(dist.get_rank())  # different initial weights: prepare() must broadcast rank 0's
    model = method.prepare(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method.attach(opt)
    result = {"groups": method.topo.num_groups, "group_size": method.topo.group_size, "stdout": out.getvalue(),
              "owns": method.topo.owns_world}
    K = method.schedule.sync_every
    # Train until inside an AB phase, with the next step still in it (each worker its own data).
    while method.in_consensus() or (method.t + 1) % K == 0:
        assert method.t < steps
        _steps(model, opt, 1, seed=100 * dist.get_rank() + method.t)
    result["apart"] = True
    ranks = {fp.name: fp.rank for fp in method.records if fp.mode == "lowrank"}
    syncs_before = method.comm.ledger.summary()["by_phase"].get("sync", {}).get("calls", 0)
    merged = {}  # W as the sync formed it, before the re-split (which releases W's storage)
    resplit = method.decomposer.factorise

    def spy(records, *args, **kwargs):
        merged.update({fp.name: fp.effective_weight().clone() for fp in records})
        return resplit(records, *args, **kwargs)

    method.decomposer.factorise = spy
    with method.consensus():
        result["weights"] = {k: v.clone() for k, v in method.export().items()}
        result["exact"] = all(torch.allclose(merged[fp.name], (fp.A @ fp.B).reshape(fp.shape), atol=1e-5)
                              and fp.weight.numel() == 0 for fp in method.records if fp.mode == "lowrank")
    method.decomposer.factorise = resplit
    calls = method.comm.ledger.summary()["calls"]
    method.consensus()  # they agree now: nothing is sent
    result["noop"] = method.comm.ledger.summary()["calls"] == calls
    result["synced"] = method.comm.ledger.summary()["by_phase"]["sync"]["calls"] > syncs_before
    result["same_ranks"] = ranks == {fp.name: fp.rank for fp in method.records if fp.mode == "lowrank"}
    result["phase"] = method.phase
    # The rest of the phase trains this worker's factor, not W.
    before = {fp.name: (fp.A.detach().clone(), fp.B.detach().clone()) for fp in method.records if fp.mode == "lowrank"}
    _steps(model, opt, 1, seed=7)
    result["trained"] = {name: (not torch.equal(a, fp.A), not torch.equal(b, fp.B), fp.weight.grad is None)
                         for fp in method.records for name, (a, b) in [(fp.name, before.get(fp.name, (fp.A, fp.B)))]
                         if fp.name in before}
    result["role"] = method.role
    method.detach()
    method.close()
    result["still_initialised"] = dist.is_initialized()
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("split", ["sqrt", "tangent"])
def test_setup_on_one_node_consensus_mid_phase_and_users_world(split):
    outs = run_world(_setup_in_users_world, 2, 100, split)
    for r, o in enumerate(outs):
        assert (o["groups"], o["group_size"]) == (2, 1)  # one node of 2: split into 2 groups
        assert not o["owns"] and o["still_initialised"]  # joined the user's world; close() left it alone
        # the first AB phase keeps full rank, so both splits' syncs re-split exactly at the phase's ranks
        assert o["apart"] and o["synced"] and o["exact"] and o["same_ranks"] and o["noop"]
        assert o["phase"] == "ab"
        for a_moved, b_moved, w_untouched in o["trained"].values():
            assert w_untouched and (a_moved, b_moved) == ((True, False) if o["role"] == "A" else (False, True))
    for k, v in outs[0]["weights"].items():
        if split == "sqrt":
            assert torch.equal(v, outs[1]["weights"][k]), k  # one model inside consensus()
        else:  # one W, split U·σ | Vᵀ on one worker and U | σ·Vᵀ on the other: equal up to the products' rounding
            torch.testing.assert_close(v, outs[1]["weights"][k], rtol=1e-5, atol=1e-6)
    lines = outs[0]["stdout"].splitlines()
    assert lines[0] == "abtrain: AB-training: one node of 2 workers: 2 groups of 1 (set group_size= to choose)"
    assert sum("AB-training schedule" in ln for ln in lines) == 1
    assert outs[1]["stdout"] == ""  # rank 0 only


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## AB-training in your own loop"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_readme(workdir: str) -> dict:
    os.chdir(workdir)
    torch.manual_seed(0)
    model = _mlp()
    g = torch.Generator().manual_seed(1 + int(os.environ["RANK"]))
    loader = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(5)]
    epochs = 4
    seen = []

    def evaluate(m):  # the model's output on one fixed input (the groups' factors differ under the tangent split)
        with torch.no_grad():
            seen.append(m(torch.ones(2, 8)))

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(readme_snippet(), {"abtrain": abtrain, "torch": torch, "F": F, "model": model, "loader": loader,
                                "epochs": epochs, "evaluate": evaluate})
    return {"seen": seen, "stdout": out.getvalue()}


def test_readme_snippet_runs_as_written(tmp_path):
    outs = run_world(_run_readme, 2, str(tmp_path))
    assert len(outs[0]["seen"]) == len(outs[1]["seen"]) == 4
    for a, b in zip(outs[0]["seen"], outs[1]["seen"]):  # every evaluation on one model
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    model = _mlp()
    model.load_state_dict(torch.load(tmp_path / "model.pt"))  # the plain class takes the exported weights


def test_conversion_diff_is_six_lines_and_the_example_is_it():
    """docs/own-loop.md's before/after: 6 lines new or changed, as `diff` counts them; the example marks the same 6."""
    text = (ROOT / "docs" / "own-loop.md").read_text()
    block = re.search(r"```diff\n(.*?)```", text, re.S).group(1).splitlines()
    before = [ln[1:] for ln in block if ln[:1] in (" ", "-", "")]
    after = [ln[1:] for ln in block if ln[:1] in (" ", "+", "")]
    ops = difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes()
    added = sum(j2 - j1 for tag, _, _, j1, j2 in ops if tag in ("replace", "insert"))
    removed = sum(i2 - i1 for tag, i1, i2, _, _ in ops if tag in ("replace", "delete"))
    assert (added, removed) == (6, 3)
    assert "model = DDP(model)" not in after and "import abtrain" in after
    example = (ROOT / "examples" / "own_loop.py").read_text().splitlines()
    marked = [ln for ln in example if re.search(r"\S  # abtrain( \(was: .*\))?$", ln)]
    assert len(marked) == 6 and not any(ln.strip().startswith("model = DDP(") for ln in example)


def _state_capped_ranks(memory_dtype: str) -> dict:
    method = abtrain.setup("ab", total_steps=3, quiet=True, warmup_steps=0, sync_every=3, rank_fraction=1.0,
                           rank_cap="state", sync_memory_dtype=memory_dtype)
    model = method.prepare(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                         nn.Linear(256, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # no momentum: no per-element optimizer state
    with method.attach(opt):
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
    ranks = method.ranks[0]["layers"]
    method.close()
    return ranks


@pytest.mark.parametrize("memory_dtype, share", [("fp32", 1.0), ("bf16", 0.5)])
def test_the_state_cap_counts_the_syncs_error_memory_at_its_width(memory_dtype, share):
    """--ab-rank-cap state keeps the layer within DDP's state for W, counting the low-rank sync's m x n error
    memory at its width (half in bf16) beside the warm-start Qs of the sync (64) and of the full-rank phases'
    PowerSGD (31)."""
    ranks = run_world(_state_capped_ranks, 2, memory_dtype)[0]
    assert ranks["2.weight"] == lowrank.state_rank(256, 256, 0, memory=share, extra=(64 + 31) * 256)
    assert ranks["2.weight"] == {"fp32": 40, "bf16": 72}[memory_dtype]
