"""A process's tie to its parent's life (Linux): it is killed when the parent dies, including before the tie.

Imports nothing beyond the standard library, so the fork server can tie itself before it imports torch.
"""

from __future__ import annotations

import os
import signal


def die_with_parent(parents: tuple[int, ...] = ()) -> None:
    """This process gets SIGKILL when the process that started it dies (a SIGKILLed launcher must not leave
    workers training into a directory whose lock is free). A local worker's parent is the launcher's fork
    server, which dies with the launcher.

    The death signal covers only a parent that dies after it is armed. ``parents``: the pids this process's
    parent may have; when the parent is none of them once the signal is armed (it died first and this process
    was adopted), this process ends itself at once."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if parents and os.getppid() not in parents:
        os.kill(os.getpid(), signal.SIGKILL)
