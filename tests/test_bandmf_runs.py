"""Banded matrix factorization at the edges: the [noise] config section, ``dptrain train`` (summary and report name the
mechanism, the bands and the RMSE ratio; --stop-after and --resume give the uninterrupted run; the group assignment
is in the private checkpoint and in no shareable file), ``dptrain account`` / ``calibrate --bands``, and the one-line
refusals of what BandMF's certificate does not cover. torchrun data parallelism (killed, resumed, equal to one
process) is in tests/test_distributed.py."""

import json
from pathlib import Path

import pytest
import torch

from dptrain.cli import main
from dptrain.config import config_from_toml
from dptrain.engine.api import make_private, make_private_with_epsilon
from dptrain.errors import ConfigError

CONFIG = """seed = 5
[data]
name = "synthetic"
options = {{ n = 600, dim = 8, num_classes = 2, separation = 3.0 }}
test_is_public = true
[model]
name = "mlp"
options = {{ hidden = [16] }}
[privacy]
{privacy}
accountant = "{accountant}"
[training]
steps = 24
batch_size = 40
max_physical_batch_size = 16
eval_every = 5
momentum = 0.5
[noise]
mechanism = "bandmf"
{bands}
"""


def _config(tmp_path, privacy="target_epsilon = 4.0", bands="", accountant="auto") -> Path:
    path = tmp_path / "c.toml"
    path.write_text(CONFIG.format(privacy=privacy, bands=bands, accountant=accountant))
    return path


def _cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _shareable(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.is_file() and "private" not in p.relative_to(out).parts]


def _lists_of_length(value, n) -> bool:
    if isinstance(value, list):
        return len(value) == n or any(_lists_of_length(v, n) for v in value)
    if isinstance(value, dict):
        return any(_lists_of_length(v, n) for v in value.values())
    return False


@pytest.mark.slow
def test_a_stopped_and_resumed_run_is_the_uninterrupted_one_and_its_groups_stay_private(tmp_path, capsys):
    """bands = "auto" with a budget: b chosen at the start, read back from the ledger on resume; the ledger, the metrics,
    the weights and the noise history equal one run's. The groups are in the private checkpoint only."""
    cfg = _config(tmp_path)
    code, stdout, err = _cli(capsys, "train", "--config", cfg, "--out", tmp_path / "one", "--no-progress")
    assert code == 0, err
    assert "noise" in stdout and "bands" in stdout and "rmse_ratio" in stdout  # the report's row
    code, _, err = _cli(capsys, "train", "--config", cfg, "--out", tmp_path / "two", "--no-progress", "--stop-after", "7")
    assert code == 0, err
    code, _, err = _cli(capsys, "train", "--resume", tmp_path / "two", "--no-progress")
    assert code == 0, err
    one, two = tmp_path / "one", tmp_path / "two"
    assert (one / "ledger.json").read_text() == (two / "ledger.json").read_text()
    stopped = [line for line in (two / "metrics.jsonl").read_text().splitlines() if '"step": 7,' not in line]
    assert (one / "metrics.jsonl").read_text().splitlines() == stopped  # (--stop-after evaluated step 7 too)
    a = torch.load(one / "private" / "checkpoint.pt", weights_only=True)
    b = torch.load(two / "private" / "checkpoint.pt", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    ha, hb = a["bandmf"]["noise"], b["bandmf"]["noise"]
    assert ha["count"] == hb["count"] == 24 and all(torch.equal(ha["history"][k], hb["history"][k]) for k in ha["history"])
    summary = json.loads((one / "summary.json").read_text())
    bands = summary["bands"]
    assert summary["noise_mechanism"] == "bandmf" and summary["sampling"] == "cyclic_poisson"
    assert 0 < summary["rmse_ratio"] < 1 and summary["bandmf"]["workload"] == "momentum 0.5"
    assert json.loads((one / "ledger.json").read_text())["entries"][0]["facts"]["bands"] == bands
    # the assignment: secret state of the checkpoint, in no shareable file
    groups = a["sampler"]["groups"]
    assert groups.shape == (480,) and int(groups.max()) < bands and a["sampler"]["bands"] == bands
    for path in _shareable(one):
        if path.suffix in (".json", ".jsonl"):
            for line in path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]:
                assert not _lists_of_length(json.loads(line), 480), path
        elif path.suffix == ".pt":
            saved = torch.load(path, weights_only=True)
            assert set(saved["state_dict"]) == set(a["model"]), path  # the model's tensors, nothing else
        assert b"groups" not in path.read_bytes() or path.name == "summary.json", path  # (its description says "secret")


