"""A throwaway method registered from outside the package, as a new method's file would register itself.

Loaded by ``ABTRAIN_METHOD_MODULES=toy_method`` (with this directory on PYTHONPATH); tests/test_registry.py
checks that it reaches the CLI, the config file, the workers and results.json without any other edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from abtrain.comm.communicator import Communicator
from abtrain.comm.topology import Topology
from abtrain.methods.periodic import PeriodicMethod
from abtrain.methods.registry import MethodSpec, register
from abtrain.validate import Options, opt


@dataclass
class ToyConfig(Options):
    """Options of the toy method (``--toy-<name>``, ``[toy]``)."""

    section = "toy"
    every: int = opt(2, "steps between two averages of the parameters")

    def check(self) -> None:
        self.require("every", self.every >= 1, "a positive integer")


class Toy(PeriodicMethod):
    """Local SGD under other labels: parameters and float buffers averaged every ``every`` steps."""

    name = "toy"
    local_phase, sync_phase = "toy-local", "toy-average"

    def __init__(self, comm: Communicator, topo: Topology, config: ToyConfig | None = None, **options: Any) -> None:
        self.cfg = config if config is not None else ToyConfig(**options)
        super().__init__(comm, topo, self.cfg.every)

    @torch.no_grad()
    def synchronize(self) -> None:
        assert self.module is not None
        tensors = [p.data for p in self.module.parameters()]
        tensors += [b for b in self.module.buffers() if b.is_floating_point()]
        with self.comm.ledger.in_phase("toy-average"):
            self.comm.all_reduce_tensors(tensors, self.topo.world, average=True)

    def extra_results(self) -> dict[str, Any]:
        return {"toy": {"every": self.cfg.every, "syncs": self.syncs}}


def _needs_two_workers(cfg: ToyConfig, world_size: int, group_size: int) -> None:
    if world_size < 2:
        raise ValueError("the toy method averages between workers: start it with --workers 2 (or more)")


register(MethodSpec("toy", Toy, "toy averaging", "a throwaway method of the tests: parameters averaged every N steps",
                    options=ToyConfig, check_topology=_needs_two_workers, short_run_args=("--toy-every", "2")))
