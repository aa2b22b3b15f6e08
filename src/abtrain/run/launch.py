"""Start local workers through torch's elastic launcher, or join a world started outside.

- Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE set) this
  process *is* a worker: it joins that world.
- Under Slurm's ``srun`` with one task per worker (SLURM_PROCID,
  SLURM_NTASKS > 1, ...), the SLURM_* variables are translated to torchrun's
  and the process joins. MASTER_ADDR / MASTER_PORT come from the environment
  (see examples/slurm.sbatch).
- Otherwise ``--workers N`` local workers are started by torch's
  ``LocalElasticAgent`` (what torchrun uses) with a standalone c10d rendezvous
  on loopback, forked from a fork server that has torch and abtrain imported
  (:mod:`abtrain.run.fork_server`). The launcher holds the run
  directory's lock, keeps torch's temporary files in a private directory that
  it removes at the end (:mod:`abtrain.run.private_tmp`), gives the start of
  the workers a deadline, and turns every way a run can end (a signal too,
  :mod:`abtrain.run.interrupt`) into one line and an exit code (see
  :mod:`abtrain.run.rundir`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from typing import Any

from ..config import TrainConfig
from . import fork_server, interrupt, private_tmp
from .checkpoint import read_manifest, shard_path
from .results import check_writable
from .rundir import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NO_SPACE, EXIT_WORKER_DIED, RunFailed, RunLock, StepBoard,
                     check_layout, read_status, signal_name, write_status)
from .safefile import write_json
from .world_env import check_master_addr, external_world

log = logging.getLogger(__name__)

#: Which signals torch's elastic agent turns into its own exception (its default: SIGTERM, SIGINT, SIGHUP, SIGQUIT).
TORCH_SIGNALS = "TORCHELASTIC_SIGNALS_TO_HANDLE"
#: A local run with more workers than this many per core gets a warning about memory.
WORKERS_PER_CORE_WARNING = 4
#: The shortest deadline for starting the local workers (the fork server imports torch first, which takes seconds
#: on a loaded machine); the deadline is --timeout when that is longer.
MIN_START_S = 60.0


def train(cfg: TrainConfig, resume_dir: str | None = None) -> int:
    """Run ``abtrain train``: validate, then start or join the workers. Returns the exit code.

    ``resume_dir``: continue that run from its last checkpoint (``cfg`` is its saved configuration).
    """
    from .plan import preflight
    from .rundir import default_run_dir
    from .worker import restart_count, worker_main

    mode = external_world()  # refuses half-set launcher variables before anything is touched
    if mode:
        check_master_addr(os.environ)
    world = int(os.environ["WORLD_SIZE"]) if mode else cfg.workers
    run_dir = resume_dir or cfg.out or os.environ.get("ABTRAIN_RUN_DIR") or default_run_dir(cfg)
    is_main = not mode or int(os.environ.get("RANK", "0")) == 0
    lock = RunLock(run_dir)
    started = False  # status.json says 'running'
    try:
        if is_main:
            check_layout(run_dir)  # no link, FIFO or wrong kind of file where abtrain reads or writes
            if not resume_dir:
                check_writable(run_dir)
            # Before the lock: once this process holds it, a 'running' left by a killed launcher looks alive.
            previous = (read_status(run_dir) or {}) if resume_dir else {}
            lock.acquire()  # before anything is read or written: a live run owns its directory
            if resume_dir:
                check_resumable(run_dir, world, cfg, shards=not mode)
                if previous.get("status") == "interrupted" and previous.get("reason"):
                    print("abtrain: the run was left 'running' by a process that is gone; resuming it",
                          file=sys.stderr, flush=True)
            # Under torchrun, a restarted worker runs this again: then the checkpoint is its own run's.
            elif restart_count() == 0 and read_manifest(run_dir) is not None:
                raise ValueError(f"run directory {run_dir} holds a checkpoint of an unfinished run: continue it with "
                                 f"'abtrain train --resume {run_dir}', or pass another --out")
        plan = preflight(cfg, world)  # a joining worker trains with it; local workers make their own
        if not mode:
            _warn_about_memory(cfg.workers)
        if is_main:
            if not resume_dir and restart_count() == 0:
                write_json(os.path.join(run_dir, "config.json"), cfg.to_dict())
            write_status(run_dir, "running", world_size=world, pid=os.getpid())
            started = True
        if mode:
            worker_main(cfg.to_dict(), run_dir, bool(resume_dir), report=True, plan=plan)
            return 0
        return _launch_local(cfg, run_dir, bool(resume_dir))
    except KeyboardInterrupt as exc:
        if not started:
            raise  # nothing was started: the command says so
        interrupt.acknowledge()
        return _interrupted(run_dir, "", world, interrupt.signal_of(exc))
    finally:
        lock.release()


def _warn_about_memory(workers: int) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if workers > WORKERS_PER_CORE_WARNING * cores:
        print(f"abtrain: warning: {workers} workers on {cores} CPU cores: every worker is a process with its own "
              f"copy of the model, the data and the backend's buffers (hundreds of MB each); expect high memory "
              f"use and slow steps, or use fewer --workers", file=sys.stderr, flush=True)


def check_resumable(run_dir: str, world: int, cfg: TrainConfig | None = None, shards: bool = False) -> None:
    """A run directory that ``--resume`` can continue: unfinished, with a complete checkpoint for ``world`` workers.

    ``shards``: also check every shard's presence, size and checksum (the local launcher, which sees them all).
    """
    if os.path.exists(os.path.join(run_dir, "results.json")):
        raise ValueError(f"run directory {run_dir} holds a finished run (results.json); there is nothing to resume")
    manifest = read_manifest(run_dir)
    if manifest is None:
        raise ValueError(f"run directory {run_dir} has no complete checkpoint to continue from "
                         f"(runs write one every --checkpoint-every steps and at --stop-after)")
    if manifest["world_size"] != world:
        raise ValueError(f"the checkpoint in {run_dir} was written by {manifest['world_size']} workers, "
                         f"this run has {world}; resume with the same number of workers")
    if shards:
        for rank in range(world):
            shard_path(run_dir, manifest, rank)
    if cfg is not None and cfg.stop_after is not None and cfg.stop_after <= manifest["step"]:
        raise ValueError(f"--stop-after {cfg.stop_after}: the run is already at step {manifest['step']}; "
                         f"give a later step, or none")


def _last_checkpoint(run_dir: str) -> tuple[int | None, str]:
    """The last complete checkpoint's step, and the sentence that says what a user can do with it."""
    try:
        manifest = read_manifest(run_dir)
    except ValueError:
        manifest = None
    if manifest is None:
        return None, "no checkpoint was written yet: start the run again"
    return manifest["step"], (f"the checkpoint of step {manifest['step']} is kept: continue with "
                              f"'abtrain train --resume {run_dir}'")


