"""A hyperparameter search's accounting (Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy",
ICLR 2022): the search's RDP against the paper's Thm 2 and Thm 6 written out here, the calibration of a trial's
noise for a search budget, the ledger's JSON, the refusals of the accountants that cannot certify a search, and the
command line."""

import json
import math

import numpy as np
import pytest
from scipy import optimize, special

from dptrain.accounting import (
    AUTO,
    Ledger,
    TrialCount,
    accountant_names,
    all_reports,
    dpsgd_ledger,
    epsilon,
    search_ledger,
    search_report,
    trial_noise_for_search,
)
from dptrain.accounting.standard import RDP_ORDERS
from dptrain.accounting.tuning import (
    DEFAULT_DISTRIBUTION,
    SEARCH_MECHANISM,
    parse_distribution,
    search_rdp,
    tnb_mean,
    with_score_release,
)
from dptrain.cli import main
from dptrain.errors import AccountingError, ConfigError, NoFiniteEpsilon

DELTA = 1e-5
#: Integer orders, where the subsampled Gaussian's RDP has the closed form below, and a few large ones.
ORDERS = [float(a) for a in range(2, 65)] + [80.0, 128.0, 256.0]
DISTRIBUTIONS = ["poisson", "geometric", "logarithmic", "tnb:0.5", "tnb:3"]


# --- an independent implementation of the paper's bounds ----------------------------------------------------------


def gaussian_rdp(orders, sigma, count=1):
    """count Gaussian releases of noise multiplier sigma: alpha / (2 sigma^2) each (Mironov 2017, Prop. 7)."""
    return np.array([count * a / (2 * sigma**2) for a in orders])


def subsampled_gaussian_rdp(orders, q, sigma, count):
    """count Poisson-subsampled Gaussian releases at integer orders (Mironov, Talwar & Zhang 2019, Sec. 3.3):
    log(sum_k C(a, k) (1 - q)^(a - k) q^k exp((k^2 - k) / (2 sigma^2))) / (a - 1) each."""
    out = []
    for a in orders:
        a = int(a)
        k = np.arange(a + 1)
        log_terms = (
            special.gammaln(a + 1) - special.gammaln(k + 1) - special.gammaln(a - k + 1)
            + (a - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma**2)
        )
        out.append(count * special.logsumexp(log_terms) / (a - 1))
    return np.array(out)


def tnb_gamma(mean, eta):
    """gamma of D_{eta,gamma} with E[K] = mean (Definition 1): E[K] = eta (1 - gamma) / (gamma (1 - gamma^eta)),
    (1/gamma - 1) / log(1/gamma) at eta = 0."""

    def expectation(g):
        return (1 / g - 1) / math.log(1 / g) if eta == 0 else eta * (1 - g) / (g * (1 - g**eta))

    if mean == 1:
        return 1.0  # K = 1
    return optimize.brentq(lambda g: expectation(g) - mean, 1e-12, 1 - 1e-12, xtol=1e-16, rtol=1e-15)


def theorem_2(orders, rdp, mean, eta):
    """Papernot & Steinke Thm 2 (K ~ D_{eta,gamma}): eps'(l) = eps(l) + (1 + eta) (1 - 1/lh) eps(lh)
    + (1 + eta) log(1/gamma)/lh + log(E[K])/(l - 1), minimised over lh in ``orders``; then RDP's monotonicity in the
    order (a bound at a larger order bounds a smaller one; van Erven & Harremoes 2014, Thm 3)."""
    orders, rdp = np.asarray(orders), np.asarray(rdp)
    log_inv_gamma = -math.log(tnb_gamma(mean, eta))
    best_lh = min((1 - 1 / lh) * e + log_inv_gamma / lh for lh, e in zip(orders, rdp, strict=True))
    bound = rdp + (1 + eta) * best_lh + math.log(mean) / (orders - 1)
    return np.array([min(bound[j] for j in range(len(orders)) if orders[j] >= orders[i]) for i in range(len(orders))])


