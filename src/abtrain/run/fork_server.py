"""The local launcher's fork server: its workers are forked from a process that has imported torch and abtrain.

Python's ``forkserver`` start method, prepared for one launch: the modules it preloads, the directory of its
Unix socket (made before the launcher points TMPDIR at its private directory), and its end.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver as forkserver
import multiprocessing.util
import os
import shutil
import signal
import tempfile

#: What the fork server imports once, before it forks the workers: its tie to the launcher's life, then torch and
#: the worker's whole code.
PRELOAD = ["abtrain.run.fork_server_tie", "torch", "torch.distributed", "torch._dynamo", "abtrain.run.worker"]
#: The longest temporary directory under which the fork server's socket path (its directory "pymp-XXXXXXXX",
#: then "listener-XXXXXXXX") stays within a Unix socket's 107 bytes.
MAX_SOCKET_BASE = 107 - len("/pymp-12345678/listener-12345678")
#: The file in the launcher's private temporary directory that names the fork server's socket directory.
SOCKET_DIR_RECORD = "fork-server-dir"
#: The launcher's pid, for the fork server's tie to its life (:mod:`abtrain.run.fork_server_tie`, not imported here:
#: importing it ties the importing process to its own parent).
LAUNCHER_PID_VARIABLE = "ABTRAIN_LAUNCHER_PID"


def start_method() -> tuple[str, str | None]:
    """Workers are forked from a fork server that has imported torch and abtrain once, instead of each
    importing them again in a fresh interpreter ("spawn"): the same separate processes, started in a fraction
    of the CPU time. The server is this launch's own (see :func:`stop`), so it sees the
    environment the launcher has when it starts the workers.

    The server listens on a Unix socket in multiprocessing's temporary directory, made here, before the
    launcher points TMPDIR at its private directory (which it removes at the end). A socket's path holds at most
    107 bytes: under a longer TMPDIR the directory goes to /tmp, and where that fails too the workers are spawned.
    They are spawned too when this process already runs a fork server of its own (a program that calls the
    launcher after using the forkserver start method itself): that one is not the launcher's to preload or end.
    Returns the start method and the socket's directory.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods() or _running():
        return "spawn", None
    saved = tempfile.tempdir
    try:
        if len(tempfile.gettempdir()) > MAX_SOCKET_BASE and os.access("/tmp", os.W_OK):
            tempfile.tempdir = "/tmp"
        socket_dir = multiprocessing.util.get_temp_dir()  # made once per process, removed when it exits
    finally:
        tempfile.tempdir = saved
    if len(socket_dir) > MAX_SOCKET_BASE + len("/pymp-12345678"):
        return "spawn", None
    multiprocessing.set_forkserver_preload(PRELOAD)
    os.environ[LAUNCHER_PID_VARIABLE] = str(os.getpid())  # the server's tie checks that its parent is this process
    return "forkserver", socket_dir


def _running() -> bool:
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None) is not None


def stop() -> None:
    """End the fork server at the end of a launch, so that a later launch from this process starts one with
    the environment of that time (its TMPDIR, the user's changes to os.environ). Only for a server that
    :func:`start_method` chose. It holds nothing but imported modules: SIGKILL spares the second of
    interpreter teardown that a polite exit would take."""
    server = getattr(forkserver, "_forkserver", None)
    pid, halt = getattr(server, "_forkserver_pid", None), getattr(server, "_stop", None)
    if pid is None or halt is None:  # not started, or a Python without the hooks: it exits with this process
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    halt()  # reaps it and forgets its socket


def record_socket_dir(private_tmp: str, socket_dir: str) -> None:
    """Name the socket's directory in the launcher's private temporary directory (see
    :func:`remove_recorded_socket_dir`)."""
    with open(os.path.join(private_tmp, SOCKET_DIR_RECORD), "w") as fh:
        fh.write(socket_dir)


def remove_recorded_socket_dir(private_tmp: str) -> None:
    """Remove the socket directory that a dead launcher recorded (SIGKILL ran none of its cleanup)."""
    with contextlib.suppress(OSError):
        with open(os.path.join(private_tmp, SOCKET_DIR_RECORD)) as fh:
            socket_dir = fh.read().strip()
        if os.path.basename(socket_dir).startswith("pymp-"):
            shutil.rmtree(socket_dir, ignore_errors=True)
