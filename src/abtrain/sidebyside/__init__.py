"""What ``abtrain bench`` runs: several methods on one workload, side by side, optionally through a real shaped
network, and their report (the scripts of ``benchmarks/`` are separate programs that call it or the trainer)."""

from .config import BenchConfig, parse_method_args
from .alphabeta import NetworkModel
from .runner import run_bench
from .workloads import DEFAULT_METHODS, WORKLOADS, Workload, get_workload

__all__ = ["BenchConfig", "DEFAULT_METHODS", "NetworkModel", "WORKLOADS", "Workload", "get_workload",
           "parse_method_args", "run_bench"]
