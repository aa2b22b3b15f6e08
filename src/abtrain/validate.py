"""Type and range checks and the base class shared by the option dataclasses.

A value of the wrong type (a string for a number, a float for a count, NaN)
must be reported as a ``ValueError`` naming the flag, not surface later as a
``TypeError`` from a comparison deep in the code. A number of the right type but
beyond what any run uses (``--lr 1e308``, ``--powersgd-seed -1``) is refused the
same way, by one rule for every numeric option (:func:`check_ranges`), before
any worker starts: its consumer (a float32 learning rate, DDP's int64 bucket
bytes, NumPy's 32-bit seed) would otherwise fail inside the workers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

#: The largest magnitude of any numeric option: counts above it are typos (``--steps 99999999999999999999``), and
#: every consumer holds it (float32 computations, int64 byte counts, 32-bit seeds). A field may narrow its range
#: with ``low=`` / ``high=`` in its metadata (:func:`opt`).
MAX_VALUE = 10**9


def _type_name(annotation: Any) -> str:
    # Annotations are strings under ``from __future__ import annotations``, types otherwise.
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def check_types(obj: Any, flag_prefix: str = "--") -> None:
    """Check every scalar field of dataclass ``obj`` against its annotation; raise ValueError on a mismatch.

    Handles ``int``, ``float``, ``str``, ``bool`` and their ``| None`` forms;
    other fields (option sections) are left to their owner. An integer given
    for a float field is converted to float; floats must be finite.
    """
    for f in dataclasses.fields(obj):
        parts = [p.strip() for p in _type_name(f.type).split("|")]
        optional = "None" in parts
        kinds = [p for p in parts if p != "None"]
        if len(kinds) != 1 or kinds[0] not in ("int", "float", "str", "bool"):
            continue
        kind = kinds[0]
        value = getattr(obj, f.name)
        flag = flag_prefix + f.name.replace("_", "-")
        if value is None:
            if optional:
                continue
            raise ValueError(f"{flag} needs a value, got None")
        if kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{flag} must be true or false, got {value!r}")
        elif kind == "str":
            if not isinstance(value, str):
                raise ValueError(f"{flag} must be a string, got {value!r}")
            if "\x00" in value:  # a path with one cannot be opened; said here, not as os's "embedded null byte"
                raise ValueError(f"{flag} holds a NUL character (\\x00), which no path or name may hold: {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{flag} must be {'an integer' if kind == 'int' else 'a number'}, got {value!r}")
        elif kind == "int" and not isinstance(value, int):
            raise ValueError(f"{flag} must be an integer, got {value!r}")
        elif kind == "float":
            try:
                value = float(value)
            except OverflowError:
                raise ValueError(f"{flag} is too large, got {value!r}") from None
            if not math.isfinite(value):
                raise ValueError(f"{flag} must be a finite number, got {value!r}")
            setattr(obj, f.name, value)


def value_range(f: dataclasses.Field) -> tuple[int | float, int | float] | None:
    """The range a numeric field of an options dataclass accepts (None for other fields): integers from 0, numbers
    from -MAX_VALUE, both up to MAX_VALUE, unless the field's metadata gives ``low`` / ``high``."""
    kinds = [p.strip() for p in _type_name(f.type).split("|") if p.strip() != "None"]
    if kinds not in (["int"], ["float"]):
        return None
    return f.metadata.get("low", 0 if kinds == ["int"] else -MAX_VALUE), f.metadata.get("high", MAX_VALUE)


def check_ranges(obj: Any, flag_prefix: str = "--") -> None:
    """Refuse (ValueError naming the flag and the range) any number of dataclass ``obj`` outside its
    :func:`value_range`. Run after the owner's own checks, whose messages say more where they apply: this one rule
    catches every value they let through that no consumer can hold."""
    for f in dataclasses.fields(obj):
        bounds = value_range(f)
        value = getattr(obj, f.name)
        if bounds is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        low, high = bounds
        flag = flag_prefix + f.name.replace("_", "-")
        if value > high:
            shown, limit = (f"{value:g}", f"{high:g}") if isinstance(value, float) else (str(value), f"{high:,}")
            raise ValueError(f"{flag} {shown} is beyond any real run (at most {limit}); check the number")
        if not low <= value <= high:
            what = (f"an integer from {low:,} to {high:,}" if isinstance(value, int)
                    else f"a number from {low:g} to {high:g}")
            raise ValueError(f"{flag} must be {what}, got {value!r}")


def opt(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with its help text (and e.g. ``choices=``), from which the CLI builds the flag."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass
class Options:
    """Base of a method's options dataclass (the flags ``--<section>-<name>``, the TOML table ``[<section>]``).

    A subclass sets ``section`` (the method's name, dashes as underscores: the flags keep the dashes), the
    defaults that follow from other options in :meth:`derived`, and its value checks in :meth:`check`; types
    and ``choices=`` are checked first and derived defaults filled in, so that a check can rely on them.
    """

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_types(self, f"--{self.section.replace('_', '-')}-")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"unknown {self.flag(f.name)} {getattr(self, f.name)!r}; "
                                 f"choose one of: {', '.join(choices)}")
        for name, value in self.derived().items():
            setattr(self, name, value)
        self.check()
        check_ranges(self, f"--{self.section.replace('_', '-')}-")

    def derived(self) -> dict[str, Any]:
        """The values of options left unset (None) whose default follows from the others, by name: resolved
        here, once, when the options are built, so that :meth:`check` and every reader see them."""
        return {}

    def check(self) -> None:
        """The values' own rules (ranges, combinations); raise a ValueError that names the flag."""

    @classmethod
    def flag(cls, name: str) -> str:
        """The command-line flag of option ``name``."""
        return f"--{cls.section.replace('_', '-')}-{name.replace('_', '-')}"

    def require(self, name: str, ok: bool, what: str) -> None:
        """Raise ``<flag> must be <what>, got <value>`` unless ``ok``."""
        if not ok:
            raise ValueError(f"{self.flag(name)} must be {what}, got {getattr(self, name)!r}")