def test_a_resume_that_changes_the_steps_is_refused(tmp_path, capsys):
    cfg = _config(tmp_path)
    assert _cli(capsys, "train", "--config", cfg, "--out", tmp_path / "r", "--no-progress", "--stop-after", "3")[0] == 0
    text = (tmp_path / "r" / "config.toml").read_text()
    (tmp_path / "r" / "config.toml").write_text(text.replace("steps = 24", "steps = 30"))
    code, _, err = _cli(capsys, "train", "--resume", tmp_path / "r", "--no-progress")
    assert code == 2 and "coefficients" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "privacy,bands,extra,message",
    [
        ("noise_multiplier = 1.0", "", "", 'noise.bands = "auto" chooses b for privacy.target_epsilon'),
        ("target_epsilon = 3.0", "bands = 0", "", "noise.bands must be an integer >= 1"),
        ("target_epsilon = 3.0", 'bands = "many"', "", "noise.bands must be an integer >= 1"),
        ("target_epsilon = 3.0", "", 'sampling = "fixed_size"', 'needs privacy.sampling = "poisson"'),
        ("target_epsilon = 3.0", "", 'sampling = "shuffled"', 'needs privacy.sampling = "poisson"'),
        ("target_epsilon = 3.0", "", 'accountant = "gdp"', "needs privacy.accountant in"),
        ("target_epsilon = 3.0", "", 'accountant = "composition"', "needs privacy.accountant in auto, pld, rdp, not"),
    ],
)
def test_configs_bandmf_cannot_certify_are_refused_in_one_line(tmp_path, privacy, bands, extra, message):
    text = CONFIG.format(privacy=privacy + ("\n" + extra if extra.startswith("sampling") else ""), bands=bands,
                         accountant=extra.split('"')[1] if extra.startswith("accountant") else "auto")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        config_from_toml(text)


@pytest.mark.parametrize(
    "add,message",
    [
        ('[schedule]\nkind = "uniform"', r"\[schedule\] changes sigma"),
        ('[schedule]\nkind = "validation"', r"\[schedule\] changes sigma"),
        ('[modelmix]\ntau = 0.1', 'needs training.update = "optimizer"'),
        ("", 'needs training.algorithm = "dpsgd"'),
        ("", "a constant expected batch size"),
    ],
)
def test_stages_bandmf_cannot_certify_are_refused_in_one_line(tmp_path, add, message):
    text = CONFIG.format(privacy="target_epsilon = 3.0", bands="", accountant="auto")
    if "modelmix" in add:
        text = text.replace("momentum = 0.5", 'momentum = 0.0\nupdate = "modelmix"') + add
    elif "algorithm" in message:
        text = text.replace("momentum = 0.5", 'algorithm = "projected_noisy_sgd"')
    elif "batch size" in message:
        text = text.replace("momentum = 0.5", "batch_growth = 1.0")
    else:
        text += add
    with pytest.raises(ConfigError, match=message):
        config_from_toml(text)
    assert config_from_toml(text.replace('mechanism = "bandmf"', 'mechanism = "gaussian"')) if not add else True


def _api(**options):
    torch.manual_seed(0)
    x, y = torch.randn(200, 4), torch.randint(0, 2, (200,))
    model = options.pop("model", None) or torch.nn.Linear(4, 2)
    opt = options.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    return make_private(model, opt, (x, y), batch_size=20, seed=0, **{"noise_multiplier": 1.0, **options})


