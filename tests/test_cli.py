"""The CLI as a user types it: end-to-end runs on tiny data, bad input, config files, the flag surface."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import abtrain
from abtrain.cli import build_parser, config_from_args, main
from abtrain.methods.summary import human_bytes
from helpers import OLD_AB_DEFAULTS

ROOT = Path(__file__).resolve().parent.parent
ABTRAIN = [sys.executable, "-m", "abtrain.cli"]
TINY = ["--steps", "4", "--batch-size", "16", "--limit-test", "64", "--log-every", "2"]


def run(args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        env.pop(var, None)
    return subprocess.run(ABTRAIN + list(args), capture_output=True, text=True, timeout=240, env=env, **kw)


def test_ddp_with_adamw_holds_its_formulas_training_state(tmp_path):
    """AdamW keeps a step count per parameter tensor besides its two moments: DDP's figure counts it too, so a
    DDP run holds exactly the training state its formula gives for the same model."""
    out = tmp_path / "run"
    p = run(["train", "--method", "ddp", "--workers", "2", "--model", "mlp", "--dataset", "synthetic",
             "--optimizer", "adamw", "--out", str(out), *TINY])
    assert p.returncode == 0, p.stderr
    r = json.loads((out / "results.json").read_text())
    assert r["training_state_bytes"] == r["ddp_equivalent"]["training_state_bytes"] > 4 * 4 * r["params"]


def test_ddp_end_to_end(tmp_path, fashion_dir):
    out = tmp_path / "run"
    p = run(["train", "--method", "ddp", "--workers", "2", "--data-dir", str(fashion_dir), "--model", "cnn",
             "--out", str(out), *TINY])
    assert p.returncode == 0, p.stderr
    r = json.loads((out / "results.json").read_text())
    for key in ("method", "world_size", "steps", "wall_seconds", "params", "peak_rss_bytes", "history"):
        assert key in r
    assert (r["method"], r["world_size"], r["steps"]) == ("ddp", 2, 4)
    assert 0 <= r["final"]["test_accuracy"] <= 1 and r["final"]["test_loss"] > 0
    comm = r["comm"]
    for key in ("payload_bytes", "wire_bytes", "calls", "by_phase"):
        assert key in comm
    for scope in ("global", "group"):
        assert set(comm["by_scope"][scope]) >= {"payload_bytes", "wire_bytes"}
    assert comm["by_phase"]["train"]["payload_bytes"] == 4 * r["params"] * 4
    row = r["history"][-1]
    assert set(row) >= {"step", "epoch", "test_accuracy", "test_loss", "train_loss", "wire_bytes", "wall_seconds"}
    assert row["wire_bytes"] == pytest.approx(comm["wire_bytes"] - comm["by_phase"]["eval"]["wire_bytes"], rel=0.01)
    assert (out / "metrics.csv").read_text().startswith("step,epoch,test_accuracy")
    assert json.loads((out / "status.json").read_text())["status"] == "complete"
    assert "test accuracy" in p.stdout and "results.json" in p.stdout
    # The DDP reference every other method's summary sets its bytes against is this run's train phase.
    assert r["ddp_equivalent"]["wire_bytes"] == pytest.approx(comm["by_phase"]["train"]["wire_bytes"])
    assert r["ddp_equivalent"]["global_wire_bytes"] == 0 and "versus DDP" not in p.stdout  # one group of 2
    # training state: fp32 parameters, gradients and SGD's momentum, nothing else; the formula DDP's figure uses
    assert r["training_state_bytes"] == r["ddp_equivalent"]["training_state_bytes"] == 3 * 4 * r["params"]
    # one step's forward and backward, counted on each worker at the first step: the same model and batch
    assert r["multiply_adds_by_worker"][0] == r["multiply_adds_by_worker"][1] and r["multiply_adds_by_worker"][0]["train"] > 0
    assert "multiply-adds" in p.stdout


def test_the_default_job_is_ab_training_with_bytes_next_to_ddp(tmp_path, fashion_dir):
    """`abtrain train` without --method: AB-training, 4 workers in 2 groups, the summary against DDP's bytes."""
    out = tmp_path / "default"
    p = run(["train", "--data-dir", str(fashion_dir), "--model", "mlp", "--out", str(out), *TINY, "--steps", "40"])
    assert p.returncode == 0, p.stderr
    r = json.loads((out / "results.json").read_text())
    assert (r["method"], r["world_size"], r["group_size"]) == ("ab", 4, 2)
    assert "one node of 4 workers: 2 groups of 2" in p.stdout
    assert "WARNING" not in p.stderr and "rose" not in p.stdout  # nothing to warn about in its own defaults
    ddp = 40 * 2 * 3 / 4 * 4 * r["params"]  # 40 steps of a ring all-reduce of fp32 gradients over 4 workers
    assert r["ddp_equivalent"] == {"wire_bytes": pytest.approx(ddp), "global_wire_bytes": pytest.approx(ddp),
                                   "training_state_bytes": 3 * 4 * r["params"]}  # SGD with momentum
    # the low-rank model: no layer's factors hold as many numbers as its W (the default rank cap)
    assert r["compression_ratio"] >= 1.0 and r["model_params"] <= r["params"]
    assert [set(entry["layers"]) for entry in r["ranks"]] == [{"hidden.weight"}] * len(r["ranks"])  # 256 x 256
    assert all(entry["layers"]["hidden.weight"] * (256 + 256) < 256 * 256 for entry in r["ranks"])
    ours = r["comm"]["by_scope"]["global"]["wire_bytes"], r["comm"]["wire_bytes"]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("  versus DDP"))
    for theirs, mine, what in ((ddp, ours[0], "global"), (ddp, ours[1], "total")):
        ratio = f"{theirs / mine:.1f}x fewer" if mine <= theirs else f"{mine / theirs:.1f}x more"
        assert f"{what} {ratio}" in line, line
    assert "  DDP, same steps global" in p.stdout
    # a decomposition every 16 steps (the floor): one line says the layers stay as they were, later ones that change
    # nothing are quiet
    heads = [ln for ln in p.stdout.splitlines() if "AB-training: decomposition at step" in ln]
    assert len(r["ranks"]) > len(heads) >= 2 and sum("every layer as before" in ln for ln in heads) == 1, heads
    # training state per worker: the groups train different factors; the headline is the most any worker held,
    # and each phase's parts are those of the worker that held the most in it
    workers = r["training_state_by_worker"]
    totals = [{phase: sum(parts.values()) for phase, parts in w.items()} for w in workers]
    assert len(workers) == 4 and "ab" in totals[0] and all(set(t) == set(totals[0]) for t in totals)
    assert r["training_state_bytes"] == max(max(t.values()) for t in totals)
    assert {phase: sum(parts.values()) for phase, parts in r["training_state_by_phase"].items()} == {
        phase: max(t[phase] for t in totals) for phase in totals[0]}
    assert f"training state  {human_bytes(r['training_state_bytes'])} per worker at most" in p.stdout
    assert len(r["multiply_adds_by_worker"]) == 4 and all(set(m) == set(totals[0]) for m in r["multiply_adds_by_worker"])


