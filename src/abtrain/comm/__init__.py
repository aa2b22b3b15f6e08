"""Communication: the topology of the workers, the one communicator every collective goes through, and the
ledger that counts its bytes (``group.py``, ``topology.py``, ``communicator.py``, ``ledger.py``); the
in-memory communicator for tests (``recording.py``)."""
