"""Imported first by the local launcher's fork server (:func:`abtrain.fork_server.start_method`), for its effect.

The fork server is the launcher's child and the workers' parent. It would outlive a SIGKILLed launcher for as
long as its workers run (each holds the pipe whose end tells it to exit), so it asks for SIGKILL when the
launcher dies; each worker asks for the same when the server dies (:func:`abtrain.rundir.die_with_parent`).
"""

from .rundir import die_with_parent

die_with_parent()
