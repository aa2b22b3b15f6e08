"""One worker process: join the world, train, and end with an exit code that says what happened.

Errors a user can act on end the worker with one line in status.json (and on
stderr when ``report``: no launcher above prints it). Under the local launcher
nothing is printed here: the launcher knows which worker failed first (or was
killed) and says it once, so the survivors' secondary errors (a lost peer,
gloo's own text) never reach the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from typing import Any

from ..comm.communicator import CollectiveError
from ..comm.topology import Topology
from ..config import TrainConfig
from ..methods.registry import MethodInputError
from . import checkpoint as ckpt
from . import interrupt
from .lifeline import die_with_parent
from .plan import Plan, group_layout
from .rundir import EXIT_FAILED, EXIT_INPUT, EXIT_NO_SPACE, StepBoard, read_status, write_status
from .safefile import NoSpaceError, RunDirGone
from .train import Trainer

#: What a worker's error means: (kind in status.json, exit code, whether a restart may help).
#: "input" and "diverged" repeat the same way on a restart; a lost peer or an unexpected error may not.
#: "disk": the run's files cannot be written (a full disk, or the run directory was removed).
ERROR_KINDS: tuple[tuple[type[BaseException], str, int, bool], ...] = (
    (NoSpaceError, "disk", EXIT_NO_SPACE, False),
    (RunDirGone, "disk", EXIT_NO_SPACE, False),
    (CollectiveError, "peer", EXIT_FAILED, True),
    (FloatingPointError, "diverged", EXIT_FAILED, False),  # also AB-training's weight that cannot be decomposed
    (ValueError, "input", EXIT_INPUT, False),
    (MethodInputError, "input", EXIT_INPUT, False),
)
SECONDARY_KINDS = ("peer", "internal")  # often only the echo of another worker's failure


def restart_count() -> int:
    """How often torch's elastic agent has restarted this worker group (0 on the first start)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    except ValueError:
        return 0


def classify(exc: BaseException) -> tuple[str, int, bool]:
    """``(kind, exit code, retry)`` of a worker's error."""
    for kind_type, kind, code, retry in ERROR_KINDS:
        if isinstance(exc, kind_type):
            return kind, code, retry
    if wrapped_collective_error(exc) is not None:
        return "peer", EXIT_FAILED, True
    return "internal", EXIT_FAILED, True


def as_divergence(exc: Exception, run_dir: str, lr: float) -> Exception:
    """A divergence found outside the trainer (AB-training's SVD of a weight that holds inf or nan) as the
    trainer's own: a :class:`~abtrain.run.checkpoint.Diverged` with the same advice (the last good checkpoint, and
    how to continue from it with a lower --lr). Any other error as it is."""
    if isinstance(exc, FloatingPointError) and not isinstance(exc, ckpt.Diverged):
        return ckpt.Diverged(f"{exc}{ckpt.divergence_advice(run_dir, lr)}")
    return exc


def wrapped_collective_error(exc: BaseException) -> str | None:
    """The message of a CollectiveError raised inside DDP's communication hook, which reaches
    ``loss.backward()`` only as the text of a RuntimeError ("... running the callback: CollectiveError: ...")."""
    text = str(exc)
    marker = "CollectiveError: "
    if not isinstance(exc, RuntimeError) or marker not in text:
        return None
    return text.split(marker, 1)[1].split("\n")[0].strip()


def _fail(run_dir: str, error: str, kind: str, retry: bool, step: int | None, **extra: Any) -> None:
    """Record this attempt's failure in status.json: the first one, unless a worker's own error
    (bad input, divergence, a full disk) comes after a secondary one (a lost peer)."""
    status = read_status(run_dir) or {}
    first = status.get("status") != "failed" or status.get("attempt") != restart_count()
    if first or (status.get("kind") in SECONDARY_KINDS and kind not in SECONDARY_KINDS):
        with contextlib.suppress(OSError):  # a full disk must not turn the report of a failure into a traceback
            write_status(run_dir, "failed", error=error, kind=kind, retry=retry, attempt=restart_count(),
                         step=step, **extra)