@pytest.mark.parametrize(
    "options,message",
    [
        ({"noise": "bandmf", "bands": "auto", "planned_steps": 10}, 'bands="auto" chooses b for a privacy budget'),
        ({"noise": "bandmf", "bands": 4}, "give planned_steps"),
        ({"noise": "bandmf", "bands": 0, "planned_steps": 10}, "bands must be an integer >= 1"),
        ({"noise": "bandmf", "bands": 20, "planned_steps": 10}, r"at most the planned steps"),
        ({"noise": "bandmf", "bands": 16, "planned_steps": 100}, r"bands x sampling rate must be <= 1"),
        ({"noise": "fancy"}, "noise must be one of gaussian, bandmf"),
        ({"bands": 4}, "goes with noise='bandmf'"),
        ({"noise": "bandmf", "bands": 2, "planned_steps": 10, "sampling": "fixed_size"}, "Poisson sampling"),
        ({"noise": "bandmf", "bands": 2, "planned_steps": 10, "sampling": "cyclic"}, "Poisson sampling"),
        ({"noise": "bandmf", "bands": 2, "planned_steps": 10, "sample_sizes": [20] * 10}, "batch-size schedule"),
        ({"noise": "bandmf", "bands": 2, "planned_steps": 10, "noise_schedule": [1.0] * 10}, "noise schedule"),
        ({"noise": "bandmf", "bands": 2, "planned_steps": 10, "accountant": "gdp"}, "gdp accountant cannot"),
        ({"noise": "bandmf", "bands": 2, "planned_steps": 10, "release": "last_iterate"}, "its own mechanism"),
        ({"noise": "bandmf", "bands": 2, "planned_steps": 10, "noise_multiplier": 0, "non_private": True}, "non_private"),
    ],
)
def test_api_combinations_bandmf_cannot_certify_are_refused_in_one_line(options, message):
    with pytest.raises(ConfigError, match=message) as e:
        _api(**options)
    assert "\n" not in str(e.value)


def test_modelmix_and_adaptive_noise_are_refused_with_bandmf():
    from dptrain.modelmix import ModelMixSGD

    torch.manual_seed(0)  # (_api's model)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="update rule"):
        _api(noise="bandmf", bands=2, planned_steps=10, model=model,
             optimizer=ModelMixSGD(model.parameters(), lr=0.1, tau=0.1, total_steps=10))
    torch.manual_seed(0)
    x, y = torch.randn(200, 4), torch.randint(0, 2, (200,))
    with pytest.raises(ConfigError, match="takes no option 'planned_steps'"):
        make_private_with_epsilon(torch.nn.Linear(4, 2), torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                                  target_epsilon=3, target_delta=1e-5, steps=10, batch_size=20, noise="bandmf",
                                  planned_steps=10)


