"""The files of a run directory, opened without following symbolic links and checked to be what they should be.

A run directory may sit where someone else can create entries (a shared scratch disk, ``/tmp``). A link planted
at ``RUN_DIR/.lock`` would make a plain ``open(O_CREAT)`` truncate the file it points to, and a FIFO would block
a read forever. So every file abtrain opens in a run directory is opened with ``O_NOFOLLOW`` (and
``O_NONBLOCK``, so a FIFO cannot hang the open) and checked with ``fstat`` to be a regular file, and every
directory it writes into is checked with ``lstat`` to be a real directory. Writes replace files by
``rename`` (:func:`atomic_write`), which replaces a link itself, never its target, and gives a hard-linked name a
new file of its own (the other names keep the old one): readers never see half a file, and a full disk
(:class:`NoSpaceError`) leaves the old one as it was. The one file written in place, the lock, is refused when it
has other names (:func:`check_single_link`). Files read are size-checked first (:func:`read_text`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import tempfile
from collections.abc import Callable
from typing import IO, Any, BinaryIO

__all__ = ["NoSpaceError", "RunDirGone", "TooLarge", "WrongKind", "atomic_write", "check_kind", "check_single_link",
           "is_no_space", "is_own_private_dir", "make_dir", "open_fd", "open_file", "read_text", "regular_size",
           "write_json"]


class WrongKind(ValueError):
    """A path in a run directory is not the kind of file abtrain reads or writes there (a link, a FIFO, ...)."""


def _what(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "an unknown kind of file"


def _wrong(path: str, mode: int, want: str) -> WrongKind:
    return WrongKind(f"{path} is {_what(mode)}, not {'a directory' if want == 'dir' else 'a regular file'}: abtrain "
                     f"neither follows nor replaces it; remove it, or pass another run directory")


def check_kind(path: str, want: str) -> bool:
    """True when ``path`` exists as ``want`` (``"file"``: a regular file, ``"dir"``: a directory, links not
    followed), False when it does not exist; :class:`WrongKind` when it is anything else."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    if not (stat.S_ISDIR(mode) if want == "dir" else stat.S_ISREG(mode)):
        raise _wrong(path, mode, want)
    return True


def open_fd(path: str, flags: int, mode: int = 0o666) -> int:
    """``os.open`` of a regular file that is never a link's target, nor a FIFO or a device: WrongKind otherwise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENOTDIR):
            check_kind(path, "file")  # says what is there instead
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _wrong(path, st.st_mode, "file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: str, mode: str = "r") -> IO[Any]:
    """A regular file opened for reading (``"r"`` or ``"rb"``), links not followed."""
    if mode not in ("r", "rb"):
        raise ValueError(f"open_file reads only, got mode {mode!r}")
    return os.fdopen(open_fd(path, os.O_RDONLY), mode)


#: The largest JSON file abtrain reads in a run directory (config.json, status.json, the checkpoint manifest): what
#: it writes there is a few kB; a file of gigabytes (a sparse one costs nothing to make) is refused before reading.
MAX_TEXT_BYTES = 16 << 20


class TooLarge(ValueError):
    """A file abtrain reads is far larger than anything abtrain writes there."""


def read_text(path: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The text of regular file ``path`` (links not followed), refused (:class:`TooLarge`) when its size is above
    ``limit`` bytes, before anything is read."""
    with open_file(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        data = fh.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:  # the second: it grew while being read
        raise TooLarge(f"{path} is {max(size, len(data)):,} bytes, far more than abtrain writes there ({limit:,} at "
                       f"most): it is not abtrain's file, so it is not read")
    return data.decode()


def check_single_link(path: str, fd: int | None = None) -> None:
    """Refuse (:class:`WrongKind`) a file with more than one name (a hard link): abtrain writes into it in place
    (the lock), which would change the file behind every other name too. Absent: nothing to check."""
    try:
        st = os.fstat(fd) if fd is not None else os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        raise WrongKind(f"{path} has {st.st_nlink} hard links: abtrain writes into it in place, which would change "
                        f"the file behind its other names too; remove it, or pass another run directory")


def is_own_private_dir(path: str) -> bool:
    """True when ``path`` (never followed when it is a link) is a directory this user alone can have made: owned by
    this process's uid, with no permission for group or others (``mkdtemp``'s 0700)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def regular_size(path: str) -> int:
    """The size of a regular file (FileNotFoundError when missing, WrongKind when not a regular file)."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _wrong(path, st.st_mode, "file")
    return st.st_size


def make_dir(path: str) -> None:
    """Create directory ``path`` in an existing parent, or accept a real directory already there (never a link).

    Only the last component is created: a run directory removed during a run is not silently made again
    (FileNotFoundError instead)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        check_kind(path, "dir")


class NoSpaceError(OSError):
    """The device holding a run's files is full (ENOSPC) or its quota is used up (EDQUOT)."""


class RunDirGone(OSError):
    """The directory a run writes into was removed while the run was going on."""


def is_no_space(exc: BaseException | None) -> bool:
    """True when ``exc`` or an exception it was raised from is ENOSPC / EDQUOT (torch.save wraps the
    OSError of a full disk in a RuntimeError of its zip writer)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, NoSpaceError) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _umask() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read it by setting it (once, at import)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # what open() would give; mkstemp creates 0600


def atomic_write(path: str, data: str | Callable[[BinaryIO], None]) -> None:
    """Write ``data`` (text, or a function writing to a binary file) to ``path`` through a
    temporary file in the same directory, fsync and a rename: readers never see half a file.

    The file gets the mode the user's umask gives new files. A full disk raises
    :class:`NoSpaceError` and leaves ``path`` as it was.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    except OSError as exc:
        if is_no_space(exc):
            raise NoSpaceError(f"no space left on device while writing {path}") from None
        if isinstance(exc, FileNotFoundError) and not os.path.isdir(directory):
            raise RunDirGone(f"{directory} was removed while the run was writing to it ({os.path.basename(path)})") from None
        raise
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "w" if isinstance(data, str) else "wb") as fh:
            if isinstance(data, str):
                fh.write(data)
            else:
                data(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if is_no_space(exc):
            raise NoSpaceError(f"no space left on device while writing {path}") from None
        raise


def write_json(path: str, data: Any) -> None:
    atomic_write(path, json.dumps(data, indent=2, sort_keys=False) + "\n")
