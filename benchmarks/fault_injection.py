"""Fault injection: SIGKILL a random worker at a random step, and feed the CLI bad input.

Part 1 runs a tiny job (2 workers, MLP on synthetic data, DDP or AB-training)
once without faults per method, then N times under ``--max-restarts 1`` while
killing one random worker process with SIGKILL right after a random step, and
compares each run's final weights (RUN_DIR/model.pt) with the uninterrupted
run's. Part 2 feeds bad input: invalid flags and values, conflicting options,
broken config files, corrupt datasets (in-process through ``abtrain.cli.main``,
which is what the command runs before any worker starts), and a subset through
the real command, including truncated, garbled, foreign and code-running
checkpoints. Each must end with one ``abtrain: error:`` line, a non-zero exit
and nothing already saved changed.

    .venv/bin/python benchmarks/fault_injection.py [--runs 20] [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from abtrain.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
ABTRAIN = [sys.executable, "-m", "abtrain.cli"]
STEPS = 30
JOB = ["--workers", "2", "--model", "mlp", "--dataset", "synthetic", "--steps", str(STEPS), "--batch-size", "16",
       "--eval-every", "10", "--log-every", "1", "--seed", "3"]
METHODS = {
    "ddp": ["--method", "ddp"],
    "ab": ["--method", "ab", "--group-size", "1", "--ab-warmup-steps", "4", "--ab-cycle-steps", "8",
           "--ab-rebound-steps", "2", "--ab-rank-fraction", "0.25"],
}


def env() -> dict[str, str]:
    e = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "TORCHELASTIC_RESTART_COUNT"):
        e.pop(var, None)
    return e


def worker_pids(pid: int) -> list[int]:
    """The launcher's spawned worker processes, from /proc."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = []
    for child in children:
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(int(child))
        except OSError:
            pass
    return out


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", weights_only=True)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


# ---------------------------------------------------------------- part 1: kills
def kill_run(method: str, run_dir: Path, kill_step: int, rng: random.Random) -> dict:
    args = ABTRAIN + ["train", *JOB, *METHODS[method], "--checkpoint-every", "3", "--max-restarts", "1",
                      "--out", str(run_dir)]
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    killed = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if killed is None and line.startswith(f"step {kill_step}/"):
            workers = worker_pids(proc.pid)
            if workers:
                killed = rng.randrange(len(workers))
                os.kill(workers[killed], signal.SIGKILL)
    proc.wait()
    stderr = proc.stderr.read() if proc.stderr else ""
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
    return {"method": method, "kill_step": kill_step, "killed_worker": killed, "returncode": proc.returncode,
            "status": status.get("status"), "seconds": round(time.perf_counter() - start, 1),
            "error": stderr.strip().splitlines()[-1] if proc.returncode and stderr.strip() else None}


# ---------------------------------------------------------------- part 2: bad input
def bad_argvs(tmp: Path) -> list[list[str]]:
    """Flags and values a user might get wrong; each list is one invocation's arguments after 'train'."""
    base = ["--workers", "2", "--dataset", "synthetic", "--model", "mlp", "--steps", "2", "--out", str(tmp / "fuzz-run")]
    bad_values = ["0", "-1", "-7", "abc", "nan", "inf", "1e400", "", "1.5"]
    positive_ints = ["--workers", "--batch-size", "--block-size", "--epochs", "--steps", "--eval-every", "--log-every",
                     "--group-size", "--threads", "--limit-train", "--limit-test", "--checkpoint-every", "--stop-after",
                     "--ab-cycle-steps", "--localsgd-h", "--diloco-h", "--powersgd-rank"]
    positive_floats = ["--lr", "--timeout", "--bucket-cap-mb", "--grad-clip", "--diloco-outer-lr"]
    unit_interval = ["--momentum", "--label-smoothing", "--ab-tau", "--ab-rank-fraction", "--ab-energy",
                     "--diloco-outer-momentum"]
    out: list[list[str]] = []
    for flag in positive_ints:
        out += [base + [flag, v] for v in bad_values]
    for flag in positive_floats:
        out += [base + [flag, v] for v in ("0", "-1", "abc", "nan", "inf", "1e400", "")]
    for flag in unit_interval:
        out += [base + [flag, v] for v in ("-0.5", "1.5", "abc", "nan", "7")]
    for flag in ("--method", "--model", "--dataset", "--optimizer", "--lr-schedule", "--backend", "--device",
                 "--ab-sync", "--ab-split", "--ab-init", "--ab-optimizer-state"):
        out += [base + [flag, v] for v in ("bogus", "", "DDP")]
    out += [base + [flag] for flag in ("--lerning-rate", "--ab", "--resume-from", "--worker", "-x")]
    out += [base + [flag, v] for flag in ("--weight-decay", "--warmup-lr-steps", "--max-restarts", "--ab-warmup-steps",
                                          "--ab-rebound-steps", "--ab-lr-rebound-steps", "--ab-lr-floor",
                                          "--ab-min-compression", "--powersgd-start-iter",
                                          "--powersgd-min-compression-rate", "--powersgd-orthogonalization-epsilon")
            for v in ("-1", "abc", "nan")]
    conflicts = [
        ["--method", "ab"],  # one group of 2 workers: AB needs two groups
        ["--method", "ab", "--group-size", "1", "--ab-tau", "0.2", "--ab-rank", "3"],
        ["--method", "ab", "--group-size", "1", "--ab-rebound-steps", "8", "--ab-cycle-steps", "8"],
        ["--method", "ab", "--group-size", "1", "--ab-full-rank", "*"],
        ["--group-size", "3"],
        ["--stop-after", "2"],
        ["--stop-after", "5"],
        ["--batch-size", "4096"],
        ["--workers", "5000"],
        ["--limit-train", "1"],
        ["--powersgd-start-iter", "1", "--method", "powersgd"],
        ["--resume", str(tmp / "no-such-run")],
        ["--resume", str(tmp)],
    ]
    out += [base + c for c in conflicts]
    return out