def rdp_to_delta(orders, rdp, eps):
    """delta at eps of a mechanism with this RDP curve: the minimum over orders of Canonne, Kamath & Steinke 2020,
    Prop. 12, exp((a - 1)(r - eps)) (1 - 1/a)^(a - 1) / a, and of the total variation bound sqrt(1 - e^-r)
    (delta(eps) <= TV <= sqrt(1 - exp(-KL)), KL <= the RDP at any order > 1)."""
    logs = []
    for a, r in zip(orders, rdp, strict=True):
        logs.append(min(0.5 * math.log1p(-math.exp(-r)), (a - 1) * (r - eps + math.log1p(-1 / a)) - math.log(a)))
    return min(1.0, math.exp(min(logs)))


def theorem_6(orders, rdp, mu):
    """Papernot & Steinke Thm 6 (K ~ Poisson(mu)): eps'(l) = eps(l) + mu delta_hat + log(mu)/(l - 1), the trial being
    (eps_hat, delta_hat)-DP at eps_hat = log(1 + 1/(l - 1))."""
    return np.array([
        r + mu * rdp_to_delta(orders, rdp, math.log1p(1 / (a - 1))) + math.log(mu) / (a - 1)
        for a, r in zip(orders, rdp, strict=True)
    ])


def paper_search_rdp(orders, rdp, mean, distribution):
    shape = parse_distribution(distribution)
    return theorem_6(orders, rdp, mean) if shape == math.inf else theorem_2(orders, rdp, mean, shape)


def rdp_epsilon(orders, rdp, delta):
    """Canonne, Kamath & Steinke 2020, Prop. 12: eps = min over a of r + log(1 - 1/a) - log(delta a)/(a - 1)."""
    return min(r + math.log1p(-1 / a) - math.log(delta * a) / (a - 1) for a, r in zip(orders, rdp, strict=True))


# --- the search's RDP -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("mean", [1.0, 10.0, 200.0])
def test_search_rdp_of_a_gaussian_trial_is_papernot_steinke(distribution, mean):
    trial = dpsgd_ledger(4.0, 1.0, 3, sampling="full")  # 3 Gaussian releases: 3 alpha / (2 * 16)
    ours = search_rdp(search_ledger(trial, TrialCount.named(mean, distribution)), ORDERS)
    expected = paper_search_rdp(ORDERS, gaussian_rdp(ORDERS, 4.0, 3), mean, distribution)
    assert ours == pytest.approx(expected, rel=1e-7)
    assert np.all(ours >= gaussian_rdp(ORDERS, 4.0, 3) * (1 - 1e-12))  # never below one trial's


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_search_rdp_of_a_subsampled_trial_is_papernot_steinke(distribution):
    trial = dpsgd_ledger(1.0, 0.02, 300)
    ours = search_rdp(search_ledger(trial, TrialCount.named(10, distribution)), ORDERS)
    expected = paper_search_rdp(ORDERS, subsampled_gaussian_rdp(ORDERS, 0.02, 1.0, 300), 10, distribution)
    assert ours == pytest.approx(expected, rel=1e-7)


def test_the_rdp_accountants_epsilon_is_the_converted_search_rdp():
    """End to end: epsilon(ledger, delta, "rdp") of a search of Gaussian trials (RDP exact at every order, fractional
    ones too) is the conversion of Thm 2 / Thm 6 at the accountant's orders (up to 768 when the optimum is below 448,
    as here)."""
    orders = [a for a in RDP_ORDERS if a <= 768]
    trial = dpsgd_ledger(3.0, 1.0, 2, sampling="full")
    for distribution in ("poisson", "logarithmic", "tnb:2"):
        report = epsilon(search_ledger(trial, TrialCount.named(20, distribution)), DELTA, "rdp")
        assert report.details["optimal_order"] < 448
        expected = rdp_epsilon(orders, paper_search_rdp(orders, gaussian_rdp(orders, 3.0, 2), 20, distribution), DELTA)
        assert report.epsilon == pytest.approx(expected, rel=1e-7)