def worker_main(cfg_dict: dict[str, Any], run_dir: str, resume: bool = False, report: bool = False,
                board: str | None = None, plan: Plan | None = None, launcher: int | None = None) -> None:
    """Entry point of one worker process (local launcher, torchrun or srun).

    After an elastic restart (TORCHELASTIC_RESTART_COUNT > 0) the worker
    continues from the run directory's checkpoint when there is one.
    ``board``: the launcher's step board file, where this worker reports each completed step.
    ``plan``: the launcher's preflight plan when this process is the launcher too (torchrun, srun).
    ``launcher``: the local launcher's pid (the owner of the run directory; not this process's parent, which is
    the launcher's fork server).
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Ctrl-C, the launcher's SIGTERM and every other signal that ends a run end a worker at once and quietly,
    # even inside a blocking collective (a Python handler would only run once the collective returned); the
    # launcher reports the interruption and the checkpoint protocol keeps the last complete checkpoint.
    interrupt.to_default()
    if board is not None:
        # The parent is the launcher's fork server (or the launcher itself, for spawned workers); one that is
        # already gone by now would never send the death signal.
        tie = sys.modules.get("abtrain.run.fork_server_tie")
        die_with_parent(tuple(p for p in (launcher, getattr(tie, "SERVER_PID", None)) if p))
    cfg = TrainConfig.from_dict(cfg_dict)
    restarts = restart_count()
    if restarts:
        status = read_status(run_dir) or {}
        if os.path.exists(os.path.join(run_dir, "results.json")):
            return  # the run completed before the restart
        if status.get("status") == "failed" and status.get("retry") is False:
            raise SystemExit(status.get("exit_code", EXIT_INPUT))  # the same failure again: do not redo the work
    trainer: Trainer | None = None
    steps: StepBoard | None = None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if plan is not None:
        group_size, note = plan.group_size, plan.group_note
    else:
        group_size, note = group_layout(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    try:
        topo = Topology.from_env(backend=cfg.backend, device=cfg.device, group_size=group_size,
                                 timeout_s=cfg.timeout)
    except Exception as exc:
        # A ValueError: the launcher's preflight checks the same; under torchrun this is the first look. Anything
        # else: the world could not be formed (a peer that never came within --timeout, an unreachable address).
        if isinstance(exc, ValueError):
            text, kind, retry, code = str(exc), "input", False, EXIT_INPUT
        else:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            text = (f"worker {os.environ.get('RANK', '?')} could not join the world of {world} workers at "
                    f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')} within --timeout "
                    f"{cfg.timeout:g} s: a peer never came, or cannot reach this one ({first})")
            kind, retry, code = "peer", True, EXIT_FAILED
        if report:
            print(f"abtrain: error: {text}", file=sys.stderr, flush=True)
        _fail(run_dir, text, kind, retry, None, exit_code=code)
        raise SystemExit(code) from None
    if topo.rank == 0 and note is not None:
        print(f"abtrain: {note}", flush=True)
    try:
        resume = resume or (restarts > 0 and ckpt.read_manifest(run_dir) is not None)
        trainer = Trainer(cfg, topo, run_dir, resume=resume, plan=plan)
        if board is not None:
            steps = StepBoard(board, topo.rank)
            steps.set(trainer.step)
            trainer.on_step = steps.set
        if topo.rank == 0 and (resume or restarts):
            write_status(run_dir, "running", world_size=topo.world_size, restarts=restarts, resumed_from=trainer.step,
                         resumes=trainer.resumes, pid=launcher or os.getpid())
        trainer.run()
        trainer.comm.barrier(topo.world)  # leave together: no worker tears down while a peer still talks
    except Exception as exc:
        exc = as_divergence(exc, run_dir, cfg.lr)
        kind, code, retry = classify(exc)
        step = trainer.step if trainer is not None else None
        text = (wrapped_collective_error(exc) or str(exc)) if kind != "internal" else f"{type(exc).__name__}: {exc}"
        if report:
            if kind == "internal":
                traceback.print_exc()  # a bug: the whole story
            else:
                print(f"abtrain: error: worker {topo.rank}: {text}", file=sys.stderr, flush=True)
        extra = {"traceback": traceback.format_exc()} if kind == "internal" else {}
        _fail(run_dir, text, kind, retry, step, rank=topo.rank, exit_code=code, **extra)
        raise SystemExit(code) from None
    finally:
        if steps is not None:
            steps.close()
        trainer = None  # drop the model (DDP holds the process group) before the groups go
        topo.close()
