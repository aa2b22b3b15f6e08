"""``abtrain`` command line: parse, validate, launch. Flags are built from TrainConfig."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from . import __version__
from .config import SECTIONS, TrainConfig, ab_fields, coerce, config_fields, read_config_file, section_fields
from .methods.ab import ABConfig


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        self.exit(2, f"abtrain: error: {message} (see '{self.prog} --help')\n")


def _choices(f) -> Sequence[str] | None:
    if "choices" in f.metadata:
        return f.metadata["choices"]
    source = f.metadata.get("choices_from")
    if source == "methods":
        from .methods import METHODS
        return list(METHODS)
    if source == "models":
        from .models import MODELS
        return list(MODELS)
    if source == "datasets":
        from .data import DATASETS
        return list(DATASETS)
    return None


def _add_config_flags(parser: argparse.ArgumentParser, fields: list, defaults: Any, prefix: str = "") -> None:
    for f in fields:
        flag = "--" + prefix + f.name.replace("_", "-")
        typ = str(f.type)
        default = getattr(defaults, f.name)
        help_text = f.metadata["help"] + (f" (default: {default})" if default is not None else "")
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text,
                                  "dest": prefix.replace("-", "_") + f.name}
        if typ == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        kwargs["type"] = int if typ.startswith("int") else float if typ.startswith("float") else str
        choices = _choices(f)
        if choices:
            kwargs["choices"] = choices
            kwargs["metavar"] = "{" + ",".join(choices) + "}"
        else:
            kwargs["metavar"] = f.name.upper()
        parser.add_argument(flag, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="abtrain", description="Communication-efficient distributed training on PyTorch, every byte counted.")
    parser.add_argument("--version", action="version", version=f"abtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser(
        "train", help="train a model with a communication method on local workers or in a torchrun/srun world",
        description="Train a model with a communication method. Without an external launcher, starts --workers "
                    "local workers through torch's elastic launcher; under torchrun or srun, joins that world. "
                    "Writes RUN_DIR/results.json, metrics.csv and status.json.")
    train.add_argument("--config", metavar="FILE", help="TOML file with the same keys as these flags; flags override it")
    _add_config_flags(train, config_fields(), TrainConfig())
    ab = train.add_argument_group("AB-training (--method ab)", "the options of ALGORITHM.md; K, F, T_w and R in optimizer steps")
    _add_config_flags(ab, ab_fields(), ABConfig(), prefix="ab-")
    for section, title, description in (
            ("localsgd", "local SGD (--method localsgd)", "workers train alone, the model is averaged every H steps"),
            ("diloco", "DiLoCo (--method diloco)", "H inner steps of the chosen optimizer (AdamW recommended), "
                                                   "then an outer Nesterov step on the averaged pseudo-gradient"),
            ("powersgd", "PowerSGD (--method powersgd)", "torch's PowerSGD DDP hook: rank-r gradient compression "
                                                         "with error feedback and warm start")):
        group = train.add_argument_group(title, description)
        _add_config_flags(group, section_fields(section), SECTIONS[section](), prefix=section + "-")
    return parser


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """Defaults, then the TOML file, then the flags."""
    values: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    if getattr(ns, "config", None):
        for key, value in read_config_file(ns.config).items():
            if key in SECTIONS:
                sections[key] = {k: coerce(k, v, section=key) for k, v in value.items()}
            else:
                values[key] = coerce(key, value)
    for f in config_fields():
        if f.name in ns:
            values[f.name] = getattr(ns, f.name)
    for section, options in sections.items():
        for f in section_fields(section):
            if f"{section}_{f.name}" in ns:
                options[f.name] = getattr(ns, f"{section}_{f.name}")
        values[section] = SECTIONS[section](**options)
    return TrainConfig(**values)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    try:
        if ns.command == "train":
            from .launch import train
            cfg = config_from_args(ns)
            return train(cfg)
    except (ValueError, RuntimeError) as exc:
        print(f"abtrain: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        print("abtrain: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