def test_a_search_costs_more_than_one_trial_and_grows_with_the_mean():
    trial = dpsgd_ledger(1.0, 0.01, 1000)
    single = epsilon(trial, DELTA, "rdp").epsilon
    eps = [epsilon(search_ledger(trial, TrialCount(m, math.inf)), DELTA, "rdp").epsilon for m in (1, 5, 50)]
    assert single < eps[0] < eps[1] < eps[2]
    # a search of exactly one trial (a truncated negative binomial with mean 1: K = 1) costs about one trial: Thm 2's
    # (1 + eta)(1 - 1/lh) eps(lh) vanishes at lh = 1, but dp_accounting's smallest order is 1.1
    one = epsilon(search_ledger(trial, TrialCount(1, 1.0)), DELTA, "rdp").epsilon
    assert single < one < 1.01 * single


@pytest.mark.parametrize("distribution,expected", [("poisson", 24.09), ("geometric", 6.374), ("logarithmic", 5.114)])
def test_the_numbers_of_docs_accounting(distribution, expected):
    """docs/accounting.md's table: 100 trials of Abadi et al.'s MNIST run (rdp 2.597 alone)."""
    trial = dpsgd_ledger(1.1, 256 / 60000, 14062)
    search = epsilon(search_ledger(trial, TrialCount.named(100, distribution)), DELTA)
    assert search.accountant == "rdp" and search.epsilon == pytest.approx(expected, abs=6e-3)


# --- calibration ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("distribution", ["poisson", "logarithmic"])
def test_the_calibrated_search_meets_its_target(distribution):
    trials = TrialCount.named(10, distribution)

    def trial(sigma):
        return dpsgd_ledger(sigma, 1.0, 10, sampling="full")

    cal = trial_noise_for_search(2.0, DELTA, trial, trials)
    assert cal.accountant == "rdp" and "pld" in cal.refused
    spent = epsilon(search_ledger(trial(cal.noise_multiplier), trials), DELTA, AUTO).epsilon
    assert 2.0 * (1 - 1e-6) <= spent <= 2.0
    # the search needs more noise per trial than a single run with the same budget
    single = trial_noise_for_search(2.0, DELTA, trial, TrialCount(1, 1.0), "rdp").noise_multiplier
    assert cal.noise_multiplier > single


# --- the ledger -------------------------------------------------------------------------------------------------


def test_the_search_ledger_round_trips_through_json(tmp_path):
    trial = with_score_release(dpsgd_ledger(1.0, 0.01, 100, dataset_size=10_000), 5.0)
    for distribution in DISTRIBUTIONS:
        ledger = search_ledger(trial, TrialCount.named(7.5, distribution), tuner="random")
        text = json.dumps(ledger.to_dict(), allow_nan=False)  # Poisson's shape inf is written "inf"
        back = Ledger.from_dict(json.loads(text))
        assert back.entries[0].event == ledger.entries[0].event and back.to_dict() == ledger.to_dict()
        ledger.save(tmp_path / "ledger.json")
        loaded = Ledger.load(tmp_path / "ledger.json")
        assert loaded.entries[0].event == ledger.entries[0].event
        assert loaded.entries[0].facts["mechanism"] == SEARCH_MECHANISM
        assert epsilon(loaded, DELTA, "rdp").epsilon == epsilon(ledger, DELTA, "rdp").epsilon
    assert "'shape': 'inf'" in str(search_ledger(trial, TrialCount(3, math.inf)).to_dict())


def test_the_search_keeps_the_trials_adjacency_and_private_flag():
    trial = dpsgd_ledger(1.0, 1.0, 5, sampling="full")
    trial.neighboring, trial.private = "replace_one", False
    ledger = search_ledger(trial, TrialCount(4))
    assert ledger.neighboring == "replace_one" and ledger.private is False and ledger.releases == 1


