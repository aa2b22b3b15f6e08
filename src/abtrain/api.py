"""The library entry point for a user's own training loop."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import re
from typing import Any

from .comm.communicator import Communicator
from .comm.ledger import Ledger
from .comm.topology import Topology, check_int, check_timeout, group_layout, world_from_env
from .config import renamed
from .methods import Method, registry
from .validate import MAX_VALUE


def setup(method: str = "ab", *, total_steps: int | None = None, group_size: int | None = None,
          backend: str = "auto", device: str = "auto", timeout_s: float = 300.0, quiet: bool = False,
          **options: Any) -> Method:
    """Join the torch.distributed world of this process and build ``method``.

    The world is the default process group when the script already initialised
    one (it stays the script's: ``method.close()`` leaves it alone), else the
    one torchrun's variables describe (abtrain initialises it and ``close()``
    destroys it). A single process without torchrun runs with communication skipped.

    ``total_steps``: the run's length in optimizer steps (1 to 10**9); AB-training's schedule
    is a fraction of it (or call ``method.set_total_steps(total_steps)`` later).
    ``backend``: auto, gloo or nccl; ``device``: auto, cpu or cuda; ``timeout_s``: how long a
    collective may wait for its peers, in (0, one week]. A value of the wrong type raises a
    TypeError, one out of range a ValueError, each naming the argument and what it accepts.
    ``group_size``: workers per group (default: the workers of one node; for
    AB-training on one node, the world split into 2 groups, said on rank 0).
    ``quiet``: rank 0 prints nothing (the schedule and per-layer decisions
    then go to the ``abtrain`` logger at INFO).
    ``options`` are the method's own (for ``ab``: the fields of
    :class:`abtrain.methods.ABConfig`, e.g. ``warmup_fraction=0.2, rank_fraction=0.25``).
    The returned method has ``.topo`` (rank, world, device), ``.comm.ledger`` (every byte
    sent), ``attach``/``detach``, ``consensus``, ``export`` and ``close``.
    """
    if total_steps is not None:  # a run of 10**30 steps would have AB-training plan its schedule for ever
        total_steps = check_int("total_steps", total_steps, 1, MAX_VALUE)
    check_timeout(timeout_s)
    try:
        spec = registry.get(method)
        check_option_names(spec, options)
        if spec.has_option("quiet"):  # a method that may print while it is built (AB-training: its schedule)
            options = {**options, "quiet": quiet or bool(options.get("quiet", False))}
        preferred = None
        if spec.group_layout is not None and group_size is None:
            config = spec.options(**options) if spec.options is not None else None
            preferred = functools.partial(spec.group_layout, config)
        chosen, note = group_layout(*world_from_env(), group_size, preferred, choose="set group_size=")
        topo = Topology.from_env(backend=backend, device=device, group_size=chosen, timeout_s=timeout_s)
        built = spec.build(Communicator(Ledger(), topo.device), topo, **options)
        built.verbose = built.verbose and not quiet
        if note is not None:
            built.say(note)
        if total_steps is not None:
            built.set_total_steps(total_steps)
    except ValueError as exc:
        raise ValueError(as_keywords(str(exc), method)) from None
    return built


def check_option_names(spec: Any, given: dict[str, Any]) -> None:
    """A ValueError in one line for a keyword the method takes no option of, naming the closest (instead of
    Python's TypeError from deep inside the build).
    The options are the fields of the method's options class and the named parameters of its build."""
    options_class = spec.options
    known = {f.name for f in dataclasses.fields(options_class)} if options_class is not None else set()
    params = list(inspect.signature(spec.build).parameters.values())[2:]  # after (comm, topo)
    known |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if options_class is None and any(p.kind is p.VAR_KEYWORD for p in params):
        return  # the build takes anything: it says itself what it refuses
    for name in given:
        if name in known:
            continue
        new = renamed(f"{spec.name}-{name}")
        if new is not None and new.startswith(spec.name + "-"):
            raise ValueError(f"setup({spec.name!r}) option {name!r} was renamed in abtrain 0.2.0: it is "
                             f"{new[len(spec.name) + 1:].replace('-', '_')!r} now")
        close = difflib.get_close_matches(name, sorted(known), n=3)
        raise ValueError(f"setup({spec.name!r}) has no option {name!r}"
                         + (f"; did you mean {', '.join(close)}?" if close else
                            f"; its options: {', '.join(sorted(known)) or 'none'}"))


def as_keywords(message: str, method: str) -> str:
    """A message written for the command line, with its flags named as :func:`setup`'s keyword arguments.

    A method's options are the flags ``--<method>-<name>`` (``--ab-warmup-steps`` becomes ``warmup_steps``
    for ``method="ab"``), and ``--group-size 2`` becomes ``group_size=2``; one wording of every check serves
    both callers.
    """
    prefix = method.replace("_", "-") + "-"

    def keyword(m: re.Match[str]) -> str:
        name = m.group(1).removeprefix(prefix)
        value = m.group(2)
        return name.replace("-", "_") + (f"={value}" if value is not None else "")

    # Only this function's own options: a message may also name a launcher's flag (torchrun --nproc-per-node).
    message = re.sub(rf"--no-{re.escape(prefix)}([a-z0-9-]+)", lambda m: m.group(1).replace("-", "_") + "=False", message)
    return re.sub(rf"--({re.escape(prefix)}[a-z0-9-]+|group-size|backend|device)(?: (\d+|'[^']*'))?", keyword, message)


__all__ = ["as_keywords", "setup"]
