"""torchrun's and Slurm's variables: whether this process belongs to a world started outside, and whether they
describe one consistent world (half-set or contradictory variables are refused in one line, before anything is
touched)."""

from __future__ import annotations

import os
import re
import socket

from ..validate import MAX_VALUE


def external_world(environ: dict[str, str] | None = None) -> str | None:
    """``"torchrun"`` or ``"slurm"`` when this process belongs to a world started outside, else None.

    For Slurm, fills in torchrun's variables from SLURM_* (in ``environ``). Variables that are only half set
    (RANK without WORLD_SIZE, a rank outside the world, ...) are refused with one line (ValueError).
    """
    env = os.environ if environ is None else environ
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        raise ValueError(f"{given} is set but {missing} is not: set both (torchrun does), or neither to start local "
                         f"workers")
    if "RANK" in env:
        check_world_variables(env)
        return "torchrun"
    ntasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and ntasks and _count("SLURM_NTASKS", ntasks, 1) > 1:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = ntasks
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env["LOCAL_WORLD_SIZE"] = str(_slurm_tasks_on_this_node(env, int(ntasks)))
        if "MASTER_ADDR" not in env:
            raise ValueError("running under srun without MASTER_ADDR: export MASTER_ADDR=$(scontrol show hostnames "
                             "\"$SLURM_JOB_NODELIST\" | head -n 1) and MASTER_PORT (see examples/slurm.sbatch)")
        env.setdefault("MASTER_PORT", "29500")
        check_world_variables(env)
        return "slurm"
    return None


def _count(name: str, value: str | None, least: int) -> int:
    try:
        number = int(value or "")
    except ValueError:
        number = least - 1
    if number < least:
        raise ValueError(f"{name}={value!r} is not a count of at least {least}: the launcher's variables are broken")
    if number > MAX_VALUE:  # a typo, said as one instead of as a batch that no longer fits each worker's shard
        raise ValueError(f"{name}={value} is beyond any real world (at most {MAX_VALUE:,}): the launcher's variables "
                         f"are broken")
    return number


def check_master_addr(env: dict[str, str] | os._Environ) -> None:
    """MASTER_ADDR names a host this machine can resolve (for a world of more than one worker): said now, in one
    line, instead of by torch's store after --timeout, with its C++ log lines."""
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if int(env.get("WORLD_SIZE", "1")) <= 1 or not addr:
        return
    try:
        socket.getaddrinfo(addr, int(port) if port.isdigit() else None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"MASTER_ADDR={addr!r} does not resolve to an address ({reason}): set it to the host name "
                         f"or IP address of rank 0's machine") from None


def check_world_variables(env: dict[str, str] | os._Environ) -> None:
    """torchrun's variables describe one consistent world: 0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK <
    LOCAL_WORLD_SIZE <= WORLD_SIZE, and an address and port for a world of more than one worker."""
    world = _count("WORLD_SIZE", env.get("WORLD_SIZE"), 1)
    rank = _count("RANK", env.get("RANK"), 0)
    if rank >= world:
        raise ValueError(f"RANK={rank} is outside a world of WORLD_SIZE={world} workers (ranks 0 to {world - 1})")
    local_world = _count("LOCAL_WORLD_SIZE", env.get("LOCAL_WORLD_SIZE", str(world)), 1)
    local_rank = _count("LOCAL_RANK", env.get("LOCAL_RANK", str(rank % local_world)), 0)
    if local_world > world or local_rank >= local_world:
        raise ValueError(f"LOCAL_RANK={local_rank} and LOCAL_WORLD_SIZE={local_world} do not fit a world of "
                         f"WORLD_SIZE={world} workers (0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE)")
    if world > 1:
        if not env.get("MASTER_ADDR"):
            raise ValueError(f"WORLD_SIZE={world} without MASTER_ADDR: the workers need the address of rank 0 "
                             f"(torchrun sets it)")
        port = env.get("MASTER_PORT", "")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"MASTER_PORT={port!r} is not a TCP port (1 to 65535)")


def _slurm_tasks_on_this_node(env: dict[str, str], ntasks: int) -> int:
    if env.get("SLURM_NTASKS_PER_NODE"):
        return _count("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS_PER_NODE"], 1)
    # SLURM_TASKS_PER_NODE looks like "4(x2),3": the first node's count is ours when counts are equal.
    spec = env.get("SLURM_TASKS_PER_NODE", "")
    m = re.match(r"(\d+)", spec)
    if m:
        return int(m.group(1))
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    return max(1, ntasks // nodes)