def test_a_search_needs_a_trial_with_fixed_noise_that_releases_something():
    with pytest.raises(AccountingError, match="releases something"):
        search_ledger(Ledger(), TrialCount(3))
    filtered = dpsgd_ledger(1.0, 0.1, 3)
    filtered.entries[0].facts["filter"] = {"kind": "rdp"}
    with pytest.raises(AccountingError, match="noise fixed in advance"):
        search_ledger(filtered, TrialCount(3))


# --- refusals ---------------------------------------------------------------------------------------------------


def test_only_rdp_certifies_a_search_and_auto_picks_it():
    trial = dpsgd_ledger(1.0, 0.01, 200, dataset_size=10_000)
    ledger = search_ledger(trial, TrialCount(10))
    ledger.record(trial.entries[0].event, trial.entries[0].facts, 50)  # and 50 more DP-SGD steps after the search
    reports, refusals = all_reports(ledger, DELTA)
    assert list(reports) == ["rdp"] and set(refusals) == set(accountant_names()) - {"rdp"}
    for name, why in refusals.items():
        assert "\n" not in why and f"the {name} accountant cannot certify a hyperparameter search" in why
    assert epsilon(ledger, DELTA, AUTO).accountant == "rdp"
    assert epsilon(ledger, DELTA).epsilon > epsilon(search_ledger(trial, TrialCount(10)), DELTA).epsilon


def test_dp_accounting_has_no_pld_for_a_search():
    """The pld accountant refuses a search because dp_accounting's PLD accountant does not support it either."""
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    ledger = search_ledger(dpsgd_ledger(1.0, 0.01, 10), TrialCount(5))
    assert not PLDAccountant().supports(ledger.dp_event())


def test_the_rdp_accountant_refuses_a_stored_search_it_cannot_certify():
    """A ledger file's search with a mean below 1 or a negative shape is refused in one line (dp_accounting raises a
    bare ValueError; a Poisson mean below 1 would make Thm 6's bound negative, which its conversion reads as 0)."""
    good = search_ledger(dpsgd_ledger(1.0, 0.01, 10), TrialCount(5)).to_dict()
    for field, value, message in [
        ("mean", 0.5, "mean number of trials must be a finite number >= 1"),
        ("shape", -0.5, "dp_accounting's RDP accountant computes eta >= 0 only"),
        ("shape", -3.0, "shape of the number of trials must be inf"),
    ]:
        data = json.loads(json.dumps(good))
        data["entries"][0]["event"][field] = value
        with pytest.raises(AccountingError, match=message):
            epsilon(Ledger.from_dict(data), DELTA, "rdp")


def test_a_search_with_too_little_noise_has_no_finite_epsilon():
    """The noise floor applies to the Gaussians inside a search's trial (dp_accounting's RDP overflows to 0 far below
    it)."""
    ledger = search_ledger(dpsgd_ledger(1e-160, 1.0, 1, sampling="full"), TrialCount(3))
    with pytest.raises(NoFiniteEpsilon):
        epsilon(ledger, DELTA, "rdp")


# --- the distribution of the number of trials -------------------------------------------------------------------


