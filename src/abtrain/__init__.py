"""abtrain: communication-efficient distributed training (AB-training) on PyTorch, every byte counted."""

from ._version import __version__

from .api import setup  # noqa: E402
from .comm import Communicator, Ledger  # noqa: E402
from .methods import METHODS, ABConfig, ABTraining, Method, build_method  # noqa: E402
from .topology import Topology  # noqa: E402

__all__ = ["ABConfig", "ABTraining", "Communicator", "Ledger", "METHODS", "Method", "Topology", "build_method",
           "setup", "__version__"]