def _reached(board: str, world: int) -> int | None:
    steps = [s for s in (StepBoard.read(board, r) for r in range(world)) if s is not None]
    return max(steps) if steps else None


def _describe(failures: dict[int, Any], run_dir: str, board: str,
              signalled: dict[int, int] | None = None) -> tuple[str, int, bool]:
    """The one line for a failed attempt, its exit code, and whether a restart can help.

    A worker killed by a signal is the cause; the others' errors (a lost peer) only echo it. torch reports one
    failed worker, the first it looks at, so ``signalled`` adds the exit codes of every worker a signal killed
    (rank -> negative exit code). Otherwise the worker that recorded the first failure in status.json says why.
    """
    if not os.path.isdir(run_dir):  # nothing is left to record a failure in, nor to resume
        return (f"run directory {run_dir} was removed while the run was going on; start the run again",
                EXIT_NO_SPACE, False)
    died = {rank: f.exitcode for rank, f in failures.items() if f.exitcode is not None and f.exitcode < 0}
    died.update(signalled or {})
    if died:
        rank = min(died)
        step = StepBoard.read(board, rank)
        return (f"worker {rank} died (killed by {signal_name(-died[rank])}) at step "
                f"{'?' if step is None else step}", EXIT_WORKER_DIED, True)
    status = read_status(run_dir) or {}
    if status.get("status") == "failed" and status.get("error"):
        return status["error"], int(status.get("exit_code", EXIT_FAILED)), bool(status.get("retry", True))
    rank = min(failures)
    step = StepBoard.read(board, rank)
    return (f"worker {rank} exited with code {failures[rank].exitcode} at step {'?' if step is None else step} "
            f"without saying why", EXIT_WORKER_DIED, True)


