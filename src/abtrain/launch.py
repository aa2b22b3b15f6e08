"""Start local workers through torch's elastic launcher, or join a world started outside.

- Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE set) this
  process *is* a worker: it joins that world.
- Under Slurm's ``srun`` with one task per worker (SLURM_PROCID,
  SLURM_NTASKS > 1, ...), the SLURM_* variables are translated to torchrun's
  and the process joins. MASTER_ADDR / MASTER_PORT come from the environment
  (see examples/slurm.sbatch).
- Otherwise ``--workers N`` local workers are started by
  ``torch.distributed.launcher.api.elastic_launch`` (what torchrun uses) with a
  standalone c10d rendezvous on loopback.
"""

from __future__ import annotations

import logging
import os
import re
import uuid

from .checkpoint import read_manifest
from .config import TrainConfig
from .results import check_writable, read_status, write_json, write_status

log = logging.getLogger(__name__)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def external_world(environ: dict[str, str] | None = None) -> str | None:
    """``"torchrun"`` or ``"slurm"`` when this process belongs to a world started outside, else None.

    For Slurm, fills in torchrun's variables from SLURM_* (in ``environ``).
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    ntasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and ntasks and int(ntasks) > 1:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = ntasks
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env["LOCAL_WORLD_SIZE"] = str(_slurm_tasks_on_this_node(env, int(ntasks)))
        if "MASTER_ADDR" not in env:
            raise ValueError("running under srun without MASTER_ADDR: export MASTER_ADDR=$(scontrol show hostnames "
                             "\"$SLURM_JOB_NODELIST\" | head -n 1) and MASTER_PORT (see examples/slurm.sbatch)")
        env.setdefault("MASTER_PORT", "29500")
        return "slurm"
    return None


def _slurm_tasks_on_this_node(env: dict[str, str], ntasks: int) -> int:
    if env.get("SLURM_NTASKS_PER_NODE"):
        return int(env["SLURM_NTASKS_PER_NODE"])
    # SLURM_TASKS_PER_NODE looks like "4(x2),3": the first node's count is ours when counts are equal.
    spec = env.get("SLURM_TASKS_PER_NODE", "")
    m = re.match(r"(\d+)", spec)
    if m:
        return int(m.group(1))
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    return max(1, ntasks // nodes)


def train(cfg: TrainConfig, resume_dir: str | None = None) -> int:
    """Run ``abtrain train``: validate, then start or join the workers. Returns the exit code.

    ``resume_dir``: continue that run from its last checkpoint (``cfg`` is its saved configuration).
    """
    from .train import default_run_dir, preflight, restart_count, worker_main

    mode = external_world()
    world = int(os.environ["WORLD_SIZE"]) if mode else cfg.workers
    run_dir = resume_dir or cfg.out or os.environ.get("ABTRAIN_RUN_DIR") or default_run_dir(cfg)
    is_main = not mode or int(os.environ.get("RANK", "0")) == 0
    if is_main:
        if resume_dir:
            check_resumable(run_dir, world)
        else:
            check_writable(run_dir)
            # Under torchrun, a restarted worker runs this again: then the checkpoint is its own run's.
            if restart_count() == 0 and read_manifest(run_dir) is not None:
                raise ValueError(f"run directory {run_dir} holds a checkpoint of an unfinished run: continue it with "
                                 f"'abtrain train --resume {run_dir}', or pass another --out")
    preflight(cfg, world)
    if is_main:
        if not resume_dir and restart_count() == 0:
            write_json(os.path.join(run_dir, "config.json"), cfg.to_dict())
        write_status(run_dir, "running", world_size=world)
    if mode:
        worker_main(cfg.to_dict(), run_dir, bool(resume_dir), report=True)
        return 0
    return _launch_local(cfg, run_dir, bool(resume_dir))


def check_resumable(run_dir: str, world: int) -> None:
    """A run directory that ``--resume`` can continue: unfinished, with a complete checkpoint for ``world`` workers."""
    if os.path.exists(os.path.join(run_dir, "results.json")):
        raise ValueError(f"run directory {run_dir} holds a finished run (results.json); there is nothing to resume")
    manifest = read_manifest(run_dir)
    if manifest is None:
        raise ValueError(f"run directory {run_dir} has no complete checkpoint to continue from "
                         f"(runs write one every --checkpoint-every steps and at --stop-after)")
    if manifest["world_size"] != world:
        raise ValueError(f"the checkpoint in {run_dir} was written by {manifest['world_size']} workers, "
                         f"this run has {world}; resume with the same number of workers")


def _launch_local(cfg: TrainConfig, run_dir: str, resume: bool = False) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .train import worker_main

    # The elastic agent logs every rendezvous step, and each failure again; workers print their own errors.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)  # "terminating process" on every failure
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.workers,
        run_id=f"abtrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # standalone: a free port on loopback, as torchrun --standalone
        rdzv_configs={"timeout": int(cfg.timeout)},
        max_restarts=cfg.max_restarts,  # the agent restarts every worker; they continue from the checkpoint
        monitor_interval=0.5,
        start_method="spawn",
    )
    try:
        elastic_launch(config, worker_main)(cfg.to_dict(), run_dir, resume)
    except ChildFailedError as exc:
        status = read_status(run_dir) or {}
        if status.get("status") == "failed" and status.get("error"):
            raise ValueError(status["error"]) from None
        first = next(iter(exc.failures.values()))
        write_status(run_dir, "failed", error=f"worker {first.local_rank} failed with exit code {first.exitcode}")
        raise RuntimeError(f"worker {first.local_rank} failed with exit code {first.exitcode}; "
                           f"its messages are above") from None
    return 0
