"""A method is one file that registers itself: a throwaway one from this directory reaches the CLI's
--help, the config file, the preflight's checks, the workers and results.json with no other edit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from abtrain.methods import registry
from abtrain.validate import Options

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny(workers: int = 2) -> list[str]:
    return ["--model", "mlp", "--dataset", "synthetic", "--workers", str(workers), "--group-size", "1",
            "--steps", "6", "--batch-size", "16", "--limit-test", "128", "--eval-every", "3", "--seed", "0"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
    env[registry.PLUGIN_VARIABLE] = "toy_method"
    return env


def _abtrain(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "abtrain", *args], env=_env(), cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_the_builtin_methods_are_registered_in_their_files():
    assert registry.names() == ["ddp", "ab", "ddp-bf16", "powersgd", "localsgd", "diloco", "streaming-diloco",
                                "sparseloco", "ef21", "onebit", "demo", "hlocalsgd", "none"]
    for spec in registry.specs():
        assert spec.build.__module__.startswith("abtrain.methods.")  # a module of the package, or of a sub-package
        assert spec.options is None or issubclass(spec.options, Options)
    assert [s.name for s in registry.specs() if s.bucket_cap] == ["ddp", "ddp-bf16", "powersgd"]
    with pytest.raises(ValueError, match="unknown method 'nope'; choose one of: ddp, ab"):
        registry.get("nope")


def test_a_spec_refuses_options_of_another_name():
    from toy_method import Toy, ToyConfig  # noqa: F401  (importing registers "toy" in this process too)

    try:
        with pytest.raises(ValueError, match="section 'toy'; they must be the same name"):
            registry.MethodSpec("other", Toy, "t", "h", options=ToyConfig)
    finally:
        registry.unregister("toy")


PROBE = """
import contextlib, io, sys
from abtrain.cli import build_parser, config_from_args
from abtrain.run.plan import preflight

def parse(*args):
    try:
        cfg = config_from_args(build_parser().parse_args(["train", *args]))
    except ValueError as exc:
        return f"error: {exc}"
    return f"{cfg.method} {cfg.toy.every}"

config = sys.argv[1]
print(parse("--config", config))
print(parse("--config", config, "--toy-every", "3"))
print(parse("--method", "toy", "--toy-every", "0"))
try:
    preflight(config_from_args(build_parser().parse_args(["train", *sys.argv[2:]])), 1)
except ValueError as exc:
    print(f"error: {exc}")
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    build_parser().parse_args(["train", "--help"])
print(out.getvalue())
"""


def test_a_method_from_its_own_file_reaches_help_config_and_a_run(tmp_path):
    # In a fresh interpreter that finds the method's module through the variable, as the workers do.
    config = tmp_path / "toy.toml"
    config.write_text('method = "toy"\n[toy]\nevery = 5\n')
    probe = subprocess.run([sys.executable, "-c", PROBE, str(config), *tiny(workers=1), "--method", "toy"],
                           env=_env(), capture_output=True, text=True, timeout=300)
    lines = probe.stdout.splitlines()
    assert lines[:4] == ["toy 5", "toy 3", "error: --toy-every must be a positive integer, got 0",
                         "error: the toy method averages between workers: start it with --workers 2 (or more)"], \
        probe.stderr[-2000:]
    help_text = "\n".join(lines[4:])
    assert "toy averaging (--method toy):" in help_text and "--toy-every EVERY" in help_text
    assert ",hlocalsgd,toy,none}" in help_text  # among --method's choices, before the compute floor

    # A 2-worker run: the workers find the method through the same variable.
    run = _abtrain("train", *tiny(), "--method", "toy", "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-2000:]
    with open(tmp_path / "run" / "results.json") as fh:
        results = json.load(fh)
    assert results["method"] == "toy" and results["config"]["toy"] == {"every": 2}
    assert results["toy"] == {"every": 2, "syncs": 3}  # after steps 2, 4 and 6
    phases = results["comm"]["by_phase"]
    assert phases["toy-average"]["calls"] == 3 and set(phases) == {"setup", "toy-average", "eval"}