def _exited(pid: int) -> bool:
    """Linux: the worker has exited and waits to be reaped (a zombie), or is gone (the fork server reaps its
    children as soon as they exit)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def _make_agent(cfg: TrainConfig, run_dir: str, resume: bool, tmp: str, board: str, start_method: str,
                started: Any = None) -> Any:
    """torch's local elastic agent, watched: restarts are announced in one line, stopped workers are woken
    before they are terminated (a SIGSTOPped worker would otherwise hold the shutdown for its timeout), abtrain's
    signal handlers come back once torch has installed its own, and ``started()`` is called once the first
    workers run."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    from .worker import worker_main

    def announce(failures: dict[int, Any], signalled: dict[int, int]) -> None:
        line, _, retry = _describe(failures, run_dir, board, signalled)
        if retry:
            step, _ = _last_checkpoint(run_dir)
            source = f"the checkpoint of step {step}" if step is not None else "the start (no checkpoint yet)"
            print(f"abtrain: {line}, restarting from {source}", file=sys.stderr, flush=True)

    class Agent(LocalElasticAgent):
        signalled: dict[int, int] = {}  # of the last failed attempt
        running = False  # the first workers have started

        def _start_workers(self, worker_group: Any) -> Any:
            result = super()._start_workers(worker_group)
            if threading.current_thread() is threading.main_thread():
                interrupt.reinstall()  # torch's handlers (TORCHELASTIC_SIGNALS_TO_HANDLE) raise anew in its shutdown
            return result

        def _wake(self) -> None:
            """SIGCONT every worker once one has exited: torch terminates the rest with SIGTERM and waits 30 s
            for each before SIGKILL, and a stopped process would take all of them."""
            pids = list(self._pcontext.pids().values()) if self._pcontext is not None else []
            if any(_exited(pid) for pid in pids):
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except OSError:
                        pass

        def _signalled(self, ignore: tuple[int, ...] = ()) -> dict[int, int]:
            """The workers a signal has killed (local rank -> negative exit code), except by ``ignore``."""
            processes = getattr(getattr(self._pcontext, "_pc", None), "processes", None) or []
            codes = {rank: p.exitcode for rank, p in enumerate(processes)}
            return {rank: c for rank, c in codes.items() if c is not None and c < 0 and -c not in ignore}

        def _monitor_workers(self, worker_group: Any) -> Any:
            if not self.running and started is not None:
                started()
            self.running = True
            self._wake()
            before = self._signalled()  # before torch stops the others with SIGTERM
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                self.signalled = {**self._signalled(ignore=(signal.SIGTERM,)), **before}
                if self._remaining_restarts > 0:
                    announce(result.failures, self.signalled)
            return result

    params = RendezvousParameters(backend="c10d", endpoint="127.0.0.1:0",  # standalone, as torchrun --standalone
                                  run_id=f"abtrain-{uuid.uuid4().hex[:8]}", min_nodes=1, max_nodes=1,
                                  timeout=int(cfg.timeout))
    spec = WorkerSpec(role="default", local_world_size=cfg.workers, entrypoint=worker_main,
                      args=(cfg.to_dict(), run_dir, resume, False, board, None, os.getpid()),
                      rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
                      max_restarts=cfg.max_restarts,  # the agent restarts every worker; they continue from the checkpoint
                      monitor_interval=0.5)
    return Agent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "logs")), start_method=start_method,
                 shutdown_timeout=5)


