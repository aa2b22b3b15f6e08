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
import re
import shutil
import signal
import sys
import tempfile
import threading

from .interrupt import SIGNALS, signal_name
from .safefile import is_own_private_dir, read_text

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
    _start_quiet_resource_tracker()
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


def ensure_running() -> None:
    """Start the fork server now, with the environment of this moment, SIGINT blocked in it until its tie
    (:mod:`abtrain.run.fork_server_tie`) ignores it: a Ctrl-C in its first moments, before any of its code could
    run, prints no traceback of the server's own (a blocked signal stays blocked in the new program, and one
    pending is dropped when it is ignored)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _running() -> bool:
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None) is not None


def _start_quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (the fork server and spawned workers use it) with its stderr on
    /dev/null, and deaf to the signals that end a run. It outlives a SIGKILLed launcher to remove the semaphores
    torch's launcher made, and then says so ("leaked semaphore objects to clean up"): a line about its own
    clean-up, after a kill that is to print nothing. It ignores SIGINT and SIGTERM itself; the others
    (SIGHUP, SIGUSR1, ... sent to the process group) reach it blocked, as they are here while it starts (a blocked
    signal stays blocked in the new program), instead of killing it: relaunched, it would print a traceback for
    every semaphore it no longer knows. A tracker this process already runs is left as it is."""
    from multiprocessing import resource_tracker

    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # delivered here once unblocked below
    try:
        os.dup2(devnull, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def server_pid() -> int | None:
    """The pid of this process's fork server, None when none runs."""
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def server_end() -> str | None:
    """How this process's fork server ended ("was killed by SIGKILL", "exited with code 1"), None while it runs
    or when there is none. It is not reaped (:func:`stop` does that)."""
    pid = server_pid()
    if pid is None:
        return None
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return f"was killed by {signal_name(info.si_status)}"
    return f"exited with code {info.si_status}"


class StartDeadline:
    """The launcher's start of its workers ends within ``seconds`` (:meth:`done` marks the end), or the fork server
    it waits on is killed: its wait (``multiprocessing.forkserver.read_signed``, for the pid of each forked worker)
    then ends with an EOFError at once instead of never. The server imports torch before it forks anything, the
    slow part of a start on a loaded machine; a server that has not answered by the deadline is stuck there."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False
        self._finished = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def start(self) -> "StartDeadline":
        self._timer.start()
        return self

    def done(self) -> None:
        """Every worker has been started: the deadline no longer applies."""
        with self._lock:
            self._finished = True
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            if self._finished:
                return
            self.expired = True
            pid = server_pid()
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


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


#: multiprocessing's temporary directory: ``mkdtemp(prefix="pymp-")``.
SOCKET_DIR_NAME = re.compile(r"pymp-[a-z0-9_]{8}")


def remove_recorded_socket_dir(private_tmp: str) -> str | None:
    """Remove the socket directory that a dead launcher recorded in ``private_tmp`` (SIGKILL ran none of its
    cleanup); returns it, or None when nothing was removed.

    The record is only a hint: a path read from a file is removed only where :func:`start_method` can have made
    it (``pymp-XXXXXXXX`` directly in the private directory's own parent, or in /tmp), when it is a real
    directory (never a link) of this user that nobody else may write into.
    """
    try:
        recorded = read_text(os.path.join(private_tmp, SOCKET_DIR_RECORD), limit=4096).strip()
    except (OSError, ValueError):
        return None
    parent, name = os.path.split(recorded)
    roots = {os.path.dirname(os.path.abspath(private_tmp)), "/tmp"}
    if (not os.path.isabs(recorded) or os.path.normpath(recorded) != recorded or parent not in roots
            or SOCKET_DIR_NAME.fullmatch(name) is None or not is_own_private_dir(recorded)):
        return None
    shutil.rmtree(recorded, ignore_errors=True)  # through directory descriptors: no link inside is followed
    return recorded
