"""What BandMF reports beside its certificate: the bands, the coefficients and the RMSE ratio on every output of
``--bands`` (a search's too), and a ratio that cannot be computed (an epsilon no calibration reaches) reported as
missing, with why, never taking the certificate, the model or the summary with it."""

import json
import math

import pytest

from dptrain.cli import main

#: sigma 20000, 10 steps at q = 0.1, 2 bands: epsilon 4.5e-5, which neither BandMF's nor DP-SGD's calibration reaches
#: with a noise multiplier up to 1e4 (the ratio compares with DP-SGD at the same epsilon)
TINY = ("--noise-multiplier", "20000", "--sampling-rate", "0.1", "--steps", "10", "--delta", "1e-5")


def _cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_an_epsilon_the_ratio_cannot_reach_still_reports_the_certificate(capsys):
    code, out, err = _cli(capsys, "account", *TINY, "--bands", "2", "--json")
    assert code == 0, err
    got = json.loads(out)
    code, out, err = _cli(capsys, "account", "--noise-multiplier", "20000", "--sampling-rate", "0.2", "--steps", "5",
                          "--delta", "1e-5", "--json")  # the equivalent DP-SGD run: ceil(10 / 2) steps at rate 2 q
    assert code == 0, err
    assert got["epsilon"] == json.loads(out)["epsilon"] and got["bands"] == 2
    assert got["rmse_ratio"] is None and "no RMSE ratio" in got["rmse_ratio_note"]
    assert math.isclose(sum(c * c for c in got["coefficients"]), 1.0)
    code, out, err = _cli(capsys, "account", *TINY, "--bands", "2")
    assert code == 0, err
    assert "epsilon = " in out and "bandmf: 2 bands" in out and "no RMSE ratio" in out


@pytest.mark.slow
def test_a_run_whose_ratio_cannot_be_computed_writes_its_model_and_summary(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text(
        '[data]\nname = "synthetic"\noptions = { n = 300, dim = 4, num_classes = 2 }\ntest_is_public = true\n'
        '[model]\nname = "logistic"\n[privacy]\nnoise_multiplier = 20000.0\n'
        '[training]\nsteps = 6\nbatch_size = 24\n[noise]\nmechanism = "bandmf"\nbands = 2\n'
    )
    code, out, err = _cli(capsys, "train", "--config", config, "--out", tmp_path / "r", "--no-progress")
    assert code == 0, err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert (tmp_path / "r" / "model.pt").is_file() and summary["finished"] and summary["bands"] == 2
    assert summary["rmse_ratio"] is None and "no RMSE ratio" in summary["bandmf"]["rmse_ratio_note"]
    assert summary["epsilon"] < 1e-3 and "bandmf, 2 bands" in out and "no RMSE ratio" in out


def test_a_search_over_bandmf_trials_reports_its_bands(capsys):
    base = ("--sampling-rate", "0.01", "--steps", "300", "--delta", "1e-5", "--bands", "4", "--tuning-mean", "5")
    code, out, err = _cli(capsys, "account", "--noise-multiplier", "1", *base, "--json")
    assert code == 0, err
    search = json.loads(out)
    code, out, err = _cli(capsys, "account", "--noise-multiplier", "1", *base[:-2], "--json")
    assert code == 0, err
    single = json.loads(out)  # one trial alone: the same BandMF run
    assert search["epsilon_single_run"] == single["epsilon"] and search["epsilon"] > single["epsilon"]
    for key in ("bands", "coefficients", "rmse_ratio", "workload"):
        assert search[key] == single[key], key
    code, out, err = _cli(capsys, "calibrate", "--epsilon", "3", *base, "--json")
    assert code == 0, err
    cal = json.loads(out)
    assert cal["bands"] == 4 and cal["coefficients"] == single["coefficients"] and 0 < cal["rmse_ratio"] < 1
    code, out, err = _cli(capsys, "calibrate", "--epsilon", "3", *base)
    assert code == 0 and "bandmf: 4 bands" in out


def test_auto_bands_for_a_search_is_refused_in_one_line(capsys):
    """As ``dptrain tune`` refuses it: "auto" chooses b for one run's budget; a trial's noise is set by the search
    (calibrate chose b for the whole search's epsilon, and printed no bands)."""
    code, _, err = _cli(capsys, "calibrate", "--epsilon", "3", "--sampling-rate", "0.01", "--steps", "300", "--delta",
                        "1e-5", "--bands", "auto", "--tuning-mean", "5")
    assert code == 2 and "--bands auto" in err and "--tuning-mean" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_bandmf_sigma_is_the_tightest_certifying_accountants_where_pld_is_the_looser():
    """Far below pld's discretization (epsilon 0.01) rdp certifies BandMF with less noise than pld: the sigma behind
    the RMSE ratio and the choice of bands is the smaller of the two, as the run's own calibration is (with pld alone
    the ratio at epsilon 0.01, T = 1000, q = 0.01, b = 8 read 0.37, where it is 1.06: BandMF predicted better than
    DP-SGD where it is worse)."""
    from dptrain.accounting.bandmf_bands import _first_band, bandmf_noise_multiplier
    from dptrain.accounting.bandmf_ledger import bandmf_ledger
    from dptrain.accounting.calibration import calibrate_noise

    def ledger(sigma):
        return bandmf_ledger(sigma, 0.02, 200, _first_band(4))

    by_rdp = calibrate_noise(0.01, 1e-5, ledger, "rdp")
    by_pld = calibrate_noise(0.01, 1e-5, ledger, "pld", start=by_rdp)
    assert by_rdp < 0.9 * by_pld  # the regime: rdp the tighter
    assert bandmf_noise_multiplier(0.01, 1e-5, 0.02, 200, 4) == pytest.approx(by_rdp, rel=1e-5)
