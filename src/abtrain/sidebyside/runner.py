"""Run several methods on one workload, each as the ``abtrain train`` a user would type, one after another."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..run import interrupt
from ..run.rundir import read_status
from . import netns
from .config import BenchConfig
from .report import Outcome, build_report, write_report
from .workloads import get_workload

log = logging.getLogger(__name__)

_WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_NPROCS", "GLOO_SOCKET_IFNAME")
_PEER_GRACE_S = 10.0  # after one worker fails, how long the others may take to notice before they are stopped
_BASE_PORT = 29500


def default_out(workload: str) -> str:
    return os.path.join("runs", f"bench-{workload}-{time.strftime('%Y%m%d-%H%M%S')}")


def _int_flag(args: list[str], flag: str, default: int) -> int:
    """The value of an integer flag (the last one wins, as in argparse); ``default`` when absent or bad."""
    value: str | None = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default  # the run itself reports the bad value


def _workers_of(args: list[str], default: int = 4) -> int:
    """The worker count the flags ask for."""
    return _int_flag(args, "--workers", default)


def _group_size_of(args: list[str]) -> int:
    """The --group-size the flags ask for (1 when absent: then each worker is a group of its own under --net)."""
    return _int_flag(args, "--group-size", 1)


def _say(text: str) -> None:
    print(text, flush=True)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (and SIGHUP) unwind like Ctrl-C, so every ``finally`` (network tear-down) runs."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run every method of ``cfg`` and write report.json, report.md and the plots; returns the report."""
    workload = get_workload(cfg.workload, cfg.quick)
    out = os.path.abspath(cfg.out or default_out(workload.name))
    if os.path.exists(os.path.join(out, "report.json")):
        raise ValueError(f"{out} already holds a bench report; pass another --out")
    spec = cfg.net_spec
    if spec is not None:
        netns.check_available()
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)

    outcomes = []
    for method in cfg.methods:
        args = [*workload.args_for(method, cfg.steps_factor_of(method)), *shlex.split(cfg.extra),
                *shlex.split(cfg.method_args.get(method, ""))]
        run_dir = os.path.join(out, "runs", method)
        outcomes.append(Outcome(method, [sys.executable, "-m", "abtrain.cli", "train", *args, "--out", run_dir],
                                run_dir))
    _say(f"abtrain bench: {workload.description}; methods {', '.join(cfg.methods)}; output {out}")
    network: netns.Network | None = None
    interrupted = False
    with _sigterm_as_interrupt():
        try:
            if spec is not None:
                stale = netns.cleanup_stale()
                if stale:
                    _say(f"removed {len(stale)} network namespaces left by an earlier bench: {', '.join(stale)}")
                world = _workers_of(outcomes[0].command)
                network = netns.Network(world, spec, spec.node_size(_group_size_of(outcomes[0].command)))
                network.setup()
                where = ("each in its own namespace" if network.layout == "worker" else
                         f"{network.nodes} nodes of {network.node_size} (one namespace per group)")
                _say(f"network: {world} workers, {where} ({network.namespace(0)[:-1]}*), {spec.describe()}")
            for i, outcome in enumerate(outcomes):
                _say(f"\n[bench {i + 1}/{len(outcomes)}] {outcome.method}: $ abtrain "
                     + " ".join(shlex.quote(c) for c in outcome.command[3:]))
                _run_method(outcome, network, port=_BASE_PORT + i)
                line = f"[bench {i + 1}/{len(outcomes)}] {outcome.method}: {outcome.status}"
                _say(line + (f" ({outcome.error})" if outcome.error else f" in {outcome.seconds:.1f} s"))
        except KeyboardInterrupt:
            interrupt.hold()  # caught: the clean-up and the report below run to their end
            interrupted = True
            _say("abtrain bench: interrupted; removing what it set up and writing a report of the finished runs")
        finally:
            if network is not None:
                network.teardown()
    report = build_report(workload, cfg, outcomes, out, interrupted=interrupted)
    write_report(report, out)
    _say(f"\nabtrain bench: wrote {os.path.join(out, 'report.md')}, report.json and plots")
    return report


