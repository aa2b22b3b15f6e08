"""A real constrained network on one Linux machine: one network namespace per node.

A *node* is a network namespace: ``<name>-n<j>`` in the ``node`` layout, where
the workers of one group share a node, or ``<name>-w<j>`` in the ``worker``
layout, where every worker is a node of its own. Node ``j`` has one interface
``abt0`` (address 10.213.0.<j+1>/24), the end of a veth pair whose other end
(``w<j>``) is a port of a bridge in a namespace of its own (``<name>-br``).
Nothing is created in the root namespace, and the namespaces have no route
anywhere else: all traffic stays between the workers.

``tc`` shapes both directions of every node's link: the node's egress
(``abt0``) gets the rate and the one-way delay, the bridge's egress towards
the node (``w<j>``) the rate. A message from one node to another thus
crosses one delay and two rate limits: a star of full-duplex links. Workers
of one node reach each other over the node's own loopback (a packet to one's
own address never leaves through ``abt0``): unshaped, and not counted on
``abt0``.

Names carry the creating process id (``abtb-<pid>-<token>``), so namespaces
left by a process that no longer exists can be found and removed
(:func:`cleanup_stale`). Deleting a namespace deletes its interfaces, their
veth peers and their qdiscs, so tear-down is "delete our namespaces".
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass

log = logging.getLogger(__name__)

PREFIX = "abtb-"
IFNAME = "abt0"
SUBNET = "10.213.0"  # private; only ever inside our own namespaces

_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
               "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class NetworkError(RuntimeError):
    """Setting up or using the namespaces failed; the message says which command and why."""


LAYOUTS = ("node", "worker")


@dataclass(frozen=True)
class NetSpec:
    """``rate=100mbit,delay=2ms,layout=node``: each node link's rate (tc units), one-way delay, and what a node
    is (``node``: the workers of one group; ``worker``: one worker; unset: ``node`` when groups have more than
    one worker)."""

    rate: str | None = None
    delay: str | None = None
    layout: str | None = None

    @classmethod
    def parse(cls, text: str) -> "NetSpec":
        values: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("rate", "delay", "layout"):
                raise ValueError(f"--net takes rate=RATE,delay=DELAY,layout=node|worker (e.g. rate=100mbit,delay=2ms), "
                                 f"got {item!r}")
            values[key] = value.strip().lower()
        spec = cls(**values)
        if spec.layout is not None and spec.layout not in LAYOUTS:
            raise ValueError(f"--net layout={spec.layout}: choose node (the workers of one group share a namespace) "
                             f"or worker (one namespace per worker)")
        if spec.rate is None and spec.delay is None:
            raise ValueError("--net needs rate= and/or delay=, e.g. rate=100mbit,delay=2ms")
        spec.rate_bytes_per_s, spec.delay_seconds  # validate both
        return spec

    @property
    def rate_bytes_per_s(self) -> float | None:
        if self.rate is None:
            return None
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", self.rate)
        if not m or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
            raise ValueError(f"--net rate={self.rate}: expected a positive number with one of the units "
                             f"{', '.join(_RATE_UNITS)} (tc's: mbit = 10^6 bit/s, mbps = 10^6 bytes/s)")
        return float(m.group(1)) * _RATE_UNITS[m.group(2)]

    @property
    def delay_seconds(self) -> float:
        if self.delay is None:
            return 0.0
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", self.delay)
        if not m:
            raise ValueError(f"--net delay={self.delay}: expected a number with us, ms or s (e.g. 2ms)")
        return float(m.group(1)) * _DELAY_UNITS[m.group(2)]

    def describe(self) -> str:
        parts = [f"rate {self.rate}" if self.rate else "unlimited rate"]
        parts.append(f"one-way delay {self.delay}" if self.delay else "no added delay")
        return ", ".join(parts) + " per node link"

    def node_size(self, group_size: int) -> int:
        """Workers per node: the group size in the ``node`` layout (the default), 1 in the ``worker`` layout."""
        return 1 if self.layout == "worker" else max(1, group_size)


def check_available() -> None:
    """ValueError with one line when namespaces cannot be made here (not Linux, not root, no iproute2)."""
    if not sys.platform.startswith("linux"):
        raise ValueError("--net needs Linux network namespaces; run without --net on this system")
    if os.geteuid() != 0:
        raise ValueError("--net needs root (it creates network namespaces, veth links and tc qdiscs); "
                         "run as root or without --net")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ValueError(f"--net needs iproute2 ({' and '.join(missing)} not found); install iproute2 or run without --net")


def _run(cmd: list[str]) -> str:
    """Run one iproute2 command; NetworkError with its message when it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        message = (p.stderr or p.stdout).strip().splitlines()
        raise NetworkError(f"'{' '.join(cmd)}' failed: {message[-1] if message else f'exit code {p.returncode}'}")
    return p.stdout


def our_namespaces() -> list[str]:
    """Every namespace whose name carries our prefix, whoever created it."""
    try:
        out = _run(["ip", "netns", "list"])
    except (NetworkError, OSError):
        return []
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _owner_alive(ns: str) -> bool:
    m = re.match(re.escape(PREFIX) + r"(\d+)-", ns)
    if not m:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_namespaces() -> list[str]:
    """The namespaces of our prefix whose bench process no longer runs (another bench's running ones are not)."""
    return [ns for ns in our_namespaces() if not _owner_alive(ns)]


def cleanup_stale() -> list[str]:
    """Delete the namespaces left by a bench process that no longer runs; returns their names."""
    stale = stale_namespaces()
    for ns in stale:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
    return stale