def test_distributions_by_name_and_their_rules():
    assert [parse_distribution(d) for d in ("poisson", "geometric", "logarithmic", "tnb:0.5", "TNB:2")] == [
        math.inf, 1.0, 0.0, 0.5, 2.0
    ]
    assert TrialCount.named(3, "tnb:1").name == "geometric" and TrialCount(3, 0.25).name == "tnb:0.25"
    assert DEFAULT_DISTRIBUTION == "geometric" and TrialCount(3).name == "geometric"
    for distribution in ("uniform", "tnb:", "tnb:x", "tnb:nan", "tnb:inf"):
        with pytest.raises(ConfigError, match="must be one of poisson, geometric, logarithmic or tnb:SHAPE"):
            parse_distribution(distribution)
    for mean in (0.5, 0.0, -1.0, math.inf, math.nan):
        for distribution in ("poisson", "geometric"):
            with pytest.raises(ConfigError, match="mean number of trials must be a finite number >= 1"):
                TrialCount.named(mean, distribution)
    with pytest.raises(ConfigError, match=r"^--tuning-distribution: a truncated negative binomial shape eta in \(-1"):
        TrialCount.named(3, "tnb:-0.5", distribution_key="--tuning-distribution")
    with pytest.raises(ConfigError, match="^--mean: the mean number"):
        TrialCount.checked(0.9, 1.0, mean_key="--mean")
    with pytest.raises(ConfigError, match="shape of the number of trials must be inf"):
        TrialCount(3, -1.0)


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_draws_of_the_number_of_trials_have_the_mean(distribution):
    trials = TrialCount.named(5, distribution)
    if trials.gamma is not None:
        assert tnb_mean(trials.gamma, trials.shape) == pytest.approx(5, rel=1e-12)
        assert trials.gamma == pytest.approx(tnb_gamma(5, trials.shape), rel=1e-9)
    rng = np.random.default_rng(7)
    draws = np.array([trials.draw(u) for u in 1 - rng.random(5_000)])  # (uniforms in (0, 1]; 1 is refused below)
    assert abs(draws.mean() - 5) < 5 * draws.std() / math.sqrt(len(draws))
    assert draws.min() >= (0 if distribution == "poisson" else 1)  # a Poisson search may run no trial
    if distribution != "poisson":
        assert TrialCount(1, trials.shape).draw(0.999) == 1  # mean 1: exactly one trial
    with pytest.raises(ValueError):
        trials.draw(1.0)


# --- the command line -------------------------------------------------------------------------------------------

ACCOUNT = ["account", "--noise-multiplier", "1.0", "--sampling-rate", "0.01", "--steps", "500", "--delta", "1e-5"]
CALIBRATE = ["calibrate", "--epsilon", "2", "--delta", "1e-5", "--sampling", "full", "--sampling-rate", "1", "--steps", "10"]


def run_cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_account_prints_the_search_and_the_single_run(capsys):
    code, out, _ = run_cli(ACCOUNT + ["--tuning-mean", "10", "--tuning-distribution", "geometric", "--json"], capsys)
    data = json.loads(out)
    trial = dpsgd_ledger(1.0, 0.01, 500)
    expected = search_report(trial, TrialCount(10, 1.0), DELTA)
    assert code == 0 and data["accountant"] == "rdp" and data["certified"] is True
    assert data["epsilon"] == expected.search.epsilon and data["epsilon_single_run"] == expected.single_run.epsilon
    assert data["single_run_accountant"] == epsilon(trial, DELTA).accountant
    assert data["tuning_distribution"] == "geometric" and data["tuning_mean"] == 10
    # --tuning-shape is the same distribution as a number
    code, out, _ = run_cli(ACCOUNT + ["--tuning-mean", "10", "--tuning-shape", "1", "--json"], capsys)
    assert json.loads(out)["epsilon"] == data["epsilon"]
    code, out, _ = run_cli(ACCOUNT + ["--tuning-mean", "10", "--tuning-shape", "inf", "--json"], capsys)
    assert json.loads(out)["tuning_distribution"] == "poisson"
    code, out, _ = run_cli(ACCOUNT + ["--tuning-mean", "10"], capsys)
    lines = out.strip().splitlines()
    assert code == 0 and lines[0].strip().startswith("search: epsilon =") and "geometric" in lines[0]
    assert lines[1].strip().startswith("single run: epsilon =")
    code, out, _ = run_cli(ACCOUNT + ["--tuning-mean", "10", "--accountant", "all", "--json"], capsys)
    data = json.loads(out)
    assert data["accountant"] == "rdp" and set(data["refused"]) == set(accountant_names()) - {"rdp"}


