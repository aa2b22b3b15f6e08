"""Byte formulas, the ledger's bookkeeping, and single-process communication (skipped collectives)."""

import pytest
import torch

from abtrain.comm.communicator import Communicator
from abtrain.comm.group import Group
from abtrain.comm.ledger import Ledger, wire_bytes


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_wire_formulas(p):
    b = 1000
    assert wire_bytes("all_reduce", b, p) == pytest.approx(2 * (p - 1) / p * b)
    assert wire_bytes("reduce_scatter", b, p) == pytest.approx((p - 1) / p * b)
    assert wire_bytes("broadcast", b, p) == pytest.approx((p - 1) / p * b)
    assert wire_bytes("all_gather", b, p) == pytest.approx((p - 1) * b)
    assert wire_bytes("all_to_all", b, p) == pytest.approx((p - 1) / p * b)
    assert wire_bytes("gather", b, p) == (b if p > 1 else 0)  # what this worker sends the root (which hands in nothing)


def test_single_worker_sends_nothing():
    assert wire_bytes("all_reduce", 4096, 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        wire_bytes("gossip", 1, 2)


def test_ledger_aggregates_by_scope_and_phase():
    ledger = Ledger()
    world = Group("world", 4, "global")
    node = Group("group", 2, "group")
    t32 = torch.zeros(10)
    t16 = torch.zeros(8, dtype=torch.bfloat16)
    with ledger.in_phase("train"):
        ledger.record("all_reduce", world, t32, 0.5)
        ledger.record("all_reduce", world, t32, 0.25)
        ledger.record("all_reduce", node, t16, 0.0)
    with ledger.in_phase("sync"):
        ledger.record("broadcast", world, t32, 0.0)
    assert ledger.phase == "setup"
    s = ledger.summary()
    assert s["calls"] == 4
    assert s["payload_bytes"] == 40 + 40 + 16 + 40
    assert s["by_scope"]["global"]["wire_bytes"] == pytest.approx(2 * 1.5 * 40 + 0.75 * 40)
    assert s["by_scope"]["group"]["wire_bytes"] == pytest.approx(16.0)
    assert s["by_phase"]["train"]["payload_bytes"] == 96
    assert s["by_phase"]["sync"]["payload_bytes"] == 40
    assert s["by_phase"]["train"]["seconds"] == pytest.approx(0.75)
    restored = Ledger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.summary() == s


def test_ledger_labels_come_from_the_followed_method_and_rows_carry_the_group_size():
    class Stepper:  # stands for an attached method: its phase changes with its step
        phase = "warmup"

    ledger = Ledger()
    world, node = Group("world", 4, "global"), Group("group", 2, "group")
    ledger.record("broadcast", world, torch.zeros(2), 0.0)  # before any method: setup
    method = Stepper()
    ledger.follow(method)
    ledger.record("all_reduce", world, torch.zeros(2), 0.0)
    method.phase = "ab"
    ledger.record("all_reduce", node, torch.zeros(2), 0.0)
    with ledger.in_phase("sync"):  # a block's label wins over the method's
        ledger.record("all_reduce", world, torch.zeros(2), 0.0)
    assert ledger.phase == "ab"
    rows = [(r["op"], r["group"], r["group_size"], r["phase"]) for r in ledger.summary()["rows"]]
    assert rows == [("all_reduce", "group", 2, "ab"), ("all_reduce", "world", 4, "sync"),
                    ("all_reduce", "world", 4, "warmup"), ("broadcast", "world", 4, "setup")]


def test_disabled_ledger_records_nothing():
    ledger = Ledger(enabled=False)
    ledger.record("all_reduce", Group("world", 4, "global"), torch.zeros(3), 0.0)
    assert ledger.summary()["calls"] == 0


def test_single_process_is_same_code_with_communication_skipped():
    comm = Communicator()
    solo = Group("world", 1, "group")
    t = torch.arange(6.0)
    assert comm.all_reduce(t, solo, average=True) is t
    assert torch.equal(t, torch.arange(6.0))
    assert comm.all_gather(t, solo)[0] is t
    comm.all_reduce_tensors([t], solo)
    assert comm.all_reduce_async(t, solo).wait() is t
    assert comm.ledger.summary()["calls"] == 0


def test_group_scope_is_validated():
    with pytest.raises(ValueError, match="scope"):
        Group("world", 2, "planet")


class _Event:
    """Stands in for a CUDA event: a time stamp in milliseconds, finished or not."""

    def __init__(self, ms, done=True):
        self.ms, self.done, self.waited = ms, done, False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = self.done = True

    def elapsed_time(self, end):
        return end.ms - self.ms


def test_device_collective_times_are_read_at_the_summary_not_at_the_collective(monkeypatch):
    ledger = Ledger()
    world = Group("world", 2, "global")
    end = _Event(250.0, done=False)
    ledger.record("all_reduce", world, torch.zeros(4), 0.0, (_Event(0.0), end))
    assert not end.waited and ledger.device_times.pending  # nothing waited for the device yet
    assert ledger.summary()["seconds"] == pytest.approx(0.25) and end.waited
    assert not ledger.device_times.pending
    # Many pending pairs: the finished ones are read without waiting, the others stay.
    monkeypatch.setattr(type(ledger.device_times), "LIMIT", 2)
    late = _Event(40.0, done=False)
    ledger.record("all_reduce", world, torch.zeros(4), 0.0, (_Event(0.0), _Event(10.0)))
    ledger.record("all_reduce", world, torch.zeros(4), 0.0, (_Event(0.0), late))
    assert len(ledger.device_times.pending) == 1 and not late.waited
    assert ledger.summary()["seconds"] == pytest.approx(0.25 + 0.01 + 0.04)


@pytest.mark.parametrize("differ", [None, 3])
def test_digest_tells_whether_every_worker_holds_the_same_tensors(differ):
    """same_everywhere: one all-reduce of 32 bytes; True on every worker when all hold the same bits, False on
    every worker when one worker's tensors differ in a single bit."""
    from abtrain.comm.digest import same_everywhere
    from abtrain.comm.recording import LocalWorld

    world = LocalWorld(4)

    def worker(comm):
        tensors = [torch.arange(12, dtype=torch.float32).view(3, 4), torch.ones(5, dtype=torch.int64)]
        if comm.rank == differ:
            tensors[0].view(torch.int32)[1, 2] ^= 1  # one bit of one element
        return same_everywhere(comm, world.group, tensors), [(c.op, c.payload_bytes) for c in comm.calls]

    for same, calls in world.run(worker):
        assert same is (differ is None) and calls == [("all_reduce", 32)]


def test_gathered_parts_reach_rank_0_whole_with_each_distinct_tensor_sent_once():
    """gather_parts: rank 0 gets every worker's part, each resolved to the tensors it held (copies: equal values
    do not share storage); the others get None. Workers 0 and 1 hold one large tensor, 2 and 3 another (a group's
    factors), each worker a small one of its own: rank 1 and rank 3 send only their small ones, rank 2 its large
    one, rank 0 nothing. The ledger: the digests' lengths and the digests (all-gathers), the parts' lengths, the
    gather, whose wire bytes are what each worker sent."""
    from abtrain.comm.recording import LocalWorld
    from abtrain.methods.resume import TENSORS, _resolved, gather_parts, unpack, worker_key

    world = LocalWorld(4)
    large = [torch.arange(100_000, dtype=torch.float32) + g for g in (0, 1)]  # 400 kB each

    def part(rank):
        return {"writer": {"rank": rank}, "optimizer": {0: {"exp_avg": large[rank // 2].clone(), "step": 3}},
                "state": {"errors": [torch.full((4,), float(rank)), torch.zeros(4)], "role": "AB"[rank // 2]},
                "model": {"bias": torch.zeros(4), "slice": torch.arange(100_000.0)[rank:rank + 4]}}  # a view: alone

    def worker(comm):
        got = gather_parts(comm, world.group, part(comm.rank), torch.device("cpu"))
        rows: dict[str, list[int | float]] = {}
        for key, row in comm.ledger.rows.items():
            total = rows.setdefault(key[0], [0, 0, 0.0])
            total[0] += row.calls
            total[1] += row.payload_bytes
            total[2] += row.wire_bytes
        return got, rows

    results = world.run(worker)
    got = results[0][0]
    assert sorted(got) == [TENSORS] + [worker_key(r) for r in range(4)]
    tensors = unpack(got[TENSORS])
    assert len(tensors) == 2 + 3 + 1 + 4  # the two large, ranks 1-3's own small ones, the zeros (rank 0's own,
    # every worker's second error and bias), the four slices
    for rank in range(4):
        back, want = _resolved(unpack(got[worker_key(rank)]), tensors), part(rank)
        assert back["writer"] == want["writer"] and back["state"]["role"] == want["state"]["role"]
        assert back["optimizer"][0]["step"] == 3 and torch.equal(back["optimizer"][0]["exp_avg"], large[rank // 2])
        assert all(torch.equal(a, b) for a, b in zip(back["state"]["errors"], want["state"]["errors"]))
        assert back["state"]["errors"][1].data_ptr() != back["model"]["bias"].data_ptr()  # equal, not shared
        assert torch.equal(back["model"]["slice"], want["model"]["slice"])
    sent = []
    for rank, (result, rows) in enumerate(results):
        assert (result is None) == (rank != 0)
        assert sorted(rows) == ["all_gather", "gather"] and rows["all_gather"][0] == 3
        calls, payload, wire = rows["gather"]
        assert calls == 1 and wire == payload == wire_bytes("gather", payload, 4)
        sent.append(payload)
    assert sent[0] == 0 and sent[1] < 10_000 and sent[3] < 10_000 and 400_000 < sent[2] < 410_000


def test_ledger_peak_step_counts_global_traffic_between_step_ends():
    """peak_global_step_bytes: the global wire bytes between two end_step calls (a sync after the step's update
    included), the most of any step; traffic inside a group, the setup and evaluations do not count. What follows
    the last step (a last sync) is the run's end, end_global_bytes, not a step."""
    ledger = Ledger()
    world, group = Group("world", 4, "global"), Group("group", 2, "group")
    ledger.record("broadcast", world, torch.zeros(1000), 0.0)  # setup: not a step
    with ledger.in_phase("train"):
        ledger.record("all_reduce", world, torch.zeros(10), 0.0)
        ledger.record("all_reduce", group, torch.zeros(500), 0.0)  # inside a group
    ledger.end_step(1)
    with ledger.in_phase("train"):
        ledger.record("all_reduce", world, torch.zeros(10), 0.0)
    with ledger.in_phase("sync"):
        ledger.record("all_reduce", world, torch.zeros(30), 0.0)
    with ledger.in_phase("eval"):
        ledger.record("all_reduce", world, torch.zeros(100), 0.0)
    ledger.end_step(2)
    assert (ledger.peak_global_step_bytes, ledger.peak_global_step) == (wire_bytes("all_reduce", 160, 4), 2)
    with ledger.in_phase("sync"):
        ledger.record("all_reduce", world, torch.zeros(50), 0.0)  # after the last end_step: the run's end
    summary = ledger.summary()
    assert (summary["peak_global_step_bytes"], summary["end_global_bytes"]) == (wire_bytes("all_reduce", 160, 4),
                                                                                wire_bytes("all_reduce", 200, 4))
    restored = Ledger()
    restored.load_state_dict(ledger.state_dict())
    assert {k: restored.summary()[k] for k in ("peak_global_step_bytes", "end_global_bytes")} == \
        {k: summary[k] for k in ("peak_global_step_bytes", "end_global_bytes")}
