"""``abtrain`` command line: parse, validate, launch. Flags are built from TrainConfig.

Only the standard library is imported at the top: :func:`main` installs the signal handlers
(:mod:`abtrain.run.interrupt`) before torch is imported, so Ctrl-C or SIGTERM at any moment ends the command with one
line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__
from .run import interrupt

if TYPE_CHECKING:
    from .config import TrainConfig


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        self.exit(2, f"abtrain: error: {_renamed_flag(message) or message} (see '{self.prog} --help')\n")


def _renamed_flag(message: str) -> str | None:
    """For argparse's "unrecognized arguments" that hold a flag renamed in 0.2.0: the line that names the new one."""
    from .config import renamed
    head = "unrecognized arguments: "
    for token in message[len(head):].split() if message.startswith(head) else ():
        new = renamed(token.split("=")[0]) if token.startswith("--") else None
        if new:
            return f"{token.split('=')[0]} was renamed in abtrain 0.2.0: it is --{new} now"
    return None


class _CheckingParser(_Parser):
    """Raises the error as a ValueError instead of exiting: for flags checked on behalf of another command."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _choices(f) -> Sequence[str] | None:
    from .methods import registry
    if "choices" in f.metadata:
        return f.metadata["choices"]
    source = f.metadata.get("choices_from")
    if source == "methods":
        return registry.names()
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
        # a default of None is resolved from the other options (said in the help text), not a fixed value
        default = getattr(defaults, f.name) if f.default is not None else None
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


def build_parser(parser_class: type[_Parser] = _Parser) -> argparse.ArgumentParser:
    from .config import SECTIONS, TrainConfig, config_fields, section_fields
    from .methods import registry
    parser = parser_class(prog="abtrain", description="Communication-efficient distributed training on PyTorch, every byte counted.")
    parser.add_argument("--version", action="version", version=f"abtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=parser_class)
    train = sub.add_parser(
        "train", help="train a model with a communication method on local workers or in a torchrun/srun world",
        description="Train a model with a communication method. Without an external launcher, starts --workers "
                    "local workers through torch's elastic launcher; under torchrun or srun, joins that world. "
                    "Writes RUN_DIR/results.json, metrics.csv, status.json, model.pt and checkpoints "
                    "(RUN_DIR/checkpoint); --resume RUN_DIR continues a run that stopped or crashed.")
    train.add_argument("--config", metavar="FILE", help="TOML file with the same keys as these flags, or a run's "
                       "config.json to repeat it (with another --out); flags override it")
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue the run in RUN_DIR from its last checkpoint, with its saved configuration; "
                            "only " + ", ".join("--" + n.replace("_", "-") for n in RESUME_OPTIONS + RESUME_SETTINGS)
                            + " may be given (--lr and --grad-clip: to continue after a divergence)")
    _add_config_flags(train, config_fields(), TrainConfig())
    for spec in registry.with_options():
        group = train.add_argument_group(f"{spec.title} (--method {spec.name})", spec.help)
        _add_config_flags(group, section_fields(spec.section), SECTIONS[spec.section](), prefix=spec.name + "-")
    _add_bench_parser(sub)
    _add_data_parser(sub)
    return parser


def _add_data_parser(sub: Any) -> None:
    data = sub.add_parser("data", help="get datasets", description="Get the datasets abtrain trains on.")
    actions = data.add_subparsers(dest="action", required=True, parser_class=_Parser)
    fetch = actions.add_parser(
        "fetch", help="download a dataset from its canonical location, checksums verified",
        description="Download a dataset's files from their canonical location (Fashion-MNIST: the dataset's "
                    "GitHub repository, then its S3 website) and verify the SHA-256 of each file's "
                    "uncompressed content. Files already present and valid are kept; a file is renamed into "
                    "place only once it is complete and verified. Exit code 1 when a download fails (no network, wrong checksum), 2 for bad input.")
    fetch.add_argument("dataset", choices=["fashion-mnist"], help="the dataset to download")
    fetch.add_argument("--data-dir", metavar="DIR",
                       help="directory to write the files to (default: $ABTRAIN_DATA/fashion-mnist, else "
                            "~/.cache/abtrain/fashion-mnist, where 'abtrain train' finds them)")
    fetch.add_argument("--base-url", metavar="URL",
                       help="download from this directory URL instead (http://, https:// or file://; default: "
                            "$ABTRAIN_FASHION_MNIST_URL, else the canonical locations)")


def _add_bench_parser(sub: Any) -> None:
    from .sidebyside.workloads import DEFAULT_METHODS, WORKLOADS
    bench = sub.add_parser(
        "bench", help="run several methods on one workload, side by side, and write a report",
        description="Run methods one after another on a named workload with the same data order, seed, workers, "
                    "groups and step budget, each as its own 'abtrain train' run under OUT/runs/METHOD. Writes "
                    "OUT/report.md, report.json and PNG plots. Exit code 1 when a method failed (the report "
                    "still shows the others).")
    bench.add_argument("--workload", default="fashion-cnn", choices=list(WORKLOADS),
                       help="named workload (default: fashion-cnn)")
    bench.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                       help=f"comma-separated methods to run, in order (default: {','.join(DEFAULT_METHODS)})")
    bench.add_argument("--quick", action="store_true",
                       help="the workload's quick variant: fewer samples and steps, minutes for all methods")
    bench.add_argument("--out", metavar="DIR", help="output directory (default: runs/bench-<workload>-<time>)")
    bench.add_argument("--extra", default="", metavar="FLAGS",
                       help="'abtrain train' flags added to every run, e.g. --extra \"--batch-size 32\" "
                            "(one flag alone needs '=': --extra=--no-ledger)")
    bench.add_argument("--method-args", action="append", default=[], metavar="METHOD:FLAGS",
                       help="flags added to one method's run, e.g. 'ab:--ab-rank-fraction 0.1' (repeatable)")
    bench.add_argument("--net", metavar="SPEC",
                       help="run the workers through a real shaped network (Linux, root): each group of workers "
                            "in one network namespace (a node; layout=worker: one per worker) behind a shaped link, "
                            "e.g. rate=100mbit,delay=2ms,layout=node; reports measured interface bytes")
    bench.add_argument("--steps-factor", type=float, default=1.0, metavar="F",
                       help="every method but ddp and none runs F times the workload's steps, its learning-rate "
                            "schedule stretched over them (default: 1); the report gives each method's time to "
                            "DDP's final metric and its metric at DDP's time")
    model = bench.add_argument_group("projection", "the alpha-beta network model of the report's projection "
                                                   "to 8-256 workers (a model, not a measurement)")
    model.add_argument("--intra-bw", type=float, default=100.0, metavar="GB/S",
                       help="bandwidth per worker inside a node, GB/s (default: 100)")
    model.add_argument("--inter-bw", type=float, default=12.5, metavar="GB/S",
                       help="bandwidth per worker between nodes, GB/s (default: 12.5)")
    model.add_argument("--intra-latency", type=float, default=1.0, metavar="US",
                       help="latency of one message inside a node, microseconds (default: 1)")
    model.add_argument("--inter-latency", type=float, default=5.0, metavar="US",
                       help="latency of one message between nodes, microseconds (default: 5)")
    model.add_argument("--node-size", type=int, default=4, metavar="N", help="workers per node (default: 4)")


def check_train_flags(text: str, where: str) -> None:
    """Refuse (ValueError naming ``where``) 'abtrain train' flags that its parser refuses: an unknown flag or a
    value of the wrong type given to ``abtrain bench`` fails now, in one line, not in every method's run."""
    try:
        tokens = shlex.split(text)
    except ValueError:
        return  # unbalanced quotes: BenchConfig says so
    if "-h" in tokens or "--help" in tokens:
        raise ValueError(f"{where}: --help is not a flag of a run")
    try:
        build_parser(_CheckingParser).parse_args(["train", *tokens])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def bench_config_from_args(ns: argparse.Namespace) -> Any:
    from .sidebyside import BenchConfig, NetworkModel, parse_method_args
    check_train_flags(ns.extra, f"--extra {ns.extra!r}")
    for item in ns.method_args:
        check_train_flags(item.partition(":")[2], f"--method-args {item!r}")
    model = NetworkModel(intra_bw=ns.intra_bw * 1e9, inter_bw=ns.inter_bw * 1e9,
                         intra_latency=ns.intra_latency * 1e-6, inter_latency=ns.inter_latency * 1e-6,
                         node_size=ns.node_size)
    return BenchConfig(workload=ns.workload, methods=[m.strip() for m in ns.methods.split(",") if m.strip()],
                       quick=ns.quick, out=ns.out, extra=ns.extra, method_args=parse_method_args(ns.method_args),
                       net=ns.net, network_model=model, steps_factor=ns.steps_factor)


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """Defaults, then the TOML file, then the flags."""
    from .config import TrainConfig, merge, nest, read_config_file
    values = read_config_file(ns.config) if getattr(ns, "config", None) else {}
    flags = {k: v for k, v in vars(ns).items() if k not in ("command", "config", "resume")}
    return TrainConfig.from_dict(merge(values, nest(flags)))


