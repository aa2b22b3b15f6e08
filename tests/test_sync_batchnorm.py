"""BatchNorm over every worker's batch (--ab-sync-batchnorm) in a real gloo world: values, gradients, bytes."""

import pytest
import torch
from torch import nn

from abtrain.comm.communicator import Communicator
from abtrain.comm.topology import Topology
from abtrain.methods.ab import ABConfig, ABTraining
from abtrain.methods.ab.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from helpers import run_world
from helpers import BNNet as Net  # a small model with a BatchNorm1d (``norm``) between linear layers

WORLD = 4
C = 3
BATCH = (5, C, 4, 4)  # each worker's batch of a 2-d BatchNorm; the workers' sizes differ below


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s input and the weights of its loss; each worker's batch has rank + 2 samples."""
    g = torch.Generator().manual_seed(100 + rank)
    shape = (rank + 2,) + BATCH[1:]
    return torch.randn(shape, generator=g) * (rank + 1) + rank, torch.randn(shape, generator=g)


def _layer() -> nn.BatchNorm2d:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(C, momentum=0.3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _module_world():
    topo = Topology.from_env(backend="gloo", device="cpu", group_size=2)
    comm = Communicator()
    model, count = convert_sync_batchnorm(nn.Sequential(_layer()), comm, topo.world)
    x, g = _inputs(topo.rank)
    x.requires_grad_(True)
    y = model(x)
    (y * g).sum().backward()
    model.eval()
    with comm.ledger.in_phase("eval"):
        y_eval = model(x.detach())
    rows = [dict(r) for r in comm.ledger.summary()["rows"]]
    out = {"rank": topo.rank, "count": count, "type": type(model[0]), "y": y.detach(), "x_grad": x.grad,
           "w_grad": model[0].weight.grad, "b_grad": model[0].bias.grad, "y_eval": y_eval,
           "buffers": {k: v.clone() for k, v in model.state_dict().items()}, "rows": rows}
    topo.close()
    return out


@pytest.fixture(scope="module")
def module_runs():
    return run_world(_module_world, WORLD)


def test_the_layer_normalises_with_every_workers_batch_and_backpropagates_the_sum_of_their_losses(module_runs):
    xs, gs = zip(*(_inputs(r) for r in range(WORLD)))
    sizes = [x.shape[0] for x in xs]
    # one BatchNorm over the workers' batches together: the outputs, the running statistics, and the
    # input's gradient of the sum of every worker's loss
    ref = _layer()
    x_all = torch.cat(xs).requires_grad_(True)
    y_all = ref(x_all)
    (y_all * torch.cat(gs)).sum().backward()
    for o in module_runs:
        r, start = o["rank"], sum(sizes[:o["rank"]])
        part = slice(start, start + sizes[r])
        assert o["count"] == 1 and o["type"] is SyncBatchNorm
        torch.testing.assert_close(o["y"], y_all[part].detach())
        torch.testing.assert_close(o["x_grad"], x_all.grad[part])
        torch.testing.assert_close(o["buffers"]["0.running_mean"], ref.running_mean)
        torch.testing.assert_close(o["buffers"]["0.running_var"], ref.running_var)
        assert o["buffers"]["0.num_batches_tracked"].item() == 1
        # the weight's and bias's gradients are the worker's own loss's (the method averages them)
        own = _layer()
        x_own = torch.cat(xs)
        y_own = own(x_own)
        (y_own[part] * gs[r]).sum().backward()
        torch.testing.assert_close(o["w_grad"], own.weight.grad)
        torch.testing.assert_close(o["b_grad"], own.bias.grad)
    # a plain BatchNorm on one worker's batch gives other statistics: the test tells them apart
    alone = _layer()
    assert not torch.allclose(alone(xs[1]), module_runs[1]["y"])


def test_the_layer_sends_its_formulas_bytes_and_nothing_in_evaluation(module_runs):
    for o in module_runs:
        ref = _layer()
        ref.load_state_dict({k.removeprefix("0."): v for k, v in o["buffers"].items()})
        ref.eval()
        torch.testing.assert_close(o["y_eval"], ref(_inputs(o["rank"])[0]))
        rows = {(row["op"], row["phase"]): row for row in o["rows"]}
        assert set(rows) == {("all_gather", "setup"), ("all_reduce", "setup")}  # no ledger phase outside a method
        gather, reduce = rows[("all_gather", "setup")], rows[("all_reduce", "setup")]
        assert (gather["calls"], gather["payload_bytes"], gather["group_size"]) == (1, 4 * (2 * C + 1), WORLD)
        assert gather["wire_bytes"] == (WORLD - 1) * 4 * (2 * C + 1)
        assert (reduce["calls"], reduce["payload_bytes"]) == (1, 4 * 2 * C)
        assert reduce["wire_bytes"] == 2 * (WORLD - 1) / WORLD * 4 * 2 * C


def _ab_world(sync_batchnorm: bool):
    topo = Topology.from_env(backend="gloo", device="cpu", group_size=2)
    comm = Communicator()
    torch.manual_seed(0)
    model = Net()
    keys = list(model.state_dict())
    method = ABTraining(comm, topo, ABConfig(warmup_steps=2, sync_every=10, rank_fraction=0.5, quiet=True,
                                             sync_batchnorm=sync_batchnorm))
    model = method.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    method.attach(opt)
    g = torch.Generator().manual_seed(topo.rank)
    stats = []
    for _ in range(5):  # 2 warm-up steps, 3 AB steps, no sync
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats.append((model.norm.running_mean.clone(), model.norm.running_var.clone(), method.phase_at(method.t - 1)))
    gathers = {row["phase"]: row["calls"] for row in comm.ledger.summary()["rows"] if row["op"] == "all_gather"}
    out = {"stats": stats, "gathers": gathers, "keys": (list(method.export()), keys),
           "type": type(model.norm)}
    method.detach()
    topo.close()
    return out


@pytest.mark.parametrize("sync_batchnorm", [True, False])
def test_ab_training_with_sync_batchnorm_keeps_one_set_of_statistics_between_syncs(sync_batchnorm):
    outs = run_world(_ab_world, WORLD, sync_batchnorm)
    phases = [phase for _, _, phase in outs[0]["stats"]]
    assert phases == ["warmup", "warmup", "ab", "ab", "ab"]
    same = all(torch.equal(o["stats"][step][i], outs[0]["stats"][step][i])
               for o in outs for step in range(5) for i in range(2))
    for o in outs:
        assert sorted(o["keys"][0]) == sorted(o["keys"][1])  # the exported model loads into the user's class as before
    if sync_batchnorm:
        assert same, "every worker's running statistics agree after every step"
        for o in outs:
            assert o["type"] is SyncBatchNorm
            assert o["gathers"] == {"warmup": 2, "ab": 3}  # one per training forward, in the step's phase
    else:
        assert not same, "without it the workers' statistics drift apart between syncs"
        assert all(o["gathers"] == {} for o in outs)
