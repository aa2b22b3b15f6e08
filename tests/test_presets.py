"""The presets of the authors' three published settings against the table transcribed from their code.

``tests/data/authors_settings.toml`` holds, for each setting and each element, the authors' value (in words, with
the file and key it comes from) and the same value as abtrain's options. Each preset is read as ``abtrain train
--config`` reads it, and every element must match the table, or depart with the reason the table gives (the
preset's own value pinned there too), or wait for an option abtrain does not have yet (an option the table names,
which must not exist yet: once it does, the preset must use it).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

from abtrain.cli import build_parser, config_from_args
from abtrain.config import TrainConfig
from abtrain.data import Dataset, Split
from abtrain.methods.ab.lowrank import prepare_model
from abtrain.methods.ab.config import ABConfig
from abtrain.methods.ab.schedule import Schedule
from abtrain.models import build_model
from abtrain.run.plan import lr_lambda

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
TABLE_PATH = ROOT / "tests" / "data" / "authors_settings.toml"
SETTINGS = ("vgg16", "resnet50", "vit")
ELEMENTS = ("model", "workers", "run_length", "sync", "split", "warmup", "sync_period", "rebound", "lr_ramp",
            "dense_wire", "sync_wire", "rank_rule", "rank_floor", "sync_averages", "moments_at_decomposition",
            "orientation", "initialisation", "kept_layers", "optimizer", "label_smoothing", "clipping",
            "lr_schedule", "batchnorm", "precision")
SCHEDULE_KEYS = ("warmup", "sync_every", "rebound", "lr_rebound")
NO_OPTION = "no option yet: "


def load_table() -> dict[str, Any]:
    with open(TABLE_PATH, "rb") as fh:
        return tomllib.load(fh)


def load_preset(path: Path) -> TrainConfig:
    """The configuration ``abtrain train --config PATH`` runs with."""
    return config_from_args(build_parser().parse_args(["train", "--config", str(path)]))


def _stand_in_dataset(cfg: TrainConfig) -> Dataset:
    """The shape of the preset's dataset without its samples: the kept layers depend on the model's names only."""
    empty = Split(torch.zeros(0), torch.zeros(0))
    if cfg.dataset == "shakespeare":
        return Dataset("shakespeare", "lm", empty, empty, (cfg.block_size,), 65)
    return Dataset(cfg.dataset, "classify", empty, empty, (1, 28, 28), 10)


def _kept_layers(cfg: TrainConfig) -> list[str]:
    """The weights of two or more dims the preset's model keeps full rank (the first layer, the head, embeddings)."""
    torch.manual_seed(0)
    model = build_model(cfg.model, _stand_in_dataset(cfg))
    excluded: list[tuple[str, str]] = []
    prepare_model(model, full_rank_patterns=cfg.ab.patterns, min_rank=cfg.ab.min_rank, excluded=excluded)
    return sorted(name for name, _ in excluded)


def _lr_warmup_steps(cfg: TrainConfig, run_steps: int) -> int:
    """Steps of the learning-rate warm-up at ``run_steps``: the index of the first step at the schedule's peak
    (timm's warmup_t; the floor's share is added back in float, so the peak is 1 up to rounding)."""
    factor = lr_lambda(cfg, run_steps)
    return next(i for i in range(run_steps) if factor(i) >= 1.0 - 1e-12)


def known(key: str) -> bool:
    """A key the table may use: an option of TrainConfig or of AB-training, or one derived from them."""
    if key.startswith("schedule."):
        return key[len("schedule."):] in SCHEDULE_KEYS
    if key.startswith("ab."):
        return key[3:] in {f.name for f in fields(ABConfig)}
    return key in {"lr_warmup_steps", "run_length", "kept_layers"} or key in {f.name for f in fields(TrainConfig)}


def value_of(cfg: TrainConfig, key: str, run_steps: int) -> Any:
    """The preset's value of a table key, the derived ones at the authors' run length."""
    if key.startswith("schedule."):
        return getattr(Schedule.from_config(cfg.ab, run_steps), key[len("schedule."):])
    if key.startswith("ab."):
        return getattr(cfg.ab, key[3:])
    if key == "lr_warmup_steps":
        return _lr_warmup_steps(cfg, run_steps)
    if key == "run_length":
        return f"{cfg.steps} steps" if cfg.steps is not None else f"{cfg.epochs} epochs"
    if key == "kept_layers":
        return _kept_layers(cfg)
    return getattr(cfg, key)


def option_exists(name: str) -> bool:
    if name.startswith("ab."):
        return name[3:] in {f.name for f in fields(ABConfig)}
    return name in {f.name for f in fields(TrainConfig)}