def test_ab_end_to_end_with_config_file(tmp_path, fashion_dir):
    out = tmp_path / "ab"
    cfg = tmp_path / "ab.toml"
    cfg.write_text('method = "ab"\nworkers = 4\ngroup-size = 2\nsteps = 100\n'
                   '[ab]\nwarmup-steps = 2\nsync-every = 4\nrebound-steps = 1\nrank-fraction = 0.25\nquiet = true\n')
    p = run(["train", "--config", str(cfg), "--data-dir", str(fashion_dir), "--model", "cnn", "--out", str(out), *TINY,
             "--steps", "12"])  # the flag overrides the file's steps
    assert p.returncode == 0, p.stderr
    r = json.loads((out / "results.json").read_text())
    assert r["method"] == "ab" and r["steps"] == 12 and r["world_size"] == 4
    assert "AB-training" not in p.stdout  # quiet: no schedule, no per-layer decisions
    assert set(r["comm"]["by_phase"]) >= {"warmup", "ab", "sync", "rebound"}
    assert r["comm"]["by_scope"]["group"]["wire_bytes"] > 0 and r["comm"]["by_scope"]["global"]["wire_bytes"] > 0
    assert r["compression_ratio"] > 1
    assert [p["phase"] for p in r["phases"]] == ["warmup", "ab", "rebound", "ab", "rebound", "ab"]
    assert r["ranks"][0]["step"] == 2 and len(r["ranks"]) == 3
    assert r["svd_seconds"] > 0 and r["sync_seconds"] > 0


