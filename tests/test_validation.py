"""Property tests of configuration validation: any input is accepted or refused with a ValueError, nothing else."""

import dataclasses
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from abtrain.cli import build_parser, config_from_args
from abtrain.config import SECTIONS, TrainConfig, config_fields, section_fields
from helpers import OLD_AB_DEFAULTS

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

values = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-10, max_value=10), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=-2.0, max_value=2.0),
    st.text(max_size=8), st.sampled_from(["ddp", "ab", "cnn", "mlp", "synthetic", "sgd", "adamw", "with-stale"]),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _kwargs(cls):
    names = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("section")]
    return st.dictionaries(st.sampled_from(names), values, max_size=4)


@pytest.mark.parametrize("cls", [TrainConfig, *SECTIONS.values()], ids=lambda c: c.__name__)
def test_option_dataclasses_accept_or_raise_value_error(cls):
    @SETTINGS
    @given(_kwargs(cls))
    def check(kwargs):
        try:
            cfg = cls(**kwargs)
        except ValueError as exc:
            assert str(exc) and "\n" not in str(exc)
            return
        # Accepted values are what the fields say: numbers finite, types right.
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if isinstance(value, float):
                assert math.isfinite(value)

    check()


def _flag_tokens():
    flags = ["--" + f.name.replace("_", "-") for f in config_fields()]
    for section in SECTIONS:
        flags += [f"--{section}-" + f.name.replace("_", "-") for f in section_fields(section)]
    token = st.one_of(st.integers(-5, 1000).map(str), st.floats(allow_nan=True).map(str), st.text(max_size=6),
                      st.sampled_from(["ab", "ddp", "mlp", "synthetic", "1e400", "-0", "nan", "inf", "0x10"]))
    pair = st.tuples(st.sampled_from(flags), token).map(list)
    return st.lists(pair, max_size=5).map(lambda pairs: [t for p in pairs for t in p])


@SETTINGS
@given(_flag_tokens())
def test_cli_arguments_accept_or_refuse_cleanly(argv):
    parser = build_parser()
    try:
        ns = parser.parse_args(["train", *argv])
    except SystemExit as exc:  # argparse's own one-line refusal (see cli._Parser.error)
        assert exc.code == 2
        return
    try:
        config_from_args(ns)
    except ValueError as exc:
        assert str(exc) and "\n" not in str(exc)


toml_keys = st.sampled_from([f.name.replace("_", "-") for f in config_fields()] + ["lerning-rate", "ab-tau", "ab"]
                            + ["ab-" + name.replace("_", "-") for name in OLD_AB_DEFAULTS])  # an earlier abtrain's: refused
toml_values = st.one_of(st.integers(-3, 10**6), st.floats(allow_nan=True), st.booleans(), st.text(max_size=5),
                        st.just("[1, 2]"))


def _toml_line(key, value):
    if isinstance(value, str) and value == "[1, 2]":
        return f"{key} = [1, 2]"
    if isinstance(value, float):
        text = "nan" if math.isnan(value) else ("inf" if value == math.inf else "-inf" if value == -math.inf else repr(value))
        return f"{key} = {text}"
    return f"{key} = {json.dumps(value)}"


@SETTINGS
@given(st.dictionaries(toml_keys, toml_values, max_size=4))
def test_config_files_accept_or_refuse_cleanly(tmp_path_factory, entries):
    path = tmp_path_factory.mktemp("toml") / "c.toml"
    path.write_text("\n".join(_toml_line(k, v) for k, v in entries.items()) + "\n")
    ns = build_parser().parse_args(["train", "--config", str(path)])
    try:
        config_from_args(ns)
    except ValueError as exc:
        assert str(exc)