class Network:
    """One namespace per node of ``node_size`` workers (contiguous ranks), joined by veth pairs to one bridge,
    shaped by tc; a context manager.

    ``setup`` either completes or removes everything it created before
    raising; ``teardown`` is idempotent and safe after any partial set-up.
    """

    def __init__(self, workers: int, spec: NetSpec, node_size: int = 1) -> None:
        if node_size < 1 or workers % node_size:
            raise ValueError(f"--net: {workers} workers cannot be split into nodes of {node_size}")
        if not 1 <= workers // node_size <= 250:
            raise ValueError(f"--net supports 1 to 250 nodes, got {workers // node_size}")
        self.workers = workers
        self.node_size = node_size
        self.nodes = workers // node_size
        self.spec = spec
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.bridge_ns = f"{self.name}-br"
        self.created: list[str] = []

    @property
    def layout(self) -> str:
        return "worker" if self.node_size == 1 else "node"

    # -- addresses and names ----------------------------------------------
    def namespace(self, j: int) -> str:
        """Node ``j``'s namespace (in the ``worker`` layout node ``j`` is worker ``j``)."""
        return f"{self.name}-{'w' if self.node_size == 1 else 'n'}{j}"

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def address(self, j: int) -> str:
        """Node ``j``'s address."""
        return f"{SUBNET}.{j + 1}"

    def exec_prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside the namespace of worker ``rank``'s node."""
        return ["ip", "netns", "exec", self.namespace(self.node_of(rank))]

    # -- life cycle ---------------------------------------------------------
    def __enter__(self) -> "Network":
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self.created.append(ns)
        # No IPv6: router solicitations and neighbour discovery would add bytes no collective sent.
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
                        "net.ipv6.conf.default.disable_ipv6=1"], capture_output=True, timeout=30)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def setup(self) -> None:
        try:
            self._add_namespace(self.bridge_ns)
            _run(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
            for k in range(self.nodes):
                ns, port = self.namespace(k), f"w{k}"
                self._add_namespace(ns)
                _run(["ip", "-n", self.bridge_ns, "link", "add", port, "type", "veth",
                      "peer", "name", IFNAME, "netns", ns])
                _run(["ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", IFNAME])
                self._shape(ns, IFNAME, delay=True)
                self._shape(self.bridge_ns, port, delay=False)
                _run(["ip", "-n", self.bridge_ns, "link", "set", port, "up"])
                _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
        except BaseException:
            self.teardown()
            raise

    def _shape(self, ns: str, dev: str, delay: bool) -> None:
        rate = self.spec.rate_bytes_per_s
        tbf: list[str] = []
        if rate is not None:
            # Burst: at least one 64 KiB GSO segment; queue: 250 ms at the rate, so TCP rarely
            # loses (and resends) packets, which would add bytes no collective sent.
            burst = max(64 * 1024, int(rate / 250))
            limit = max(1 << 20, int(rate / 4))
            tbf = ["tbf", "rate", self.spec.rate or "", "burst", str(burst), "limit", str(limit)]
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        try:
            if delay and self.spec.delay:
                _run(tc + ["root", "handle", "1:", "netem", "delay", self.spec.delay, "limit", "100000"])
                if tbf:
                    _run(tc + ["parent", "1:1", "handle", "10:", *tbf])
            elif tbf:
                _run(tc + ["root", "handle", "1:", *tbf])
        except NetworkError as exc:
            if "kind is unknown" in str(exc) and "netem" in str(exc):
                raise NetworkError(f"delay={self.spec.delay} needs tc's netem qdisc, which this kernel lacks "
                                   f"(CONFIG_NET_SCH_NETEM); run with rate= only") from None
            raise

    def teardown(self) -> None:
        """Delete every namespace of this network (their links and qdiscs go with them)."""
        names = set(self.created) | {ns for ns in our_namespaces() if ns.startswith(self.name + "-")}
        for ns in sorted(names):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        self.created.clear()
        left = [ns for ns in our_namespaces() if ns.startswith(self.name + "-")]
        if left:
            log.warning("network namespaces still present after tear-down: %s", ", ".join(left))

    # -- measurement ----------------------------------------------------------
    def counters(self) -> list[dict[str, int]]:
        """Per node: bytes and packets its interface has sent and received (``/proc/net/dev`` in its namespace)."""
        return [read_counters(self.namespace(j), IFNAME) for j in range(self.nodes)]


def read_counters(ns: str, dev: str) -> dict[str, int]:
    """The interface's byte and packet counters, and the namespace's TCP segments sent and retransmitted."""
    text = _run(["ip", "netns", "exec", ns, "cat", "/proc/net/dev", "/proc/net/snmp"])
    counters: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == dev:
            v = [int(x) for x in rest.split()]
            counters.update(rx_bytes=v[0], rx_packets=v[1], tx_bytes=v[8], tx_packets=v[9])
    if not counters:
        raise NetworkError(f"interface {dev} not found in namespace {ns}")
    tcp = [line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:")]
    if len(tcp) == 2 and not tcp[1][0].lstrip("-").isalpha():  # a header line, then the values
        values = dict(zip(tcp[0], tcp[1]))
        counters.update(tcp_out_segs=int(values.get("OutSegs", 0)), tcp_retrans_segs=int(values.get("RetransSegs", 0)))
    return counters


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (one line), or None when a probe namespace could be made."""
    try:
        check_available()
    except ValueError as exc:
        return str(exc)
    probe = f"{PREFIX}{os.getpid()}-probe"
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        return f"cannot create network namespaces here: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=30)
    return None