def _account(capsys, *flags):
    code, out, err = _cli(capsys, *flags, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_account_and_calibrate_take_bands(capsys):
    base = ("--sampling-rate", "0.01", "--steps", "1000", "--delta", "1e-5")
    dpsgd = _account(capsys, "account", "--noise-multiplier", "1.1", *base)
    one = _account(capsys, "account", "--noise-multiplier", "1.1", *base, "--bands", "1")
    assert one["epsilon"] == dpsgd["epsilon"] and one["bands"] == 1 and one["coefficients"] == [1.0]
    assert one["rmse_ratio"] == 1.0
    full = ("--noise-multiplier", "2", "--sampling", "full", "--sampling-rate", "1", "--steps", "50", "--delta", "1e-5")
    for accountant in ("auto", "gdp"):  # (--bands 1 takes what DP-SGD takes: full batches, gdp's exact answer)
        dpsgd = _account(capsys, "account", *full, "--accountant", accountant)
        one = _account(capsys, "account", *full, "--accountant", accountant, "--bands", "1")
        assert (one["epsilon"], one["accountant"]) == (dpsgd["epsilon"], dpsgd["accountant"]) and one["bands"] == 1
    eight = _account(capsys, "account", "--noise-multiplier", "1.1", *base, "--bands", "8")
    rate = _account(capsys, "account", "--noise-multiplier", "1.1", "--sampling-rate", "0.08", "--steps", "125",
                    "--delta", "1e-5")  # the equivalent DP-SGD run: ceil(1000 / 8) steps at rate 8 q
    assert eight["epsilon"] == rate["epsilon"] and len(eight["coefficients"]) == 8
    assert sum(c * c for c in eight["coefficients"]) == pytest.approx(1.0)
    small = ("--sampling-rate", "0.05", "--steps", "60", "--delta", "1e-5")
    cal = _account(capsys, "calibrate", "--epsilon", "3", *small, "--bands", "auto")
    ratios = {int(b): r for b, r in cal["candidates"].items()}
    assert cal["bands"] == min(ratios, key=ratios.get) > 1 and sorted(ratios) == [1, 2, 4, 8, 16]
    assert cal["epsilon"] <= 3 and len(cal["coefficients"]) == cal["bands"] and cal["rmse_ratio"] < 1
    fixed = _account(capsys, "calibrate", "--epsilon", "3", *small, "--bands", str(cal["bands"]))
    assert fixed["noise_multiplier"] == cal["noise_multiplier"] and fixed["coefficients"] == cal["coefficients"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (("account", "--noise-multiplier", "1", "--bands", "auto"), "--bands auto chooses b for a target epsilon"),
        (("account", "--noise-multiplier", "1", "--bands", "4", "--accountant", "gdp"), "cannot certify banded"),
        (("account", "--noise-multiplier", "1", "--bands", "4", "--accountant", "last_iterate"),
         "last_iterate accountant cannot certify banded"),
        (("account", "--noise-multiplier", "1", "--bands", "0"), "expected an integer >= 1 or auto"),
        (("account", "--noise-multiplier", "1", "--bands", "40", "--sampling-rate", "0.05"), "--bands x --sampling-rate"),
        (("account", "--noise-multiplier", "1", "--momentum", "0.9"), "--momentum goes with --bands"),
        (("account", "--noise-multiplier", "1", "--bands", "2", "--sampling", "full", "--sampling-rate", "1"),
         "--sampling must be poisson"),
        (("calibrate", "--epsilon", "1", "--bands", "2", "--momentum", "1.5"), "--momentum must be in"),
        (("account", "--noise-multiplier", "1", "--bands", "4", "--steps", "1000000000000"), "at most 1e+07 steps"),
    ],
)
def test_cli_refusals_are_one_line(capsys, flags, message):
    code, _, err = _cli(capsys, flags[0], "--sampling-rate", "0.01", "--steps", "100", "--delta", "1e-5", *flags[1:])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_search_refuses_auto_bands_in_one_line_and_takes_given_bands(tmp_path, capsys):
    """A trial of ``dptrain tune`` runs at the noise multiplier the search gives it (no budget of its own), so
    bands = "auto" (the default) has nothing to choose b for: refused in one line naming noise.bands, not with the
    trial's config error ("set privacy.target_epsilon", which the user did set)."""
    from dptrain.config import load_config
    from dptrain.tuning.search import Search

    text = CONFIG.format(privacy="target_epsilon = 3.0\ndelta = 1e-5", bands="", accountant="auto")
    text += '[tune]\ntrials_mean = 2\n[tune.space]\n"training.learning_rate" = { log_uniform = [0.1, 1.0] }\n'
    cfg = tmp_path / "tune.toml"
    cfg.write_text(text)
    code, _, err = _cli(capsys, "tune", "--config", cfg, "--out", tmp_path / "s", "--no-progress")
    assert code == 2 and "noise.bands = B" in err and "tune" in err and len(err.strip().splitlines()) == 1
    cfg.write_text(text.replace('mechanism = "bandmf"', 'mechanism = "bandmf"\nbands = 4'))
    search = Search(load_config(cfg))
    ledger = search._reference_planner(2.0)
    assert ledger.entries[0].facts["mechanism"] == "bandmf" and ledger.entries[0].facts["bands"] == 4