#: Options that may differ when a run is continued: they change how it runs, not what it computes...
RESUME_OPTIONS = ("max_restarts", "stop_after", "checkpoint_every", "timeout", "log_every", "threads")
#: ... and the two a run may need after a divergence; a change is recorded in results.json's ``resumes``.
RESUME_SETTINGS = ("lr", "grad_clip")


def config_for_resume(ns: argparse.Namespace) -> TrainConfig:
    """The configuration saved in ``ns.resume``'s run directory, plus the few options a resume may change."""
    from .config import TrainConfig
    from .run.rundir import check_layout
    from .run.safefile import read_text
    run_dir = ns.resume
    path = os.path.join(run_dir, "config.json")
    if not os.path.isdir(run_dir):
        raise ValueError(f"--resume {run_dir}: no such run directory")
    check_layout(run_dir)  # before any file of it is read: a link or FIFO there is refused, not followed
    if getattr(ns, "config", None):
        raise ValueError("--resume takes the configuration saved in the run directory; drop --config")
    given = sorted(k for k in vars(ns) if k not in ("command", "config", "resume"))
    allowed = RESUME_OPTIONS + RESUME_SETTINGS
    refused = [k for k in given if k not in allowed]
    if refused:
        raise ValueError(f"--resume continues the run with its saved configuration; "
                         f"{', '.join('--' + k.replace('_', '-') for k in refused)} would change it "
                         f"(allowed: {', '.join('--' + k.replace('_', '-') for k in allowed)})")
    try:
        saved = json.loads(read_text(path))
    except FileNotFoundError:
        raise ValueError(f"{run_dir} has no config.json: not a run directory of 'abtrain train'") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is unreadable: {exc}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} does not hold a configuration")
    from .run.checkpoint import check_config, read_manifest
    manifest = read_manifest(run_dir)
    if manifest is not None:
        check_config(manifest, saved, path)
        # --lr / --grad-clip given at an earlier resume hold until changed again: the checkpoint knows them.
        settings = manifest.get("settings")
        if isinstance(settings, dict):
            saved.update({k: settings[k] for k in RESUME_SETTINGS if k in settings})
    saved["stop_after"] = None  # a stop belongs to the invocation that asked for it
    saved["out"] = run_dir  # where the run is now (a copied or moved run directory writes its new path)
    saved.update({k: getattr(ns, k) for k in given})
    try:
        return TrainConfig.from_dict(saved, path)
    except TypeError as exc:
        raise ValueError(f"{path} does not hold a valid configuration: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """The ``abtrain`` command; ``argv`` given: called in-process, the caller's signal handlers come back after."""
    handlers = None
    try:
        handlers = interrupt.install()  # first of all: torch's import takes seconds and may meet a Ctrl-C
        # torch's C++ log lines (a store's connection retries, each with a C++ stack) come before abtrain's one
        # line and repeat it; read once, when torch is imported. TORCH_CPP_LOG_LEVEL=WARNING brings them back.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        return _main(argv)
    except KeyboardInterrupt as exc:  # before anything was started (a run's interruption is said by the launcher)
        interrupt.acknowledge()
        print(f"abtrain: interrupted ({interrupt.signal_of(exc)})", file=sys.stderr, flush=True)
        return 130
    finally:
        if argv is not None:
            interrupt.restore(handlers)
        elif interrupt.received():
            interrupt.ignore_all()  # a second signal, after the line that said how the run ended


def _main(argv: Sequence[str] | None) -> int:
    from .run.rundir import RunFailed
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    try:
        if ns.command == "train":
            from .run.launch import train
            if getattr(ns, "resume", None):
                return train(config_for_resume(ns), resume_dir=ns.resume)
            cfg = config_from_args(ns)
            return train(cfg)
        if ns.command == "data":
            from .fetch import fetch_fashion_mnist
            path = fetch_fashion_mnist(ns.data_dir, base_url=ns.base_url)
            print(f"abtrain: Fashion-MNIST is in {path}")
            return 0
        if ns.command == "bench":
            from .sidebyside import run_bench
            report = run_bench(bench_config_from_args(ns))
            if report["interrupted"]:
                return 130
            failed = [r for r in report["methods"] if r["status"] != "complete"]
            if failed:  # said on stdout with the rest of the report; the failure itself belongs on stderr too
                print(f"abtrain: error: {len(failed)} of {len(report['methods'])} methods failed: "
                      + "; ".join(f"{r['method']}: {r.get('error') or r['status']}" for r in failed),
                      file=sys.stderr)
            return 1 if failed else 0
    except RunFailed as exc:
        print(f"abtrain: error: {exc}", file=sys.stderr)
        return exc.code
    except (ValueError, RuntimeError) as exc:
        print(f"abtrain: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
