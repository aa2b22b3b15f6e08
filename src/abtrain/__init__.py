"""abtrain: communication-efficient distributed training (AB-training) on PyTorch."""

__version__ = "0.1.0"
