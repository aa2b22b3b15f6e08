"""Signals to the ``abtrain`` command: the first one that would end it interrupts, any later one waits for that.

Installed before anything heavy is imported (torch takes seconds), so a signal at any moment ends the command
with one line and exit code 130: the first signal raises :class:`Interrupted` wherever the launcher is (the
elastic agent then stops the workers on its way out); a second one while the run winds down is ignored
instead of breaking that off with a traceback. Imports only the standard library.

Every signal whose default action ends a process is handled so (:data:`SIGNALS`: SIGINT, SIGTERM, SIGHUP,
SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, ..., the real-time ones), except those that report the process's own fault
(SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS: Python's or the C library's business) and those
Python itself ignores (SIGPIPE, SIGXFSZ: a write then fails with an error instead). SIGKILL and SIGSTOP cannot
be caught.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any


def _terminating() -> tuple[int, ...]:
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF",
             "SIGXCPU", "SIGIO", "SIGPWR", "SIGSTKFLT")
    found = [int(getattr(signal, n)) for n in names if hasattr(signal, n)]
    if hasattr(signal, "SIGRTMIN"):
        found += range(signal.SIGRTMIN, signal.SIGRTMAX + 1)
    return tuple(dict.fromkeys(found))


#: The signals that end the command as SIGTERM does (see the module's docstring for those that are not handled).
SIGNALS = _terminating()
_received: list[int] = []
#: set once the interruption was caught where the command says how it ended (:func:`acknowledge`)
_acknowledged = threading.Event()
#: seconds between deliveries of a signal whose interruption nobody caught yet
REDELIVER_S = 0.5


class Interrupted(KeyboardInterrupt):
    """The launcher got one of :data:`SIGNALS`; ``name`` is the signal's."""

    def __init__(self, signum: int) -> None:
        self.name = signal_name(signum)
        super().__init__(self.name)


def signal_name(signum: int) -> str:
    """``SIGTERM``, ``SIGRTMIN+3``, ... (the names ``kill -l`` uses)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        if hasattr(signal, "SIGRTMIN") and signal.SIGRTMIN < signum <= signal.SIGRTMAX:
            return f"SIGRTMIN+{signum - signal.SIGRTMIN}"
        return f"signal {signum}"


def _handler(signum: int, frame: FrameType | None) -> None:
    if _received and (_received[0] == 0 or _acknowledged.is_set()):
        return  # the first one is being handled: stopping the workers and recording the run must finish
    if not _received:
        _received.append(signum)
        threading.Thread(target=_redeliver, args=(signum,), name="abtrain-interrupt", daemon=True).start()
    raise Interrupted(_received[0])


def _redeliver(signum: int) -> None:
    """Send the signal again until its interruption is caught: an exception raised where Python only prints it
    (a weakref callback of the import system, met while torch is being imported) would otherwise lose it."""
    while not _acknowledged.wait(REDELIVER_S):
        if _received and _received[0] == 0:
            return  # a clean-up holds the signals
        signal.pthread_kill(threading.main_thread().ident, signum)  # the thread whose handler raises, woken


def _unraisable(info: Any) -> None:
    """An interruption raised where Python can only print it is not printed: it is delivered again."""
    if not isinstance(info.exc_value, Interrupted):
        sys.__unraisablehook__(info)


def acknowledge() -> None:
    """The interruption was caught where the command says how it ended: no more deliveries, later signals
    ignored."""
    _acknowledged.set()


def install() -> dict[int, Any] | None:
    """Route :data:`SIGNALS` through :func:`_handler`; returns the handlers it replaced (None off the main
    thread, where Python cannot set handlers). A signal other than SIGINT and SIGTERM that was ignored when the
    command started (``nohup`` ignores SIGHUP) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if not _received or _acknowledged.is_set():  # an interruption nobody caught yet stays to be delivered
        _received.clear()
        _acknowledged.clear()
    if sys.unraisablehook is sys.__unraisablehook__:
        sys.unraisablehook = _unraisable
    return reinstall()


def reinstall() -> dict[int, Any]:
    """Route :data:`SIGNALS` through :func:`_handler` again, after a library replaced some handlers (torch's elastic
    agent installs its own when it starts workers); a signal already received stays received. Main thread only."""
    previous: dict[int, Any] = {}
    # Blocked while they are set (one arriving meanwhile is delivered at the end, to this handler): from outside,
    # every one is caught from the moment any one is.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        for sig in SIGNALS:
            if sig not in (signal.SIGINT, signal.SIGTERM) and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # ignored by whoever started the command (nohup ignores SIGHUP): the run is to outlive it
            previous[sig] = signal.signal(sig, _handler)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return previous


def to_default() -> None:
    """A worker: every one of :data:`SIGNALS` ends it at once and quietly (the default action), even inside a
    blocking collective, where a Python handler would run only once the collective returned. A signal other than
    SIGINT and SIGTERM that the worker's starter ignored (``nohup``) stays ignored."""
    for sig in SIGNALS:
        if sig in (signal.SIGINT, signal.SIGTERM) or signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)


def received() -> bool:
    """True once a signal has interrupted the command."""
    return bool(_received) and _received[0] != 0


def received_name() -> str:
    """The name of the signal that interrupted the command (see :func:`received`)."""
    return signal_name(_received[0]) if received() else "none"


def hold() -> None:
    """From now on, ignore :data:`SIGNALS` (routed here): a clean-up that must finish is under way."""
    if not _received:
        _received.append(0)
    _acknowledged.set()


def ignore_all() -> None:
    """Ignore :data:`SIGNALS` for the rest of the process: the command has said how it ended, and Python sets its
    handlers back to the default actions while the interpreter shuts down, where a late signal would still kill
    it and replace the exit code that says so."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def restore(previous: dict[int, Any] | None) -> None:
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)


def signal_of(exc: BaseException) -> str:
    """The name of the signal behind a KeyboardInterrupt (Python's own one is SIGINT's)."""
    return exc.name if isinstance(exc, Interrupted) else "SIGINT"
