"""Bad input, for every key and flag there is: every config key (read from the config's schema, registered sections
included) and every numeric flag of every command (read from the parser) is given a wrong type and out-of-range
numbers, and must be refused in one line with exit code 2 (dptrain.numbers: the rule every number passes first).
A key or a flag added later is covered without a change here."""

import argparse
import dataclasses
import typing

import pytest

from dptrain import config as C
from dptrain.cli import build_parser, common, main

TINY = """
[data]
name = "synthetic"
options = { n = 60, dim = 4, num_classes = 2 }
test_is_public = true
[model]
name = "logistic"
[privacy]
noise_multiplier = 1.0
[training]
steps = 2
batch_size = 10
"""


def _keys():
    sections = {**C.CORE_SECTIONS, **{name: s.cls for name, s in C.SECTIONS.items()}}
    keys = [("seed", int | None)]
    for name, cls in sections.items():
        hints = typing.get_type_hints(cls)
        keys += [(f"{name}.{f.name}", hints[f.name]) for f in dataclasses.fields(cls)]
    return keys


def _bad_values(tp):
    """A wrong type, then the out-of-range numbers, for a key of type ``tp``."""
    allowed = set(typing.get_args(tp) or (tp,))
    if allowed & {int, float}:
        wrong = "[[1]]" if str in allowed else '"abc"'  # (noise.bands takes "auto")
        # TOML nan/inf, a float no arithmetic holds, an integer beyond 64 bits (an int key refuses floats anyway)
        return [wrong, "nan", "inf", "-inf", "1e308", str(10**30)]
    if str in allowed:
        return ["7", "{ a = 1 }"]
    if bool in allowed:
        return ['"yes"', "1"]
    return ["7", '"abc"']  # a table or a list


CASES = [(key, value) for key, tp in _keys() for value in _bad_values(tp)]


def test_the_schema_is_read():
    names = {key for key, _ in CASES}
    # core keys and keys of registered sections, so that a section added later is in CASES too
    assert {"training.learning_rate", "privacy.delta", "convex.diameter", "tune.trials_mean", "seed"} <= names
    assert len(names) == len(_keys()) > 50


@pytest.mark.parametrize("key,value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_every_config_key_refuses_bad_values_in_one_line(key, value, tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(TINY)
    code = main(["train", "--config", str(path), "--set", f"{key}={value}", "--out", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("dptrain: error:") and key in err
    assert not (tmp_path / "run").exists()


def _numeric_flags():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.type is not None and action.option_strings:
                yield name, action


NUMERIC = (common.finite_float, common.positive_int, common.float_list, common.shape_float)


def test_no_flag_reads_a_number_without_the_shared_types():
    """int and float would take nan, inf and 10**30 (argparse's own types): every number goes through common's."""
    bare = [f"{name} {a.option_strings[0]}" for name, a in _numeric_flags() if a.type in (int, float)]
    assert bare == []


FLAG_CASES = [
    (name, action.option_strings[-1], bad)
    for name, action in _numeric_flags()
    if action.type in NUMERIC
    for bad in (
        ["nan", "1e308", str(10**30), "abc"] if action.type is common.positive_int
        else ["nan", "1e308", "1e60"] if action.type is common.shape_float  # (inf is a shape)
        else ["nan", "inf", "1e308", "1e60"]
    )
]


@pytest.mark.parametrize("command,flag,bad", FLAG_CASES, ids=[f"{c} {f}={b}" for c, f, b in FLAG_CASES])
def test_every_numeric_flag_refuses_bad_values_in_one_line(command, flag, bad, capsys):
    code = main([command, flag, bad])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("dptrain: error:") and flag in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train", "--set", "training.epochs=-1"], "training.epochs must be"),  # refused even where steps wins
        (
            ["account", "--accountant", "last_iterate", "--lipschitz", "1", "--diameter", "1", "--learning-rate",
             "0.1", "--dataset-size", "100", "--batch-size", "10", "--noise-std", "1", "--steps", "20", "--delta",
             "1e-5", "--smoothness", "0"],
            "smoothness M must be a finite number > 0",  # was a ZeroDivisionError traceback
        ),
        (
            ["account", "--accountant", "last_iterate", "--lipschitz", "1", "--diameter", "1", "--learning-rate",
             "0.1", "--dataset-size", "100", "--batch-size", "10", "--noise-std", "1", "--steps", "20", "--delta",
             "1e-5", "--smoothness", "1", "--strong-convexity", "-1"],
            "strong convexity m must be a finite number >= 0",  # was accepted
        ),
    ],
)
def test_ranges_the_fuzz_found_unchecked(argv, message, tmp_path, capsys):
    if argv[0] == "train":
        (tmp_path / "c.toml").write_text(TINY)
        argv = [*argv, "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run")]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err
