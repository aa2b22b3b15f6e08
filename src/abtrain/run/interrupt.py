"""SIGINT and SIGTERM to the ``abtrain`` command: the first one interrupts, any later one waits for that to finish.

Installed before anything heavy is imported (torch takes seconds), so a signal at any moment ends the command
with one line and exit code 130: the first signal raises :class:`Interrupted` wherever the launcher is (the
elastic agent then stops the workers on its way out); a second Ctrl-C while the run winds down is ignored
instead of breaking that off with a traceback. Imports only the standard library.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []


class Interrupted(KeyboardInterrupt):
    """The launcher got SIGINT or SIGTERM; ``name`` is the signal's."""

    def __init__(self, signum: int) -> None:
        self.name = signal.Signals(signum).name
        super().__init__(self.name)


def _handler(signum: int, frame: FrameType | None) -> None:
    if _received:
        return  # the first one is being handled: stopping the workers and recording the run must finish
    _received.append(signum)
    raise Interrupted(signum)


def install() -> dict[int, Any] | None:
    """Route SIGINT and SIGTERM through :func:`_handler`; returns the handlers it replaced (None off the main
    thread, where Python cannot set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    _received.clear()
    return {sig: signal.signal(sig, _handler) for sig in SIGNALS}


def hold() -> None:
    """From now on, ignore SIGINT and SIGTERM (routed here): a clean-up that must finish is under way."""
    if not _received:
        _received.append(0)


def restore(previous: dict[int, Any] | None) -> None:
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)


def signal_of(exc: BaseException) -> str:
    """The name of the signal behind a KeyboardInterrupt (Python's own one is SIGINT's)."""
    return exc.name if isinstance(exc, Interrupted) else "SIGINT"