def check_setting(setting: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """Every way the preset ``cfg`` and the table's ``setting`` disagree, one line each (empty: they agree)."""
    problems: list[str] = []
    missing = [e for e in ELEMENTS if e not in setting]
    extra = sorted(k for k, v in setting.items() if isinstance(v, dict) and k not in ELEMENTS)
    problems += [f"{e}: not in the table" for e in missing] + [f"{e}: not an element" for e in extra]
    run_steps = setting["run_steps"]
    for name in ELEMENTS:
        el = setting.get(name)
        if el is None:
            continue
        for field_name in ("authors", "source"):
            if not str(el.get(field_name, "")).strip():
                problems.append(f"{name}: no {field_name}")
        theirs: dict[str, Any] = el.get("abtrain", {})
        ours: dict[str, Any] = el.get("preset", {})
        for key in sorted(set(theirs) | set(ours)):
            if not known(key):
                problems.append(f"{name}: {key!r} is neither an option of abtrain nor a derived value")
        for key in sorted(set(ours) - set(theirs)):
            problems.append(f"{name}: the preset's {key!r} has no authors' value beside it")
        for key in sorted(k for k in ours if k in theirs and ours[k] == theirs[k]):
            problems.append(f"{name}: `preset` repeats the authors' {key} = {theirs[key]!r}; drop it")
        departs = any(k in theirs and ours[k] != theirs[k] for k in ours)
        if departs and not str(el.get("departure", "")).strip():
            problems.append(f"{name}: the preset departs from the authors ({ours}) without a reason")
        for key in sorted(k for k in theirs if known(k)):
            want = ours.get(key, theirs[key])
            got = value_of(cfg, key, run_steps)
            if got != want:
                what = "the table's departure" if key in ours else "the authors'"
                problems.append(f"{name}: the preset has {key} = {got!r}, {what} is {want!r}")
        pending = el.get("pending")
        if pending is not None:
            option = el.get("option", "")
            if not str(pending).startswith(NO_OPTION) or not option:
                problems.append(f"{name}: a pending element says '{NO_OPTION}<what it would be>' and names its option")
            elif option_exists(option):
                problems.append(f"{name}: abtrain has {option} now: set the authors' value in the preset and the "
                                f"table's `abtrain`, and drop `pending`")
    return problems


def kind(element: dict[str, Any]) -> str:
    """``pending`` (waits for an option), ``departs`` (a reason given) or ``matches``."""
    if "pending" in element:
        return "pending"
    return "departs" if "departure" in element else "matches"


@pytest.fixture(scope="module")
def table() -> dict[str, Any]:
    return load_table()


def test_the_table_holds_the_three_settings_and_every_element(table):
    assert sorted(table) == sorted(SETTINGS)
    for name in SETTINGS:
        s = table[name]
        assert (ROOT / s["preset"]).is_file(), s["preset"]
        assert s["run_steps"] > 0
        assert [e for e in ELEMENTS if e in s] == list(ELEMENTS), name
        assert all(str(s[e]["source"]).strip() and str(s[e]["authors"]).strip() for e in ELEMENTS)


@pytest.mark.parametrize("name", SETTINGS)
def test_each_preset_matches_the_authors_or_says_why(table, name):
    setting = table[name]
    problems = check_setting(setting, load_preset(ROOT / setting["preset"]))
    assert not problems, f"{setting['preset']} against tests/data/authors_settings.toml:\n" + "\n".join(problems)


@pytest.mark.parametrize("name, line, changed, elements", [
    ("resnet50", "weight-decay = 0.1", "weight-decay = 0.25", {"optimizer"}),
    ("resnet50", "sync-fraction = 0.0333333", "sync-fraction = 0.0666667", {"sync_period", "rebound", "lr_ramp"}),
    ("resnet50", 'model = "resnet"', 'model = "cnn"', {"model"}),
    ("vgg16", "warmup-fraction = 0.2886667", "warmup-fraction = 0.289", {"warmup"}),
    ("vgg16", 'only-b-groups = "group"', 'only-b-groups = "world"', {"sync"}),
    ("vgg16", "sync-batchnorm = true", "sync-batchnorm = false", {"batchnorm"}),
    ("vit", "warmup-lr-fraction = 0.0666667", "warmup-lr-fraction = 0.067", {"lr_schedule"}),
    ("vit", "batch-size = 64", "batch-size = 32", {"workers"}),
    ("vit", "min-rank = 1", "min-rank = 8", {"rank_floor"}),
])
def test_a_changed_preset_value_fails_the_check(table, tmp_path, name, line, changed, elements):
    """One value of a preset changed (to a value an earlier preset held, or a plausible slip): exactly the
    elements it sets fail (the rebound and the LR ramp are shares of the sync period)."""
    text = (ROOT / table[name]["preset"]).read_text()
    assert text.count(line) == 1, line
    path = tmp_path / "preset.toml"
    path.write_text(text.replace(line, changed))
    problems = check_setting(table[name], load_preset(path))
    assert {p.split(":")[0] for p in problems} == elements, problems


def test_a_departure_without_its_reason_or_a_stale_pending_fails_the_check(table):
    cfg = load_preset(ROOT / table["vgg16"]["preset"])
    setting = copy.deepcopy(table["vgg16"])
    del setting["workers"]["departure"]
    setting["orientation"]["pending"] = "no option yet: the tall turn"  # an option abtrain has: no element waits for it
    setting["orientation"]["option"] = "ab.orientation"
    setting["split"]["preset"] = {"ab.split": "sqrt"}  # the authors' value again: not a departure
    del setting["precision"]
    problems = check_setting(setting, cfg)
    assert [p.split(":")[0] for p in problems] == ["precision", "workers", "split", "orientation"], problems


def test_the_tally_of_the_elements(table):
    """The counts docs/authors-settings.md gives: 72 elements, each in one kind (a change of the table changes them);
    none waits for an option."""
    counts = {"matches": 0, "departs": 0, "pending": 0}
    for name in SETTINGS:
        for e in ELEMENTS:
            counts[kind(table[name][e])] += 1
    assert sum(counts.values()) == len(SETTINGS) * len(ELEMENTS) == 72
    assert counts == {"matches": 54, "departs": 18, "pending": 0}