def bad_files(tmp: Path) -> list[list[str]]:
    """Broken config files and datasets."""
    base = ["--workers", "2", "--model", "mlp", "--steps", "2", "--out", str(tmp / "fuzz-run")]
    cases = []
    tomls = ['lerning_rate = 0.1\n', 'batch-size = "big"\n', 'lr = nan\n', 'steps = 1.5\n', 'method = 3\n',
             '[ab]\ntau = "x"\n', '[ab]\nbogus = 1\n', 'ab = 4\n', 'this is not toml\n', 'workers = -2\n',
             'ledger = "yes"\n', '[localsgd]\nh = 0\n', 'timeout = inf\n', 'steps = -5\n']
    for i, text in enumerate(tomls):
        path = tmp / f"bad{i}.toml"
        path.write_text(text)
        # Only the file's values: flags would override them.
        cases.append(["--dataset", "synthetic", "--model", "mlp", "--out", str(tmp / "fuzz-run"), "--config", str(path)])
    cases.append(base + ["--dataset", "synthetic", "--config", str(tmp / "missing.toml")])
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import make_fake_fashion
    good = make_fake_fashion(tmp / "fashion-good", n_train=256, n_test=64)
    damages = {
        "truncated": lambda b: b[: len(b) // 2],
        "empty": lambda b: b"",
        "garbage": lambda b: os.urandom(len(b)),
        "not-gzip": lambda b: gzip.decompress(b)[:100],
        "bad-magic": lambda b: gzip.compress(b"\x00\x00\x09\x03" + gzip.decompress(b)[4:]),
        "short-payload": lambda b: gzip.compress(gzip.decompress(b)[:-50]),
    }
    for name, damage in damages.items():
        for stem in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz"):
            d = tmp / f"fashion-{name}-{stem[:4]}-{stem[5:9]}"
            shutil.copytree(good, d)
            (d / stem).write_bytes(damage((d / stem).read_bytes()))
            cases.append(base + ["--dataset", "fashion-mnist", "--data-dir", str(d)])
    missing = tmp / "fashion-missing"
    shutil.copytree(good, missing)
    (missing / "t10k-labels-idx1-ubyte.gz").unlink()
    cases.append(base + ["--dataset", "fashion-mnist", "--data-dir", str(missing)])
    cases.append(base + ["--dataset", "fashion-mnist", "--data-dir", str(tmp / "nowhere")])
    return cases


def in_process(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli_main(["train", *argv])
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    return code, err.getvalue()


def one_clear_line(code: int, stderr: str) -> bool:
    lines = stderr.strip().splitlines()
    return code != 0 and len(lines) == 1 and lines[0].startswith("abtrain: error:") and "Traceback" not in stderr


def digest(run_dir: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(run_dir.rglob("*")):
        if path.is_file() and path.name != "status.json":
            h.update(str(path.relative_to(run_dir)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # would create the marker file if unpickled unsafely
        return (open, (self.marker, "w"))


def checkpoint_cases(tmp: Path) -> list[tuple[str, list[str], Path, Path | None]]:
    """Through the real command: damaged checkpoints of a stopped run, and a resume that changes the run."""
    stopped = tmp / "stopped"
    p = subprocess.run(ABTRAIN + ["train", *JOB, *METHODS["ddp"], "--stop-after", "6", "--out", str(stopped)],
                       capture_output=True, text=True, env=env(), timeout=300)
    assert p.returncode == 0, p.stderr
    shard = "checkpoint/step-00000006/rank1.pt"
    cases = []

    def variant(name: str, change) -> None:
        d = tmp / f"ckpt-{name}"
        shutil.copytree(stopped, d)
        marker = change(d)
        cases.append((name, ["--resume", str(d)], d, marker if isinstance(marker, Path) else None))

    variant("truncated-shard", lambda d: (d / shard).write_bytes((d / shard).read_bytes()[:1000]))

    def garble(d: Path) -> None:
        data = bytearray((d / shard).read_bytes())
        for i in range(200, len(data), 997):
            data[i] ^= 0xFF
        (d / shard).write_bytes(bytes(data))
    variant("garbled-shard", garble)

    def payload(d: Path) -> Path:
        marker = d.parent / f"pwned-{d.name}"
        with open(d / shard, "wb") as fh:
            pickle.dump({"format": "abtrain-checkpoint", "x": _Payload(str(marker))}, fh)
        manifest = json.loads((d / "checkpoint/latest.json").read_text())
        manifest["files"]["rank1.pt"] = (d / shard).stat().st_size
        (d / "checkpoint/latest.json").write_text(json.dumps(manifest))
        return marker
    variant("code-running-pickle", payload)

    def foreign(d: Path) -> None:
        manifest = json.loads((d / "checkpoint/latest.json").read_text())
        manifest["method"] = "ab"
        (d / "checkpoint/latest.json").write_text(json.dumps(manifest))
    variant("foreign-method", foreign)
    variant("manifest-not-json", lambda d: (d / "checkpoint/latest.json").write_text("{oops"))
    variant("missing-shard", lambda d: (d / shard).unlink())
    variant("config-not-json", lambda d: (d / "config.json").write_text("[1, 2"))
    cases.append(("changing-flag", ["--resume", str(stopped), "--lr", "0.5"], stopped, None))
    cases.append(("unknown-flag", ["--resume", str(stopped), "--bogus"], stopped, None))
    cases.append(("bad-value-real-cli", [*JOB, "--lr", "-3"], None, None))
    cases.append(("conflict-real-cli", [*JOB, *METHODS["ab"], "--ab-rank", "2"], None, None))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fault_injection.json"))
    opts = ap.parse_args()
    rng = random.Random(opts.seed)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="abtrain-faults-"))
    try:
        # -- part 1 --------------------------------------------------------
        refs = {}
        for method in METHODS:
            run_dir = tmp / f"ref-{method}"
            p = subprocess.run(ABTRAIN + ["train", *JOB, *METHODS[method], "--out", str(run_dir)],
                               capture_output=True, text=True, env=env(), timeout=300)
            assert p.returncode == 0, p.stderr
            refs[method] = weights(run_dir)
        runs = []
        for i in range(opts.runs):
            method = list(METHODS)[i % len(METHODS)]
            run_dir = tmp / f"kill-{i}"
            r = kill_run(method, run_dir, rng.randint(2, STEPS - 3), rng)
            r["identical"] = r["status"] == "complete" and same(weights(run_dir), refs[method])
            runs.append(r)
            print(f"run {i + 1:2d}/{opts.runs}: {method:3s} kill worker {r['killed_worker']} after step "
                  f"{r['kill_step']:2d}: exit {r['returncode']}, {r['status']}, identical {r['identical']} "
                  f"({r['seconds']} s)", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        # -- part 2 --------------------------------------------------------
        inputs = []
        for n, argv in enumerate(bad_argvs(tmp) + bad_files(tmp)):
            argv = [str(tmp / f"fuzz-run-{n}") if a == str(tmp / "fuzz-run") else a for a in argv]
            code, stderr = in_process(argv)
            inputs.append({"path": "in-process", "argv": argv, "exit": code, "handled": one_clear_line(code, stderr),
                           "message": stderr.strip()[:300]})
        for name, argv, run_dir, marker in checkpoint_cases(tmp):
            before = digest(run_dir) if run_dir else None
            p = subprocess.run(ABTRAIN + ["train", *argv], capture_output=True, text=True, env=env(), timeout=300)
            intact = before is None or digest(run_dir) == before
            safe = marker is None or not marker.exists()
            inputs.append({"path": "cli", "case": name, "argv": argv, "exit": p.returncode,
                           "handled": one_clear_line(p.returncode, p.stderr) and intact and safe,
                           "saved_data_intact": intact, "no_code_ran": safe, "message": p.stderr.strip()[:300]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    killed = [r for r in runs if r["killed_worker"] is not None]
    summary = {
        "runs": len(runs),
        "runs_with_a_kill": len(killed),
        "runs_completed": sum(r["status"] == "complete" and r["returncode"] == 0 for r in runs),
        "runs_identical": sum(r["identical"] for r in runs),
        "bad_inputs": len(inputs),
        "bad_inputs_cli": sum(i["path"] == "cli" for i in inputs),
        "bad_inputs_handled": sum(i["handled"] for i in inputs),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    rows = [("worker killed (SIGKILL) at a random step", f"{summary['runs_with_a_kill']} / {summary['runs']}"),
            ("runs completed after the restart", f"{summary['runs_completed']} / {summary['runs']}"),
            ("final weights identical to the uninterrupted run", f"{summary['runs_identical']} / {summary['runs']}"),
            ("bad inputs handled (one line, exit != 0, nothing damaged)",
             f"{summary['bad_inputs_handled']} / {summary['bad_inputs']} ({summary['bad_inputs_cli']} through the real CLI)"),
            ("wall time", f"{summary['seconds']} s")]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    for i in inputs:
        if not i["handled"]:
            print("NOT HANDLED:", i.get("case") or " ".join(i["argv"][-4:]), "->", i["exit"], i["message"][:200])
    Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.json).write_text(json.dumps({"summary": summary, "runs": runs, "inputs": inputs}, indent=2) + "\n")
    print(f"written {opts.json}")


if __name__ == "__main__":
    main()