def _launch_local(cfg: TrainConfig, run_dir: str, resume: bool = False) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # The elastic agent logs every rendezvous step, and each failure again; the launcher says what happened.
    # Its loggers set their own levels, so each is quietened by name once the agent's modules are imported.
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)  # "terminating process" on every failure
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    saved: dict[str, Any] = {"tempdir": tempfile.tempdir, "TMPDIR": os.environ.get("TMPDIR"),
                             "signals": os.environ.get(TORCH_SIGNALS)}
    # abtrain's handlers (the first signal interrupts, a later one is ignored while the workers are stopped); torch's
    # would raise again inside its own shutdown, with a traceback.
    handlers = interrupt.install()
    os.environ[TORCH_SIGNALS] = "SIGHUP,SIGQUIT"
    start_method, tmp, board = "spawn", None, ""
    deadline = fork_server.StartDeadline(max(cfg.timeout, MIN_START_S))
    try:
        # torch's temporary files (the agent's log directory, each worker's error file) go to a directory of this
        # run's own, removed at the end whatever the outcome; a killed launcher's are removed by the next one.
        private_tmp.remove_orphaned()
        start_method, socket_dir = fork_server.start_method()
        tmp = private_tmp.make()
        if socket_dir is not None:  # removed when this process exits; after a SIGKILL, by the next launcher
            fork_server.record_socket_dir(tmp, socket_dir)
        board = os.path.join(tmp, "steps")
        tempfile.tempdir = tmp
        os.environ["TMPDIR"] = tmp
        agent = _make_agent(cfg, run_dir, resume, tmp, board, start_method, started=deadline.done)
        for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        # As torch's launcher does, the rendezvous is closed (its heartbeats stopped) unless a signal ended the
        # agent. Left open, its threads meet the interpreter's shutdown and can abort a launcher whose run finished.
        rendezvous = agent.get_worker_group().spec.rdzv_handler
        try:
            if start_method == "forkserver":
                deadline.start()
                fork_server.ensure_running()
            result = agent.run()
        except (SignalException, KeyboardInterrupt):
            raise
        except BaseException as exc:
            rendezvous.shutdown()
            if agent.running or interrupt.received() or not isinstance(exc, Exception):
                raise
            _start_failed(run_dir, exc, deadline)  # the fork server died, or did not answer by the deadline
        rendezvous.shutdown()
        if result.is_failed():
            _failed(result.failures, run_dir, board, agent.signalled)
    except SignalException as exc:
        interrupt.acknowledge()
        return _interrupted(run_dir, board, cfg.workers, signal_name(int(exc.sigval)))
    except KeyboardInterrupt as exc:
        interrupt.acknowledge()
        return _interrupted(run_dir, board, cfg.workers, interrupt.signal_of(exc))
    except Exception:
        if not interrupt.received():
            raise
        interrupt.acknowledge()
        # A signal landed while its own effect (the fork server or a worker gone) surfaced as this error: it is
        # the signal's (the handler of a second one returns without raising; see interrupt.hold).
        return _interrupted(run_dir, board, cfg.workers, interrupt.received_name())
    finally:
        deadline.done()
        interrupt.hold()  # the clean-up below runs to its end
        tempfile.tempdir = saved["tempdir"]
        for name, value in (("TMPDIR", saved["TMPDIR"]), (TORCH_SIGNALS, saved["signals"])):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        interrupt.restore(handlers)  # torch's agent installs its own and leaves them
        if start_method == "forkserver":
            fork_server.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _start_failed(run_dir: str, exc: BaseException, deadline: fork_server.StartDeadline) -> None:
    """The workers could not be started (the fork server that forks them died, or had not answered when
    ``deadline`` passed): record it and raise its one line."""
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    server = fork_server.server_end()
    if deadline.expired:
        line = (f"the workers did not start within {deadline.seconds:g} s: the fork server that starts them (it "
                f"imports torch first) did not answer; the machine may be overloaded (try again, or give a longer "
                f"--timeout)")
    elif server is not None:
        line = f"the fork server that starts the workers {server} before it had started them; start the run again"
    else:
        line = f"the workers could not be started ({type(exc).__name__}: {first}); start the run again"
    with contextlib.suppress(OSError):
        write_status(run_dir, "failed", error=line, kind="start", retry=True, exit_code=EXIT_FAILED)
    raise RunFailed(line, EXIT_FAILED)


def _failed(failures: dict[int, Any], run_dir: str, board: str, signalled: dict[int, int]) -> None:
    """Say why the run failed, in one line (a traceback only for a bug), and raise its exit code."""
    line, code, _ = _describe(failures, run_dir, board, signalled)
    status = read_status(run_dir) or {}
    if code == EXIT_WORKER_DIED:
        step, what = _last_checkpoint(run_dir)
        with contextlib.suppress(OSError):
            write_status(run_dir, "failed", error=line, kind="worker-died", retry=True, exit_code=code,
                         checkpoint=step)
        line = f"{line}; {what}"
    elif status.get("kind") == "internal" and status.get("traceback"):
        print(status["traceback"].rstrip(), file=sys.stderr)  # a bug: the cause in full, once
        line = f"worker {status.get('rank', '?')} failed: {line}"
    raise RunFailed(line, code)


def _interrupted(run_dir: str, board: str, world: int, sig: str) -> int:
    """A signal to the launcher (SIGINT, SIGTERM, ...): the workers are stopped; record it and say how to continue."""
    if os.path.exists(os.path.join(run_dir, "results.json")):  # the signal came during the last clean-up
        print(f"abtrain: interrupted ({sig}) after the run completed", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    step, what = _last_checkpoint(run_dir)
    reached = _reached(board, world)
    with contextlib.suppress(OSError):
        write_status(run_dir, "interrupted", signal=sig, step=reached, checkpoint=step,
                     resume=f"abtrain train --resume {run_dir}" if step is not None else None)
    print(f"abtrain: interrupted ({sig}){'' if reached is None else f' at step {reached}'}; {what}",
          file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
