"""A ModelMix run certified by another accountant than modelmix says so once (the mixing then costs utility without a
privacy gain: Xiao, Wan & Devadas's mixing earns its privacy only through the modelmix certificate)."""

from __future__ import annotations

import pytest

from dptrain.config import load_config
from dptrain.runs.report import format_report
from dptrain.runs.run import run_training

WARNING = "the mixing then costs utility without a privacy gain"
BASE = [
    'data.name="synthetic"',
    "data.options={n = 600, dim = 6, num_classes = 3, separation = 3.0}",
    'model.name="logistic"',
    "training.steps=4",
    "training.batch_size=60",
    "training.learning_rate=0.5",
]


def _train(tmp_path, capsys, name, overrides):
    summary = run_training(load_config(None, [*BASE, *overrides]), tmp_path / name, progress=False)
    return summary, capsys.readouterr().err


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_a_modelmix_run_certified_by_another_accountant_warns_once(tmp_path, capsys, accountant):
    summary, err = _train(
        tmp_path,
        capsys,
        accountant,
        ['training.update="modelmix"', "privacy.noise_multiplier=1.0", f'privacy.accountant="{accountant}"'],
    )
    assert summary["accountant"] == accountant
    assert err.count(WARNING) == 1 and f"certified by the {accountant} accountant" in err
    assert err.count("dptrain: warning:") == 1
    assert any(WARNING in n for n in summary["notes"])
    assert WARNING in format_report(summary)


def test_a_modelmix_run_certified_by_modelmix_says_nothing(tmp_path, capsys):
    summary, err = _train(
        tmp_path,
        capsys,
        "mm",
        ['training.update="modelmix"', "privacy.noise_multiplier=1.0", 'privacy.accountant="modelmix"'],
    )
    assert summary["accountant"] == "modelmix"
    assert WARNING not in err and "notes" not in summary


def test_plain_dpsgd_certified_by_pld_says_nothing(tmp_path, capsys):
    summary, err = _train(
        tmp_path, capsys, "sgd", ["privacy.noise_multiplier=1.0", 'privacy.accountant="pld"']
    )
    assert WARNING not in err and "notes" not in summary


@pytest.mark.parametrize("tau, noise, tightest", [(0.05, 1.0, "pld"), (2.0, 0.5, "modelmix")])
def test_auto_warns_exactly_when_the_tightest_accountant_is_not_modelmix(
    tmp_path, capsys, tau, noise, tightest
):
    """privacy.accountant = "auto": a narrow mixing leaves pld tightest (warned), a wide one makes modelmix tightest."""
    summary, err = _train(
        tmp_path,
        capsys,
        f"auto-{tau}",
        ['training.update="modelmix"', f"modelmix.tau={tau}", f"privacy.noise_multiplier={noise}"],
    )
    assert summary["accountant"] == tightest
    assert err.count(WARNING) == (tightest != "modelmix")