def _run_method(outcome: Outcome, network: netns.Network | None, port: int) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _WORLD_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    os.makedirs(outcome.run_dir, exist_ok=True)
    if network is not None and (_workers_of(outcome.command) != network.workers
                                or network.node_size not in (1, _group_size_of(outcome.command))):
        outcome.status = "failed"
        outcome.error = (f"--net runs every method on the same {network.workers} workers in nodes of "
                         f"{network.node_size}; this run asks for {_workers_of(outcome.command)} workers in groups "
                         f"of {_group_size_of(outcome.command)}")
        return
    start = time.perf_counter()
    before = network.counters() if network is not None else None
    try:
        if network is None:
            procs = [(outcome.command, env)]
        else:
            procs = []
            # Every worker shares this machine's cores, as under the local launcher: the same threads per worker.
            asked = any(a == "--threads" or a.startswith("--threads=") for a in outcome.command)
            threads = [] if asked else [
                "--threads", str(max(1, len(os.sched_getaffinity(0)) // network.workers))]
            for k in range(network.workers):
                world_env = {**env, "RANK": str(k), "WORLD_SIZE": str(network.workers),
                             "LOCAL_RANK": str(k % network.node_size), "LOCAL_WORLD_SIZE": str(network.node_size),
                             "MASTER_ADDR": network.address(0), "MASTER_PORT": str(port),
                             "GLOO_SOCKET_IFNAME": netns.IFNAME, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
                procs.append((network.exec_prefix(k) + outcome.command + threads, world_env))
        rc, tail = _run_processes(procs, outcome.run_dir, prefix=f"  {outcome.method} | ")
    except KeyboardInterrupt:
        outcome.status, outcome.error = "interrupted", "interrupted by the user"
        outcome.seconds = time.perf_counter() - start
        raise
    outcome.seconds = time.perf_counter() - start
    outcome.returncode = rc
    results_path = os.path.join(outcome.run_dir, "results.json")
    if rc == 0 and os.path.exists(results_path):
        with open(results_path) as fh:
            outcome.results = json.load(fh)
        outcome.status = "complete"
    else:
        outcome.status = "failed"
        outcome.error = _error_of(outcome.run_dir, tail, rc)
    if network is not None and before is not None:
        after = network.counters()
        outcome.measured = {
            "layout": network.layout, "node_size": network.node_size,
            "tx_bytes": [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)],
            "rx_bytes": [a["rx_bytes"] - b["rx_bytes"] for a, b in zip(after, before)],
            "tx_packets": [a["tx_packets"] - b["tx_packets"] for a, b in zip(after, before)],
        }
        for key in ("tcp_out_segs", "tcp_retrans_segs"):
            if all(key in c for c in after + before):
                outcome.measured[key] = [a[key] - b[key] for a, b in zip(after, before)]


def _error_of(run_dir: str, tail: collections.deque[str], rc: int) -> str:
    """The run's own error (status.json), else its last 'abtrain: error' line, else its last line."""
    status = read_status(run_dir) or {}
    if status.get("status") == "failed" and status.get("error"):
        return str(status["error"])
    lines = [ln.strip() for ln in tail if ln.strip()]
    for line in reversed(lines):
        if line.startswith("abtrain: error:"):
            return line.removeprefix("abtrain: error:").strip()
    return lines[-1] if lines else f"exit code {rc}"


def _run_processes(procs: list[tuple[list[str], dict[str, str]]], run_dir: str,
                   prefix: str) -> tuple[int, collections.deque[str]]:
    """Start the processes; the first one's output passes through (prefixed), the others' go to
    ``run_dir/worker-<k>.log``. Returns the first non-zero exit code (else 0) and the first's last lines.

    When one process fails, the others get a grace period and are then stopped: a worker whose peer
    died would otherwise wait for it until the collective timeout.
    """
    tail: collections.deque[str] = collections.deque(maxlen=50)
    started: list[subprocess.Popen] = []
    logs = []
    try:
        for k, (cmd, env) in enumerate(procs):
            if k == 0:
                p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, errors="replace")
            else:
                path = os.path.join(run_dir, f"worker-{k}.log")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a new file: never written through a link or into another name of an old one
                fh = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                       0o666), "w")
                logs.append(fh)
                p = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
            started.append(p)

        def pump() -> None:
            assert started[0].stdout is not None
            for line in started[0].stdout:
                tail.append(line.rstrip("\n"))
                print(prefix + line, end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        failed_at: float | None = None
        while any(p.poll() is None for p in started):
            codes = [p.returncode for p in started if p.returncode is not None]
            if failed_at is None and any(c != 0 for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > _PEER_GRACE_S:
                _stop(started)
            time.sleep(0.2)
        reader.join(timeout=5)
        codes = [p.returncode for p in started]
        for k, fh in enumerate(logs, start=1):
            if codes[k] != 0 and codes[0] == 0:
                fh.flush()
                with open(fh.name) as log_fh:
                    tail.extend(log_fh.read().splitlines()[-20:])
        return next((c for c in codes if c != 0), 0), tail
    except BaseException:
        _stop(started)
        raise
    finally:
        for fh in logs:
            fh.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the processes we started that still run, then kill what does not exit."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
