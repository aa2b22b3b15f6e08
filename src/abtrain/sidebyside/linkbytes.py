"""What crosses the links between nodes: expected from a run's ledger, against the interface counters.

The ledger counts, per worker, the wire bytes of the ring model (``docs/accounting.md``); its ``global``
scope is the collectives over process groups that span more than one group of workers. The bench's
network measures something else: the bytes each *node's* interface sends (``--net``, one namespace per
node of ``g`` contiguous ranks; the workers of a node talk over its loopback, which the interface never
sees). The two are related through gloo's algorithms, measured on this network
(4 workers in 2 nodes, payload ``b``; ``tests/test_bench.py`` checks the all-reduce, the broadcast
and an all-reduce inside the nodes):

- **all-reduce** is a ring over the ranks in order (rank r sends to r+1). With contiguous nodes every
  node has exactly one outgoing ring edge that leaves it, so each node's link carries what *one* worker
  sends, 2(p−1)/p · b: node tx = the ledger's per-worker bytes, while the node's ``g`` workers together
  count ``g`` times that (measured: 1.50 b per node, p = 4). **all-gather** is a ring too:
  (p−1) · b per node (measured 3.01 b).
- **broadcast** goes out from the root's node only: every worker outside it receives one copy,
  (p − g) · b in all (measured 2.00 b from node 0, nothing from node 1), where the ledger counts
  (p−1)/p · b per worker.
- **gather** to one root: every worker outside the root's node sends what it hands in to the root, and
  the ledger counts that for it (the root hands in nothing). From a row's mean over the p workers,
  the bytes crossing are taken as the share (p − g)/(p − 1) of the p − 1 senders' total (exact when
  they send alike).
- **all-to-all** (pairwise): each worker sends (p−g)/p · b to other nodes (measured with
  the framing below taken out: 1.00 b per node at p = 4, g = 2).
- collectives over a group that fits inside one node (``group`` scope with groups = nodes) send nothing.

With one worker per node (``layout=worker``, g = 1) every collective crosses links and the same
formulas give back the ledger's totals exactly. The interface also carries what the ledger does not
model: TCP/IP and Ethernet headers (about 4.6 % of a full segment), acknowledgements, segments TCP
sent again, the rendezvous store (on rank 0's node) and the connection set-up; the check allows 10 %.

gloo frames every message, and that framing is on the links too (measured in ``tests/test_bench.py``):
each message a worker sends to another costs three 48-byte preambles of gloo's TCP transport, the
sender's "ready to send" notice and the data's own preamble going one way and the receiver's "ready
to receive" notice the other, so 144 bytes cross the link per message that crosses it
(:data:`FRAME_BYTES`). The ring all-reduce cuts the tensor into ``S`` = max(2p, ⌈b / 1 MiB⌉) segments
(rounded up to a multiple of p) and sends S − S/p of them in each of its two halves, so 12 messages
per call at p = 4 below 8 MiB: 1,728 bytes per node per call, measured 1,736; the all-gather sends
each worker's contribution in two halves, 2(p−1) messages per ring edge (864 bytes at p = 4,
measured 868); the broadcast and the all-to-all one message per pair of workers on different nodes
(measured 200 and 580 bytes against 192 and 576); the gather, an all-to-all whose splits are empty but
those to the root, as many as the all-to-all (measured 1,189 bytes per call against 1,152). The reduce-scatter (no method uses it, and the
:class:`~abtrain.comm.communicator.Communicator` issues none) is not modelled: gloo runs it as an all-reduce of
its whole input (``reduce_scatter_tensor``) or of each chunk of its input list (``reduce_scatter``),
so it sends twice the ring's (p−1)/p · b the ledger counts (measured: 1.5 b per node at p = 4,
g = 2), and where one crosses a node link the framing is left unknown (``None``), not counted as
none. For a run of many small collectives this is several per cent of the data:
:func:`gloo_framing_tx` sets it next to the expected data, and the check itself stays against the
data the ledger counts.

The headers are taken out as well: every packet the interface counts carries 66 bytes of them
(Ethernet 14, IPv4 20, TCP 20 with its 12-byte timestamp option; a TCP transfer of known size
through this network measures 66.0 per packet, ``tests/test_bench.py``), so ``tx − 66 · packets``
is the TCP payload each node sent, and an acknowledgement counts nothing. That payload against the
expected bytes says whether the ledger counts the data; many small messages, which fill fewer
bytes per packet and need more acknowledgements, move only the ratio of the raw bytes. The TCP
segments the node's namespace sent again (``RetransSegs``, loopback included) are reported next
to it: a shaped link that drops packets makes TCP resend them, and those bytes are in the payload.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..methods.summary import human_bytes
from .alphabeta import row_group_size

TOLERANCE = 0.10  # measured / expected within ±10 %
HEADER_BYTES = 66  # Ethernet + IPv4 + TCP with timestamps, per packet the interface counts
FRAME_BYTES = 3 * 48  # gloo's TCP preambles per message: send notice + data preamble one way, recv notice back
_GLOO_MAX_SEGMENT = 1 << 20  # gloo's ring all-reduce: largest segment one message carries


def _crossing_rows(rows: list[dict[str, Any]], world: int, g: int) -> Iterator[tuple[dict[str, Any], int]]:
    """The ledger rows that sent something over groups larger than a node of ``g`` workers, with that size.

    A group that sits inside one node (groups are nodes) is seen by the node's loopback only.
    """
    for row in rows:
        if row["calls"] > 0 and row["payload_bytes"] > 0:
            p = row_group_size(row, world)
            if p > g:
                yield row, p


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def ring_allreduce_messages(nbytes: int, element_size: int, p: int) -> float:
    """Messages one worker sends, on average over the ``p`` workers, in one gloo ring all-reduce of ``nbytes``.

    gloo cuts the tensor into segments (at least 2p, at most 1 MiB each, a multiple of p in number) and
    passes S − S/p of them to its ring neighbour in the reduce-scatter and as many in the all-gather,
    skipping those that fall past the tensor's end (only a tensor of a few elements has such).
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    max_segment = element_size * max(1, _GLOO_MAX_SEGMENT // element_size)
    segments = max(-(-nbytes // max_segment), 2 * p)
    segments = -(-segments // p) * p
    per_rank = segments // p
    segment = -(-(-(-nbytes // segments)) // element_size) * element_size
    span = segments * segment
    sent = 0
    for rank in range(p):
        for i in range(segments - per_rank):
            sent += ((((rank + 1) * per_rank + i) * segment) % span) < nbytes  # reduce-scatter
            sent += (((rank * per_rank + i) * segment) % span) < nbytes  # all-gather
    return sent / p


def gloo_framing_tx(rows: list[dict[str, Any]], world: int, node_size: int) -> float | None:
    """Bytes of gloo's message framing all node interfaces together send for a run's ledger ``rows``.

    ``None`` when it cannot be known: a reduce-scatter crosses a node link (its messages are not
    modelled), or a row does not say its dtype (results written before rows carried one).

    Each row's calls are taken at the row's mean size (exact when its calls have one size, and for the
    all-reduce whenever every call has at least 2p elements and at most 1 MiB per segment).
    """
    if not all("dtype" in row for row in rows):
        return None
    g = max(1, node_size)
    messages = 0.0
    for row, p in _crossing_rows(rows, world, g):
        instances = world / p
        calls = row["calls"]
        if row["op"] == "all_reduce":
            per_call = ring_allreduce_messages(row["payload_bytes"] // calls, _element_size(row["dtype"]), p)
            messages += (world / g) * calls * per_call  # one ring edge leaves each node
        elif row["op"] == "all_gather":
            messages += (world / g) * calls * 2 * (p - 1)
        elif row["op"] == "broadcast":
            messages += instances * calls * (p - g)
        elif row["op"] in ("all_to_all", "gather"):  # the gather is an all-to-all with empty splits but the root's
            messages += instances * calls * p * (p - g)
        elif row["op"] == "reduce_scatter":
            return None
        else:
            raise ValueError(f"unknown collective {row['op']!r}")
    return FRAME_BYTES * messages


def expected_link_tx(rows: list[dict[str, Any]], world: int, node_size: int) -> float:
    """Bytes all node interfaces together send for a run's ledger ``rows`` (per-worker means, summed over calls)."""
    g = max(1, node_size)
    total = 0.0
    for row, p in _crossing_rows(rows, world, g):
        instances = world / p  # the group's copies over the world (one for the world itself)
        if row["op"] in ("all_reduce", "all_gather", "reduce_scatter"):
            total += (world / g) * row["wire_bytes"]  # every node sends one worker's ring share
        elif row["op"] == "broadcast":
            total += instances * (p - g) * row["payload_bytes"]
        elif row["op"] == "gather":  # the senders outside the root's node: (p - g) of the p - 1
            total += instances * p * row["wire_bytes"] * (p - g) / (p - 1)
        elif row["op"] == "all_to_all":
            total += world * (p - g) / p * row["payload_bytes"]
        else:
            raise ValueError(f"unknown collective {row['op']!r}")
    return total


def link_check(results: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Measured node tx against the ledger: expected per node, the ratio, and whether it is within 10 %."""
    world = int(results["world_size"])
    node_size = int(measured.get("node_size", 1))
    nodes = max(1, world // node_size)
    tx = measured["tx_bytes"]
    mean_tx = sum(tx) / len(tx)
    expected = expected_link_tx(results["comm"]["rows"], world, node_size) / nodes
    comm = results["comm"]
    # What the ledger calls traffic between nodes: `global` when groups are nodes, everything when each worker is one.
    ledger = comm["by_scope"]["global"]["wire_bytes"] if node_size > 1 else comm["wire_bytes"]
    ratio = mean_tx / expected if expected > 0 else None
    framing = gloo_framing_tx(comm["rows"], world, node_size)
    framing = framing / nodes if framing is not None else None
    check = {"layout": measured.get("layout", "worker"), "node_size": node_size, "nodes": nodes,
             "tx_bytes_mean": mean_tx, "expected_tx_bytes": expected, "framing_tx_bytes": framing,
             "ledger_bytes": ledger,
             "ratio": ratio, "ratio_to_ledger": mean_tx / ledger if ledger > 0 else None,
             "within_tolerance": ratio is not None and abs(ratio - 1) <= TOLERANCE}
    packets = measured.get("tx_packets")
    if packets is not None and len(packets) == len(tx):
        payload = [t - HEADER_BYTES * p for t, p in zip(tx, packets)]
        mean_payload = sum(payload) / len(payload)
        check.update(payload_tx_bytes=payload, payload_tx_bytes_mean=mean_payload,
                     payload_ratio=mean_payload / expected if expected > 0 else None,
                     framed_payload_ratio=mean_payload / (expected + framing)
                     if framing is not None and expected + framing > 0 else None)
    return check


def render(rows: list[dict[str, Any]]) -> list[str]:
    """report.md's section on the bytes measured at each node's interface."""
    if not rows:
        return []
    node = rows[0]["measured"]["node_size"] > 1
    ledger = "ledger global / worker" if node else "ledger wire / worker"
    lines = ["", "## Measured on the wire", "",
             ("Bytes each node's interface sent during the run (`/proc/net/dev` in its namespace; a node is one "
              "group of workers, whose traffic inside the node stays on its loopback), against what the ledger "
              "predicts for the links between nodes under gloo's algorithms (ring all-reduce and all-gather: each "
              "node sends one worker's share; broadcast: the root's node sends one copy to every worker outside "
              "it; docs/bench.md). " if node else
              "Bytes each worker's interface sent during the run (`/proc/net/dev` in its namespace), against the "
              "ledger's counted wire bytes. ") + "TCP/IP headers, acknowledgements and the rendezvous are included "
             f"in the measurement; ✓ when it is within {TOLERANCE:.0%} of the expected figure. The TCP payload is "
             f"the measured bytes less {HEADER_BYTES} bytes of Ethernet, IP and TCP headers per packet sent "
             "(acknowledgements carry none); gloo framing: the 48-byte preambles gloo's TCP transport sends with "
             "every message (three per message, 144 bytes), modelled from the ledger's calls; resent: TCP segments "
             "the node sent again.", "",
             f"| method | {ledger} | expected tx / node | measured tx / node (mean) | measured / expected | "
             "measured / ledger | TCP payload / expected | gloo framing / node | TCP payload / (expected + framing) | "
             "resent segments | tx per node | counted bytes at the link rate | |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|:-:|"]
    for r in rows:
        m = r["measured"]
        at_rate = f"{m['ideal_wire_seconds']:.2f} s" if m.get("ideal_wire_seconds") is not None else "–"
        resent = m.get("tcp_retrans_segs")
        lines.append(
            f"| {r['method']} | {human_bytes(m['ledger_bytes'])} | {human_bytes(m['expected_tx_bytes'])} | "
            f"{human_bytes(m['tx_bytes_mean'])} | {_f(m['ratio'])} | {_f(m['ratio_to_ledger'])} | "
            f"{_f(m.get('payload_ratio'))} | "
            f"{human_bytes(m['framing_tx_bytes']) if m.get('framing_tx_bytes') is not None else '–'} | "
            f"{_f(m.get('framed_payload_ratio'))} | {sum(resent) if resent is not None else '–'} | "
            f"{', '.join(human_bytes(t) for t in m['tx_bytes'])} | {at_rate} | "
            f"{'✓' if m['within_tolerance'] else '✗'} |")
    return lines


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"
