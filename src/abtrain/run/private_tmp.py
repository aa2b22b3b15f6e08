"""The launcher's private temporary directories, and the clean-up of those a killed launcher left behind.

Each local launch keeps torch's temporary files in ``$TMPDIR/abtrain-<pid>-XXXXXXXX`` (``mkdtemp``: mode 0700)
and removes it at the end. A SIGKILLed launcher runs no clean-up, so the next one removes what it left: its
private directory and its fork server's socket directory (:func:`abtrain.run.fork_server.remove_recorded_socket_dir`).

``$TMPDIR`` (``/tmp``) is writable by everyone, so whatever is found there may have been planted to make this
clean-up delete something else. Only a directory that this user's launcher can have made is removed: at the exact
path ``<root>/abtrain-<pid>-<8 characters of mkdtemp>``, a real directory (a link is never followed), owned by this
process's uid, closed to everyone else (no group or other permission bit), and of a launcher that is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from .fork_server import remove_recorded_socket_dir
from .safefile import is_own_private_dir

#: A launcher's private directory: ``mkdtemp(prefix=f"abtrain-{pid}-")`` (8 random characters of [a-z0-9_]).
PRIVATE_NAME = re.compile(r"abtrain-(\d{1,7})-[a-z0-9_]{8}")  # pid_max is at most 2**22


def make() -> str:
    """A new private directory of this launcher, under ``tempfile.gettempdir()``."""
    return tempfile.mkdtemp(prefix=f"abtrain-{os.getpid()}-")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive (another user's)
    return False


def remove_orphaned(root: str | None = None) -> list[str]:
    """Remove the private directories under ``root`` (default: ``tempfile.gettempdir()``) of launchers that are
    gone, with their fork servers' socket directories; returns the paths removed. Anything else is left alone:
    another name, a link, another user's directory, one that others may write into, a live launcher's."""
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        m = PRIVATE_NAME.fullmatch(name)
        path = os.path.join(root, name)
        if m is None or not is_own_private_dir(path) or not _gone(int(m.group(1))):
            continue
        remove_recorded_socket_dir(path)
        # rmtree works through directory descriptors: it never follows a link inside, nor at the top.
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