def test_account_counts_the_score_release_in_each_trial(capsys):
    _, out, _ = run_cli(ACCOUNT + ["--tuning-mean", "10", "--json"], capsys)
    _, scored, _ = run_cli(ACCOUNT + ["--tuning-mean", "10", "--tuning-score-noise", "3", "--json"], capsys)
    assert json.loads(scored)["epsilon"] > json.loads(out)["epsilon"]
    assert json.loads(scored)["trial_releases"] == 501


def test_calibrate_finds_the_per_trial_noise_of_a_search_budget(capsys):
    code, out, _ = run_cli(CALIBRATE + ["--tuning-mean", "10", "--tuning-distribution", "logarithmic", "--json"], capsys)
    cal = json.loads(out)
    assert code == 0 and cal["accountant"] == "rdp" and 2 * (1 - 1e-6) <= cal["epsilon"] <= 2
    assert cal["epsilon_single_run"] < cal["epsilon"] and cal["tuning_distribution"] == "logarithmic"
    code, out, _ = run_cli(
        ["account", "--noise-multiplier", repr(cal["noise_multiplier"]), "--sampling", "full", "--sampling-rate", "1",
         "--steps", "10", "--delta", "1e-5", "--tuning-mean", "10", "--tuning-shape", "0", "--json"],
        capsys,
    )
    assert json.loads(out)["epsilon"] == cal["epsilon"]
    code, out, _ = run_cli(CALIBRATE + ["--tuning-mean", "10"], capsys)
    assert code == 0 and "per trial" in out and "one trial alone" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (ACCOUNT + ["--tuning-mean", "0.5"], "--tuning-mean: the mean number of trials must be a finite number >= 1"),
        (ACCOUNT + ["--tuning-mean", "0.5", "--tuning-distribution", "geometric"], "--tuning-mean: the mean number"),
        (ACCOUNT + ["--tuning-mean", "5", "--tuning-distribution", "uniform"], "--tuning-distribution must be one of"),
        (ACCOUNT + ["--tuning-mean", "5", "--tuning-distribution", "tnb:-0.5"], "computes eta >= 0 only"),
        (ACCOUNT + ["--tuning-mean", "5", "--tuning-shape", "-2"], "--tuning-shape: the shape of the number of trials"),
        (ACCOUNT + ["--tuning-mean", "5", "--tuning-shape", "nan"], "expected a number or inf"),
        (ACCOUNT + ["--tuning-mean", "5", "--tuning-shape", "1", "--tuning-distribution", "poisson"], "not allowed with"),
        (ACCOUNT + ["--tuning-distribution", "poisson"], "--tuning-distribution needs --tuning-mean"),
        (ACCOUNT + ["--tuning-mean", "5", "--tuning-score-noise", "0"], "--tuning-score-noise must be a finite number > 0"),
        (ACCOUNT + ["--tuning-mean", "5", "--accountant", "pld"], "the pld accountant cannot certify a hyperparameter search"),
        (ACCOUNT + ["--tuning-mean", "5", "--accountant", "last_iterate"], "not last_iterate"),
        (CALIBRATE + ["--tuning-mean", "0.9"], "--tuning-mean: the mean number of trials"),
        (["calibrate", "--mechanism", "gaussian", "--epsilon", "1", "--delta", "1e-5", "--tuning-mean", "5"],
         "use --mechanism dpsgd"),
    ],
)
def test_bad_tuning_flags_exit_2_with_one_line(args, message, capsys):
    code, out, err = run_cli(args, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_the_tuning_flags_are_one_definition():
    from dptrain.cli import build_parser, common

    assert common.TUNING_DEFAULT == DEFAULT_DISTRIBUTION
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in ("--tuning-mean", "--tuning-distribution", "--tuning-shape", "--tuning-score-noise"):
        a, b = (next(x for x in commands[c]._actions if name in x.option_strings) for c in ("account", "calibrate"))
        assert all(getattr(a, k) == getattr(b, k) for k in ("type", "default", "choices", "help", "metavar"))
