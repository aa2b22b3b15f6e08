"""The method registry: each method's own file declares it here; config, CLI, worker and bench read it.

A method module ends with one :func:`register` call. Every module of the
``abtrain.methods`` package is imported when the package is (see
``methods/__init__.py``), so a new file is all a new method needs; modules
outside the package are imported when named in the environment variable
``ABTRAIN_METHOD_MODULES`` (comma-separated, inherited by the workers).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from ..validate import Options
from .base import Method

#: Comma-separated modules that register methods from outside the package.
PLUGIN_VARIABLE = "ABTRAIN_METHOD_MODULES"


class MethodInputError(RuntimeError):
    """A method cannot go on with the model it trains, and a restart would fail alike: the worker reports it as
    an error of the input (AB-training's weight that no SVD decomposes)."""


@dataclass(frozen=True)
class MethodSpec:
    """What the rest of abtrain knows about a method.

    ``build(comm, topo, **kwargs)`` makes it: ``config=<options>`` when it has an
    ``options`` dataclass, ``bucket_cap_mb=`` when ``bucket_cap`` (it takes
    ``--bucket-cap-mb``). ``order`` places it in ``--method``'s list and in
    ``--help``; ``bench`` places it in ``abtrain bench``'s default list (None:
    not run by default); ``bench_args`` are flags it adds on every bench workload
    (after the workload's own, so they win: DeMo's plain SGD and its learning
    rate); ``short_run_args`` fit its schedule into the bench's few-step ``tiny`` workload.

    Checks that run before any worker starts (``--help``'s flags are fixed by then):
    ``check_topology(options, world_size, group_size)`` refuses a group layout
    the method cannot use; ``check_run(options, model, total_steps)`` checks
    what needs the model or the step budget (it may not change ``model``);
    ``group_layout(options, world_size, local_world_size)`` returns the group size
    the method wants when ``--group-size`` is not given, and a line to print
    when that is not the default (one group per node), or None; the caller adds
    how to choose another (:func:`abtrain.comm.topology.group_layout`).
    """

    name: str
    build: Callable[..., Method]
    title: str
    help: str
    options: type[Options] | None = None
    bucket_cap: bool = False
    order: int = 500
    bench: int | None = None
    bench_args: tuple[str, ...] = ()
    short_run_args: tuple[str, ...] = ()
    check_topology: Callable[[Any, int, int], None] | None = None
    check_run: Callable[[Any, nn.Module, int], None] | None = None
    group_layout: Callable[[Any, int, int], tuple[int, str | None]] | None = None

    def __post_init__(self) -> None:
        if self.options is not None and not self.section.isidentifier():
            raise ValueError(f"method {self.name!r} has options, so its name (dashes read as underscores) must be "
                             f"a Python identifier (it names the config section TrainConfig.{self.section})")
        if self.options is not None and self.options.section != self.section:
            raise ValueError(f"method {self.name!r}: its options class {self.options.__name__} has section "
                             f"{self.options.section!r}; they must be the same name")

    def has_option(self, name: str) -> bool:
        """True when the method's options have a field ``name`` (AB-training's ``quiet``)."""
        return self.options is not None and name in {f.name for f in fields(self.options)}

    @property
    def section(self) -> str:
        """The method's config section: its name with dashes as underscores (flags keep the dashes)."""
        return self.name.replace("-", "_")


_REGISTRY: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` to the registry (again: replace it, so that a module may be reloaded)."""
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a method (a test's throwaway one)."""
    _REGISTRY.pop(name, None)


def import_plugins(environ: dict[str, str] | None = None) -> None:
    """Import the modules named in ``ABTRAIN_METHOD_MODULES``; each registers its methods."""
    env = os.environ if environ is None else environ
    for module in filter(None, (m.strip() for m in env.get(PLUGIN_VARIABLE, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"{PLUGIN_VARIABLE}: cannot import {module!r}: {exc}") from None


def specs() -> list[MethodSpec]:
    """Every registered method, in ``order``."""
    return sorted(_REGISTRY.values(), key=lambda s: s.order)


def names() -> list[str]:
    return [s.name for s in specs()]


def with_options() -> list[MethodSpec]:
    """The methods that have an options section (``--<name>-*``, ``[<name>]``)."""
    return [s for s in specs() if s.options is not None]


def get(name: str) -> MethodSpec:
    """The method registered under ``name``; a ValueError listing the choices otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(names())}")
    return _REGISTRY[name]


def bench_defaults() -> list[str]:
    """The methods ``abtrain bench`` runs when ``--methods`` is not given, in their order."""
    return [s.name for s in sorted((s for s in specs() if s.bench is not None), key=lambda s: s.bench)]
