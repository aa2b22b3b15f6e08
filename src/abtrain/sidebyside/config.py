"""What ``abtrain bench`` is asked to run: the workload, the methods, the flags added to their runs, the network."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

from ..methods import METHODS
from . import netns
from .alphabeta import NetworkModel
from .workloads import DEFAULT_METHODS, get_workload

#: Methods that keep the workload's step budget under ``--steps-factor``: DDP's run sets the target and the time
#: every other method is measured against, and ``none`` (no communication) is the compute floor of those steps.
REFERENCE_METHODS = ("ddp", "none")
#: Flags that would undo or escape the stretched budget: the step count itself, and a warm-up in steps.
_BUDGET_FLAGS = ("--steps", "--epochs", "--warmup-lr-steps")


@dataclass
class BenchConfig:
    """Everything ``abtrain bench`` needs."""

    workload: str = "fashion-cnn"
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    quick: bool = False
    out: str | None = None
    extra: str = ""
    method_args: dict[str, str] = field(default_factory=dict)
    net: str | None = None
    network_model: NetworkModel = field(default_factory=NetworkModel)
    steps_factor: float = 1.0  # every method but REFERENCE_METHODS runs this many times the workload's steps

    def __post_init__(self) -> None:
        get_workload(self.workload, self.quick)  # raises for an unknown name
        if not self.methods:
            raise ValueError("--methods is empty; give a comma-separated list such as ddp,ab")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method {unknown[0]!r} in --methods; choose from: {', '.join(METHODS)}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"--methods lists a method twice: {','.join(self.methods)}")
        stray = [m for m in self.method_args if m not in self.methods]
        if stray:
            raise ValueError(f"--method-args for {stray[0]!r}, which is not in --methods ({','.join(self.methods)})")
        for text in (self.extra, *self.method_args.values()):
            try:
                shlex.split(text)
            except ValueError as exc:
                raise ValueError(f"cannot split flags {text!r}: {exc}") from None
        if self.net is not None:
            self.net_spec  # validates
        if not (math.isfinite(self.steps_factor) and 1 <= self.steps_factor <= 100):
            raise ValueError(f"--steps-factor must be between 1 and 100 (1.5: the methods other than ddp and none "
                             f"run 1.5 times as many steps), got {self.steps_factor:g}")
        if self.steps_factor != 1:
            for text in (self.extra, *self.method_args.values()):
                given = [a.split("=", 1)[0] for a in shlex.split(text) if a.split("=", 1)[0] in _BUDGET_FLAGS]
                if given:
                    raise ValueError(f"--steps-factor sets each run's steps from the workload's; drop {given[0]} "
                                     "from --extra/--method-args (a learning-rate warm-up: --warmup-lr-fraction, "
                                     "which stretches with the run)")

    def steps_factor_of(self, method: str) -> float:
        """The multiple of the workload's steps that ``method`` runs: 1 for the references, else ``steps_factor``."""
        return 1.0 if method in REFERENCE_METHODS else self.steps_factor

    @property
    def net_spec(self) -> netns.NetSpec | None:
        return netns.NetSpec.parse(self.net) if self.net is not None else None


def parse_method_args(items: list[str]) -> dict[str, str]:
    """``["ab:--ab-rank-fraction 0.1", ...]`` -> ``{"ab": "--ab-rank-fraction 0.1"}`` (repeats are joined)."""
    out: dict[str, str] = {}
    for item in items:
        method, sep, flags = item.partition(":")
        if not sep or not method.strip():
            raise ValueError(f"--method-args takes METHOD:FLAGS, e.g. 'ab:--ab-rank-fraction 0.1', got {item!r}")
        method, flags = method.strip(), flags.strip()
        out[method] = f"{out[method]} {flags}".strip() if method in out else flags
    return out
