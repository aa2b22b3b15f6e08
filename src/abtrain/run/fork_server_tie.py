"""Imported first by the local launcher's fork server (:func:`abtrain.run.fork_server.start_method`), for its effect.

The fork server is the launcher's child and the workers' parent. It would outlive a SIGKILLed launcher for as
long as its workers run (each holds the pipe whose end tells it to exit), so it asks for SIGKILL when the
launcher dies, and ends at once when the launcher died before it asked; each worker does the same with the
server (:func:`abtrain.run.lifeline.die_with_parent`, given :data:`SERVER_PID`). Nothing here imports torch: the tie
holds from the server's first moments.

Ctrl-C reaches the whole process group; the server ignores SIGINT from here on (as multiprocessing's server loop
does once it runs; until here the launcher kept it blocked, :func:`abtrain.run.fork_server.ensure_running`), so one
that meets Ctrl-C while it imports torch prints no traceback of its own: the launcher says what happened and ends
it.
"""

import os
import signal

from .lifeline import die_with_parent

#: The fork server's pid (the parent of every worker it forks).
SERVER_PID = os.getpid()
LAUNCHER_PID_VARIABLE = "ABTRAIN_LAUNCHER_PID"

_launcher = os.environ.get(LAUNCHER_PID_VARIABLE, "")
die_with_parent((int(_launcher),) if _launcher.isdigit() else ())
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked while the launcher started this process