BAD = [
    (["--method", "gossip"], "invalid choice"),
    (["--model", "transformer9"], "invalid choice"),
    (["--batch-size", "0"], "must be positive"),
    (["--lr", "-1"], "must be positive"),
    (["--steps", "abc"], "invalid int value"),
    (["--batch-size", "4096"], "larger than each worker's shard"),
    (["--data-dir", "/nonexistent/fashion"], "not found"),
    (["--model", "gpt"], "gpt"),
    (["--method", "ab", "--group-size", "2"], "at least 2 groups of workers, got 1 (2 workers in groups of 2): pass e.g. --group-size 1"),
    (["--method", "ab", "--workers", "1"], "world of one process: start it with --workers 2"),
    (["--method", "ab", "--group-size", "3", "--workers", "4"], "cannot be split into groups of 3"),
    (["--method", "ab", "--group-size", "1", "--ab-tau", "1.5"], "tau"),
    (["--method", "ab", "--group-size", "1", "--ab-rebound-steps", "10", "--ab-sync-every", "10"], "must be smaller"),
    (["--method", "ab", "--group-size", "1", "--ab-full-rank", "*"], "nothing to factorise"),
    (["--method", "ab", "--group-size", "1", "--ab-tau", "0.2", "--ab-rank", "3"], "choose one rank rule"),
    (["--method", "ab", "--group-size", "1", "--ab-split", "tangent", "--ab-sync", "with-stale"],
     "use --ab-sync only-learned"),
    (["--method", "ab", "--group-size", "1", "--ab-sync-payload", "factors", "--ab-svd", "update"],
     "use it with --ab-sync-payload lowrank"),
    (["--method", "ab", "--group-size", "1", "--ab-split", "sqrt", "--ab-tangent-core", "mean"],
     "use it with --ab-split tangent"),
    (["--method", "ab", "--group-size", "1", "--ab-split", "sqrt", "--ab-sync-payload", "lowrank"],
     "use it with --ab-split tangent --ab-sync only-learned"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_one_clear_line(tmp_path, fashion_dir, capsys, args, message):
    # In this process (a fresh interpreter per case would cost more than the checks): `abtrain` is main().
    # test_unwritable_run_dir_and_bad_config runs the same kind of refusal as a command.
    out = tmp_path / "bad"
    data = [] if "--data-dir" in args else ["--data-dir", str(fashion_dir)]
    try:
        code = main(["train", "--workers", "2", *data, "--out", str(out), "--steps", "2", *args])
    except SystemExit as exc:
        code = exc.code
    p = capsys.readouterr()
    assert code not in (0, None)
    lines = p.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("abtrain: error:"), p.err
    assert message in lines[0]
    assert "Traceback" not in p.err + p.out
    assert not (out / "results.json").exists()


def test_unwritable_run_dir_and_bad_config(tmp_path, fashion_dir):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = run(["train", "--data-dir", str(fashion_dir), "--out", str(blocker / "run")])
    assert p.returncode == 2 and "cannot write to run directory" in p.stderr
    cfg = tmp_path / "c.toml"
    cfg.write_text("lerning_rate = 0.1\n")
    p = run(["train", "--config", str(cfg), "--data-dir", str(fashion_dir)])
    assert p.returncode == 2 and "unknown key 'lerning_rate'" in p.stderr
    cfg.write_text('batch-size = "big"\n')
    p = run(["train", "--config", str(cfg), "--data-dir", str(fashion_dir)])
    assert p.returncode == 2 and "must be an integer" in p.stderr


@pytest.mark.parametrize("name", sorted(OLD_AB_DEFAULTS))
def test_options_an_earlier_abtrain_had_are_unknown_keys(tmp_path, fashion_dir, capsys, name):
    """An option removed from abtrain is refused as any key that is no option: in a config file (a table or the
    flag's name), on the command line, in a run directory's config.json; one line that names it."""
    key = name.replace("_", "-")
    value = OLD_AB_DEFAULTS[name] if OLD_AB_DEFAULTS[name] is not None else 1
    table, flat = tmp_path / "table.toml", tmp_path / "flat.toml"
    table.write_text(f"[ab]\n{key} = {json.dumps(value)}\n")
    flat.write_text(f"ab-{key} = {json.dumps(value)}\n")
    stopped = tmp_path / "old-run"  # a run directory whose config.json holds the option
    stopped.mkdir()
    from abtrain.config import TrainConfig
    old = TrainConfig(data_dir=str(fashion_dir), out=str(stopped)).to_dict()
    old["ab"][name] = OLD_AB_DEFAULTS[name]
    (stopped / "config.json").write_text(json.dumps(old))
    for args, said in ((["--config", str(table)], f"unknown key 'ab.{key}' in config file {table}"),
                       (["--config", str(flat)], f"unknown key 'ab-{key}' in config file {flat}"),
                       ([f"--ab-{key}", "1"], f"unrecognized arguments: --ab-{key}"),
                       (["--resume", str(stopped)], f"{stopped / 'config.json'} holds unknown ab options: {name}")):
        try:
            code = main(["train", *args] if "--resume" in args else ["train", "--data-dir", str(fashion_dir), *args])
        except SystemExit as exc:
            code = exc.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and said in lines[0], (args, lines)


def test_corrupt_dataset_is_reported(tmp_path, fashion_dir):
    bad = tmp_path / "corrupt"
    shutil.copytree(fashion_dir, bad)
    data = (bad / "train-images-idx3-ubyte.gz").read_bytes()
    (bad / "train-images-idx3-ubyte.gz").write_bytes(data[: len(data) // 2])
    p = run(["train", "--data-dir", str(bad), "--out", str(tmp_path / "r"), "--steps", "2"])
    assert p.returncode == 2
    assert "train-images-idx3-ubyte.gz" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_example_runs_under_torchrun():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    p = subprocess.run(torchrun + [str(ROOT / "examples" / "own_loop.py")], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("test accuracy")]
    assert len(line) == 1
    m = re.match(r"test accuracy ([\d.]+); plain Net from the exported weights ([\d.]+);", line[0])
    assert float(m.group(1)) > 0.6  # a learnable problem: the factorised model must still learn it
    assert m.group(1) == m.group(2)  # the exported weights in the plain class score the same
    assert sum(ln.startswith("epoch ") for ln in p.stdout.splitlines()) == 8  # evaluated every epoch
    assert p.stdout.count("AB-training schedule") == 1  # rank 0 only
    assert "one node of 4 workers: 2 groups of 2" in p.stdout


FLAGS = {
    "--config", "--method", "--workers", "--model", "--dataset", "--data-dir", "--epochs", "--steps", "--batch-size",
    "--lr", "--optimizer", "--momentum", "--weight-decay", "--weight-decay-all", "--no-weight-decay-all",
    "--lr-schedule", "--warmup-lr-steps", "--warmup-lr-fraction", "--min-lr", "--precision", "--label-smoothing",
    "--grad-clip", "--seed", "--out", "--eval-every", "--log-every", "--group-size", "--backend", "--device",
    "--threads", "--bucket-cap-mb", "--block-size", "--limit-train", "--limit-test", "--timeout", "--ledger",
    "--no-ledger", "--checkpoint-every", "--stop-after", "--max-restarts", "--resume",
    "--ab-warmup-steps", "--ab-sync-every", "--ab-min-sync-every", "--ab-rebound-steps", "--ab-tau", "--ab-rank", "--ab-rank-fraction",
    "--ab-sync",
    "--ab-lr-rebound-steps", "--ab-lr-floor", "--ab-split",
    "--ab-optimizer-state", "--ab-init", "--ab-init-scope", "--ab-orientation", "--ab-only-b-sync", "--ab-full-rank",
    "--ab-warmup-fraction", "--ab-sync-fraction", "--ab-rebound-fraction", "--ab-lr-rebound-fraction",
    "--ab-min-rank", "--ab-only-b-groups", "--ab-dense-comm", "--ab-powersgd-rank",
    "--ab-powersgd-codec", "--ab-scale-block",
    "--ab-sync-codec", "--ab-sync-fragments", "--ab-outer-lr", "--ab-outer-momentum", "--ab-sync-memory-dtype", "--ab-sync-payload", "--ab-sync-rank",
    "--ab-tangent-core", "--ab-svd", "--ab-rank-cap", "--ab-sync-moments", "--no-ab-sync-moments",
    "--ab-linear-apply", "--ab-keep-output", "--no-ab-keep-output", "--ab-sync-batchnorm", "--no-ab-sync-batchnorm", "--ab-quiet", "--no-ab-quiet",
    "--localsgd-sync-every", "--diloco-sync-every", "--diloco-outer-lr", "--diloco-outer-momentum", "--powersgd-rank",
    "--powersgd-warmup-steps", "--powersgd-min-compression-rate", "--powersgd-orthogonalization-epsilon",
    "--powersgd-seed", "--powersgd-dtype", "--ef21-fraction", "--ef21-warmup-steps", "--onebit-warmup-steps", "--onebit-scale-block",
    "--hlocalsgd-sync-every", "--streaming-diloco-sync-every", "--streaming-diloco-fragments", "--streaming-diloco-overlap",
    "--streaming-diloco-alpha", "--streaming-diloco-outer-lr", "--streaming-diloco-outer-momentum",
    "--streaming-diloco-quantize", "--streaming-diloco-scale-block", "--streaming-diloco-pattern",
    "--streaming-diloco-fragment-groups", "--demo-topk", "--demo-chunk", "--demo-decay", "--demo-momentum-rule",
    "--sparseloco-sync-every", "--sparseloco-outer-lr", "--sparseloco-decay", "--sparseloco-chunk",
    "--sparseloco-topk", "--sparseloco-quantize", "--sparseloco-mean",
}


def test_public_flag_surface_is_frozen():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    flags = {s for a in train._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    assert flags == FLAGS
    for action in train._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_ab_run_dir_is_plain_versioned_and_repeatable(tmp_path, fashion_dir):
    """AB on one node without --group-size; model.pt loads into the model class; TensorBoard; config.json as --config."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from abtrain import __version__
    from abtrain.cli import config_from_args
    from abtrain.data import load_dataset
    from abtrain.models import build_model

    out = tmp_path / "ab"
    p = run(["train", "--method", "ab", "--workers", "2", "--data-dir", str(fashion_dir), "--model", "mlp",
             "--out", str(out), "--eval-every", "3", "--ab-warmup-steps", "2", "--ab-sync-every", "3",
             "--ab-lr-rebound-steps", "2", *TINY, "--steps", "8"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("one node of 2 workers: 2 groups of 1 (--group-size to choose)") == 1
    r = json.loads((out / "results.json").read_text())
    assert r["group_size"] == 1 and r["abtrain_version"] == __version__ and r["torch_version"]
    # model.pt: the plain weights (W = A·B), loadable into the model class as built
    state = torch.load(out / "model.pt")
    assert not any("parametrizations" in k for k in state)
    build_model("mlp", load_dataset("fashion-mnist", str(fashion_dir), limit_test=64)).load_state_dict(state)
    # the history's LR is the one applied: AB's ramp after each phase switch starts at the floor
    scheduled = 0.05 * 0.5 * (1 + math.cos(math.pi * 2 / 8))  # cosine at the third step (index 2) of 8
    assert r["history"][0]["lr"] == pytest.approx(1e-5 + (scheduled - 1e-5) * 0.5)  # half-way up the ramp (R = 2)
    # TensorBoard, read back
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"test_accuracy", "lr", "wire_bytes", "global_wire_bytes", "test_accuracy_vs_global_wire_kB"} <= tags
    steps = [e.step for e in acc.Scalars("test_accuracy_vs_global_wire_kB")]
    assert len(steps) == len(set(steps)) == len(r["history"])  # kB keep the evaluations of a small run apart
    assert acc.Scalars("global_wire_bytes")[-1].value == pytest.approx(r["history"][-1]["global_wire_bytes"])
    # the saved configuration is a --config file
    ns = build_parser().parse_args(["train", "--config", str(out / "config.json")])
    assert config_from_args(ns).to_dict() == r["config"]


def test_python_m_abtrain_and_default_run_dir():
    from abtrain import __version__
    from abtrain.config import TrainConfig
    from abtrain.run.rundir import default_run_dir

    p = subprocess.run([sys.executable, "-m", "abtrain", "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == f"abtrain {__version__}"
    assert (ROOT / "src" / "abtrain" / "py.typed").exists()
    cfg = TrainConfig(method="ab")
    assert default_run_dir(cfg, {"TORCHELASTIC_RUN_ID": "f00d"}) == os.path.join("runs", "ab-cnn-fashion-mnist-f00d")
    assert default_run_dir(cfg, {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"}) \
        == os.path.join("runs", "ab-cnn-fashion-mnist-42.0")
    # torchrun's default --rdzv-id: the first worker's time stamp, shared through the agent's store
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store.port)}
    first = default_run_dir(cfg, env)
    store.set("unrelated", "x")
    assert default_run_dir(cfg, env) == first == os.path.join("runs", "ab-cnn-fashion-mnist-" + store.get(
        "abtrain/run_dir_stamp").decode())


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "examples").glob("*.toml")))
def test_every_preset_of_examples_is_a_valid_configuration_holding_each_of_its_values(preset):
    path = str(ROOT / "examples" / preset)
    cfg = config_from_args(build_parser().parse_args(["train", "--config", path]))
    assert cfg.method == "ab"
    from abtrain.config import read_config_file
    values = read_config_file(path)
    for key, value in values.items():
        held = [(f"{key}.{k}", getattr(getattr(cfg, key), k), v) for k, v in value.items()] \
            if isinstance(value, dict) else [(key, getattr(cfg, key), value)]
        for name, got, want in held:
            assert got == want, f"{preset}: {name} is {got!r} in the run's configuration, {want!r} in the file"


def test_a_renamed_flag_or_file_key_is_refused_naming_its_new_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--diloco-h", "4"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert "--diloco-h was renamed in abtrain 0.2.0: it is --diloco-sync-every now" in err
    path = tmp_path / "old.toml"
    path.write_text('method = "streaming-diloco"\n[streaming-diloco]\nblock = 64\n')
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'streaming_diloco.block' in config file" in err
    assert "was renamed in abtrain 0.2.0: it is 'streaming-diloco-scale-block' now" in err
    for flag, new in (("--ab-cycle-steps", "--ab-sync-every"), ("--ab-cycle-fraction", "--ab-sync-fraction"),
                      ("--ab-min-cycle-steps", "--ab-min-sync-every")):
        with pytest.raises(SystemExit):
            main(["train", "--method", "ab", flag, "4"])
        assert f"{flag} was renamed in abtrain 0.2.0: it is {new} now" in capsys.readouterr().err
    path.write_text('method = "ab"\n[ab]\ncycle-fraction = 0.03\n')
    assert main(["train", "--config", str(path)]) == 2
    assert "was renamed in abtrain 0.2.0: it is 'ab-sync-fraction' now" in capsys.readouterr().err


@pytest.mark.parametrize("method, old, new", [("ab", "cycle_steps", "sync_every"), ("diloco", "h", "sync_every"),
                                              ("streaming-diloco", "block", "scale_block")])
def test_a_renamed_keyword_of_setup_is_refused_naming_its_new_name(method, old, new):
    with pytest.raises(ValueError, match=rf"^setup\('{method}'\) option '{old}' was renamed in abtrain 0.2.0: "
                                         rf"it is '{new}' now$"):
        abtrain.setup(method, **{old: 4})
