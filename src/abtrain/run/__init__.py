"""A run's life cycle: the launcher and its fork server, the worker, the trainer and its plan, the run directory
(its lock, status, checkpoints, results), and the signals and ties that end it. Nothing is imported here:
``abtrain.run.interrupt`` must load without torch."""
