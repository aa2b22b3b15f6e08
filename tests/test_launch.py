"""Joining a world started outside: torchrun's variables, Slurm's srun (one task per worker); the local
launcher's fork server."""

import json
import os
import subprocess
import sys

import pytest

from abtrain.run.launch import external_world
from helpers import free_port


def test_plain_environment_spawns_locally():
    assert external_world({"HOME": "/root"}) is None


def test_torchrun_variables_join():
    assert external_world({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
                           "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}) == "torchrun"


def test_slurm_variables_are_translated():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_TASKS_PER_NODE": "4(x2)", "MASTER_ADDR": "node01"}
    assert external_world(env) == "slurm"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("5", "8", "1", "4")
    assert env["MASTER_PORT"] == "29500"


def test_slurm_without_master_addr_says_how_to_fix():
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        external_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"})


def test_single_task_sbatch_shell_is_not_a_world():
    # The batch script itself (SLURM_PROCID=0, one task) starts local workers as usual.
    assert external_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}) is None


def test_srun_style_world_trains(tmp_path):
    """Two processes that look like srun tasks join one world and finish one run."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_STEP_ID="0",
                   SLURM_NTASKS_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "abtrain.cli", "train", "--model", "mlp", "--dataset", "synthetic", "--steps", "5",
             "--out", str(tmp_path / "run")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    assert r["world_size"] == 2 and r["steps"] == 5


FORK_SERVER_CHOICES = """
import multiprocessing, os, sys
from abtrain.run import fork_server

method, socket_dir = fork_server.start_method()  # under a TMPDIR too long for a socket path
assert method == "forkserver" and socket_dir.startswith("/tmp/pymp-"), (method, socket_dir)
multiprocessing.set_forkserver_preload([])
p = multiprocessing.get_context("forkserver").Process(target=os.getpid)  # the program's own fork server
p.start()
p.join()
assert fork_server.start_method() == ("spawn", None)  # not the launcher's to preload or end
print("ok")
"""


def test_fork_server_socket_under_a_long_tmpdir_and_never_a_programs_own_server(tmp_path):
    long_tmp = tmp_path / ("t" * (120 - len(str(tmp_path))))
    long_tmp.mkdir()
    p = subprocess.run([sys.executable, "-c", FORK_SERVER_CHOICES], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TMPDIR": str(long_tmp)})
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
