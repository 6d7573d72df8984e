"""Training experiments of the ModelMix reproduction (Xiao, Wan & Devadas, "Differentially Private Deep Learning with
ModelMix"): Table I's Fashion-MNIST row and the same-noise curves of Fig. 2, on ScatterNet features with the CNN of
Tramer & Boneh, "Differentially Private Learning Needs Better Features (or Much More Data)"
(:mod:`dptrain.models.scatternet`).

Each experiment returns plain JSON-able data; the ModelMix report (:mod:`dptrain.reproduce.modelmix`) renders it.

- :func:`table1`: test accuracy at epsilon in {0.2, 0.6, 1.0} (delta = 1e-5), median of 3 seeds, of

  * DP-SGD in Tramer & Boneh's Fashion-MNIST setting: Poisson batches of expected size 8192 (q = 8192/60000),
    clip norm C = 0.1, learning rate 4, 800 steps, plain SGD; the noise calibrated by the tightest certifying
    accountant (``make_private_with_epsilon``'s default);
  * DP-SGD + ModelMix: the same q and steps, C = 1, learning rate 0.4, tau = 0.05 lr for the first half of the
    steps and 0.025 lr for the second (:class:`dptrain.modelmix.ModelMixSGD`), twice:

    - calibration "certified": the noise calibrated by the tightest accountant that certifies the run
      (``accountant="auto"``: modelmix, pld or rdp; ModelMix's release post-processes a DP-SGD release with
      secret weights, so pld and rdp certify it too). Table I's first tau phase mixes over a width of
      (tau/lr) B/C = 0.05 x 8192 = 410 sensitivities, which the modelmix accountant accounts at 205 (a proven
      domination, :func:`dptrain.accounting.modelmix.reviewed_phase`);
    - calibration "paper_method": the noise with which the paper's own method (its ordering only, fractional
      orders, its Thm 2.2 conversion: ``epsilon_paper_method``) meets the target: what the paper's Table I
      claims. Not certified; the row gives the epsilon that a certifying accountant proves for the same run;

  * a non-private baseline: a real recipe (:func:`non_private_sgd`: shuffled batches of 128, SGD with momentum 0.9,
    20 epochs, cosine learning rate from 0.02, no clipping), not DP-SGD's setting with the noise off (which is
    step-limited and would hide what privacy costs). The learning rate is the one ``dptrain reproduce
    modelmix-decided`` chose on held-out examples from {0.02, 0.05, 0.1}.

  The features are normalised per example (GroupNorm), so no budget goes to normalisation; the paper spends
  epsilon = 0.695 of its budget on private batch-norm statistics, which this reproduction does not need.
- :func:`fig2`: one noise multiplier for three runs (the paper's Fig. 2 compares DP-SGD and ModelMix at equal noise):
  sigma calibrated so that plain DP-SGD has epsilon = 8 at delta = 1e-5 over 400 steps at q = 0.05 (expected batch
  3000), C = 8; DP-SGD at learning rate eta = 0.1, DP-SGD at 2 eta, ModelMix at 2 eta with tau = 0.05 lr (the
  paper's Fig. 2(c, d) settings, there on CIFAR-10 with ResNet-20 over 2000 steps; 400 here). Test
  accuracy and loss every 20 steps (the test set is not the private training data), and each run's epsilon under
  the rdp and pld accountants and, for the ModelMix run, the modelmix accountant.

Seeds: every run passes ``seed=`` to the engine (and seeds torch before building the model) so that the experiment
can be repeated draw for draw. Its sampling, noise and mixing weights are then reproducible, which voids the privacy
guarantee of the trained models (the engine warns ``NotPrivateWarning``, expected here): the certified epsilons are
what the same runs spend with secret randomness. The data say so in their ``note``.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from dptrain.accounting import epsilon as ledger_epsilon
from dptrain.errors import AccountingError, ConfigError
from dptrain.models.scatternet import DEFAULT_CACHE_DIR

__all__ = [
    "DELTA",
    "FIG2",
    "METHODS",
    "CALIBRATIONS",
    "NOTE",
    "PHYSICAL_BATCH",
    "QUICK",
    "TABLE1",
    "VARIANTS",
    "evaluate",
    "features",
    "fig2",
    "table1",
]

DELTA = 1e-5
N_TRAIN = 60_000  # Fashion-MNIST's training set: the sampling rates below are the full runs'
METHODS = ("dpsgd", "modelmix", "non_private")
#: Table I (the Fashion-MNIST row) on ScatterNet features.
TABLE1: dict[str, Any] = {
    "sampling_rate": 8192 / N_TRAIN,
    "steps": 800,
    "dpsgd": {"max_grad_norm": 0.1, "learning_rate": 4.0},
    "modelmix": {"max_grad_norm": 1.0, "learning_rate": 0.4, "tau": [[0.05, 0.5], [0.025, 0.5]]},
    "non_private": {"batch_size": 128, "epochs": 20, "momentum": 0.9, "learning_rate": 0.02},
}
#: Fig. 2's same-noise comparison on the same features.
FIG2: dict[str, Any] = {
    "sampling_rate": 0.05,
    "steps": 400,
    "max_grad_norm": 8.0,
    "target_epsilon": 8.0,
    "eta": 0.1,
    "tau": 0.05,
    "eval_every": 20,
}
#: Examples per physical chunk of a logical batch (the per-example gradients held at once). Performance only: the
#: logical batch, and so the privacy, is the same. Measured on 2 idle cores (2 torch threads), one DP-SGD step at
#: expected batch 8192 takes 0.9 s in chunks of 256 and 1.4 s in the engine's default chunks (2029 examples, the
#: most whose per-example gradients fit in 256 MiB).
PHYSICAL_BATCH = 256
#: Quick mode (a test's seconds): a fixed subset of Fashion-MNIST, few steps.
QUICK = {"n_train": 2000, "n_test": 1000, "steps": 20, "eval_every": 5, "non_private_epochs": 1}
NOTE = (
    "Every run passes an explicit seed to the engine (make_private(seed=...)) so that the experiment can be repeated "
    "draw for draw; the engine warns NotPrivateWarning, as expected for a reproduction: reproducible sampling, noise "
    "and mixing weights void the guarantee of the trained models. The certified epsilons are those the same runs "
    "spend with secret randomness. Test-set evaluations are not private data."
)

_FEATURES: dict[tuple, tuple[torch.Tensor, ...]] = {}


# --- data ---------------------------------------------------------------------------------------------------


def features(quick: bool, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR, progress: bool = False):
    """(x_train, y_train, x_test, y_test): Fashion-MNIST's ScatterNet features (J = 2), kept per process. Full: the
    whole data set, cached in ``cache_dir``. Quick: the first QUICK["n_train"] training and QUICK["n_test"] test
    images of a fixed permutation (generator seed 0), computed directly (seconds, no cache). The images come
    from :func:`dptrain.data.loaders.load_fashion_mnist` (a DataError when they are not installed)."""
    from dptrain.data.loaders import load_fashion_mnist
    from dptrain.models.scatternet import cached_fashion_mnist_features, scatter_features

    key = (bool(quick), str(cache_dir))
    if key not in _FEATURES:
        if quick:
            split = load_fashion_mnist(pixels="raw")
            g = torch.Generator().manual_seed(0)
            tr = torch.randperm(len(split.train), generator=g)[: QUICK["n_train"]]
            te = torch.randperm(len(split.test), generator=g)[: QUICK["n_test"]]
            _FEATURES[key] = (
                scatter_features(split.train.x[tr], progress=progress),
                split.train.y[tr],
                scatter_features(split.test.x[te], progress=progress),
                split.test.y[te],
            )
        else:
            _FEATURES[key] = cached_fashion_mnist_features(cache_dir, J=2, progress=progress)
    return _FEATURES[key]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2048
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy loss) of ``model`` on held-out data."""
    model.eval()
    correct, loss = 0, 0.0
    for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True):
        out = model(xb)
        correct += int((out.argmax(1) == yb).sum())
        loss += float(F.cross_entropy(out, yb, reduction="sum"))
    n = max(1, len(y))
    return correct / n, loss / n


# --- one run ------------------------------------------------------------------------------------------------


def non_private_sgd(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    learning_rate: float,
    seed: int,
    *,
    batch_size: int,
    epochs: int,
    momentum: float,
) -> int:
    """Train ``model`` in place by the non-private baseline's recipe: shuffled mini-batches (generator seeded with
    ``seed``), SGD with ``momentum``, a cosine learning rate from ``learning_rate`` to 0 over the ``epochs``, no
    clipping, no noise. Returns the number of steps taken."""
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=momentum)
    per_epoch = math.ceil(len(x) / batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * per_epoch)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(batch_size):
            optimizer.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
            schedule.step()
    return epochs * per_epoch


def _trainer(
    method: str,
    data: tuple[torch.Tensor, torch.Tensor],
    *,
    seed: int,
    steps: int,
    batch_size: float,
    max_grad_norm: float,
    learning_rate: float,
    tau=None,
    epsilon: float | None = None,
    noise_multiplier: float | None = None,
    calibration: str = "certified",
):
    """(model, trainer) of one run: torch seeded with ``seed`` before the model is built (its initialization), the
    engine seeded with ``seed`` (sampling, noise, mixing). With ``epsilon`` the noise is calibrated for ``steps``
    steps: "certified" by the tightest certifying accountant (:func:`make_private_with_epsilon`, ``auto``),
    "paper_method" (ModelMix only) by the paper's method (:func:`_paper_method_noise`); else
    ``noise_multiplier`` is used."""
    from dptrain.engine.api import make_private, make_private_with_epsilon
    from dptrain.models.scatternet import scatter_cnn_fmnist

    if calibration not in CALIBRATIONS or (calibration == "paper_method" and method != "modelmix"):
        raise ConfigError(
            f"calibration must be one of {', '.join(CALIBRATIONS)} (paper_method for ModelMix only), "
            f"got {calibration!r} for {method}"
        )
    torch.manual_seed(seed)
    model = scatter_cnn_fmnist()
    if method == "modelmix":
        from dptrain.modelmix import ModelMixSGD

        optimizer = ModelMixSGD(model.parameters(), lr=learning_rate, tau=tau, total_steps=steps)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    common = {
        "max_grad_norm": max_grad_norm,
        "batch_size": batch_size,
        "seed": seed,
        "max_physical_batch_size": PHYSICAL_BATCH,
    }
    accountant = "modelmix" if method == "modelmix" else "auto"
    if epsilon is not None and calibration == "certified":
        calibrated = {"target_epsilon": epsilon, "target_delta": DELTA, "steps": steps, **common}
        return model, make_private_with_epsilon(model, optimizer, data, accountant="auto", **calibrated)
    if epsilon is not None:
        probe = make_private(model, optimizer, data, noise_multiplier=1.0, delta=DELTA, accountant=accountant,
                             **common)
        noise_multiplier = _paper_method_noise(epsilon, lambda z: probe.ledger_after(steps, z))
        probe.close()
    return model, make_private(
        model, optimizer, data, noise_multiplier=noise_multiplier, delta=DELTA, accountant=accountant, **common
    )


CALIBRATIONS = ("certified", "paper_method")


def _paper_method_noise(target: float, ledger_for_sigma) -> float:
    """The smallest noise multiplier whose ``epsilon_paper_method`` (the modelmix accountant's rendering of the
    paper's own method) is at most ``target``: the paper's kind of claim, not a certificate."""
    from scipy import optimize

    from dptrain.accounting.modelmix import modelmix_epsilon, phases_from_ledger

    def gap(log_z: float) -> float:
        phases = phases_from_ledger(ledger_for_sigma(math.exp(log_z)))
        return modelmix_epsilon(phases, DELTA)["epsilon_paper_method"] - target

    lo, hi = math.log(0.3), math.log(2.0)
    while gap(hi) > 0:
        lo, hi = hi, hi + math.log(2)
        if hi > math.log(1e4):
            raise AccountingError(f"the paper's method cannot meet epsilon={target} with a noise multiplier <= 1e4")
    if gap(lo) <= 0:
        return math.exp(lo)
    return math.exp(optimize.brentq(gap, lo, hi, xtol=1e-6))


def _non_private_run(x, y, x_test, y_test, seed: int, epochs: int | None) -> dict[str, Any]:
    """One seeded run of Table I's non-private baseline (:func:`non_private_sgd`; ``epochs``: None for the recipe's)."""
    from dptrain.models.scatternet import scatter_cnn_fmnist

    t0 = time.perf_counter()
    recipe = dict(TABLE1["non_private"])
    if epochs is not None:
        recipe["epochs"] = epochs
    torch.manual_seed(seed)
    model = scatter_cnn_fmnist()
    steps = non_private_sgd(model, x, y, recipe.pop("learning_rate"), seed, **recipe)
    accuracy, loss = evaluate(model, x_test, y_test)
    return {
        "seed": seed,
        "accuracy": accuracy,
        "test_loss": loss,
        "certified_epsilon": None,
        "certified_by": None,
        "accountant": None,
        "noise_multiplier": 0.0,
        "steps": steps,
        "seconds": time.perf_counter() - t0,
    }


def _privacy(trainer) -> dict[str, Any]:
    """The tightest epsilon at DELTA that any accountant certifies for the run (``auto``), and which one."""
    best = trainer.epsilon(DELTA, accountant="auto")
    return {
        "certified_epsilon": best.epsilon,
        "certified_by": best.accountant,
    }


def _run_steps(
    trainer, steps: int, desc: str, progress: bool, every: int | None = None, on_eval=None
) -> None:
    """Train ``steps`` steps with a progress bar; ``on_eval(step)`` at step 0 and every ``every`` steps."""
    from tqdm import tqdm

    if on_eval is not None:
        on_eval(trainer.steps)
    with tqdm(total=steps, desc=desc, unit="step", disable=not progress, leave=False) as bar:
        for result in trainer.iter_steps(steps):
            bar.update(1)
            if on_eval is not None and every and (result.step % every == 0 or result.step == steps):
                on_eval(result.step)


def _epsilons(trainer, names: tuple[str, ...]) -> tuple[dict[str, dict | None], dict[str, str]]:
    """{accountant: {"epsilon", "certified"}} at DELTA for each name in ``names``; an accountant that refuses the
    ledger gets None, and its reason in the second dict. ``certified``: whether the accountant's bound on the recorded
    mechanism is proven (the ledger's own verdict: these seeded experiments are not private runs, and
    ``trainer.epsilon`` says so)."""
    values, refused = {}, {}
    for name in names:
        try:
            report = ledger_epsilon(trainer.ledger, DELTA, name)
            values[name] = {"epsilon": report.epsilon, "certified": report.certified}
        except AccountingError as e:
            values[name], refused[name] = None, str(e)
    return values, refused


# --- Table I ------------------------------------------------------------------------------------------------


#: Table I's variants: (method, calibration). "modelmix_paper" is ModelMix calibrated by the paper's method.
VARIANTS = {
    "dpsgd": ("dpsgd", "certified"),
    "modelmix": ("modelmix", "certified"),
    "modelmix_paper": ("modelmix", "paper_method"),
    "non_private": ("non_private", "certified"),
}


def table1(
    quick: bool,
    seeds=(0, 1, 2),
    epsilons=(0.2, 0.6, 1.0),
    progress: bool = True,
    variants=tuple(VARIANTS),
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    on_row=None,
) -> dict:
    """Table I's Fashion-MNIST row (see the module docstring): one row per (epsilon, variant of :data:`VARIANTS`)
    and one non-private row, each with the median test accuracy over ``seeds``. Quick: QUICK["n_train"] training
    examples (same q, so an expected batch of about 273), QUICK["steps"] steps, the first seed and the largest
    epsilon only. ``on_row(rows)`` is called after each row (e.g. to save partial results of a long run)."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"unknown Table I variants {unknown}; accepted: {', '.join(VARIANTS)}")
    start = time.perf_counter()
    x, y, x_test, y_test = features(quick, cache_dir, progress)
    steps = QUICK["steps"] if quick else TABLE1["steps"]
    seeds, epsilons = ((tuple(seeds)[0],), (max(epsilons),)) if quick else (tuple(seeds), tuple(epsilons))
    q = TABLE1["sampling_rate"]
    batch_size = q * len(x)
    cells = [(eps, v) for eps in epsilons for v in variants if v != "non_private"]
    if "non_private" in variants:
        cells.append((None, "non_private"))
    rows = []
    for eps, variant in cells:
        method, calibration = VARIANTS[variant]
        setting, private = TABLE1[method], method != "non_private"
        runs = []
        for seed in seeds:
            t0 = time.perf_counter()
            if not private:
                epochs = QUICK["non_private_epochs"] if quick else None
                runs.append(_non_private_run(x, y, x_test, y_test, seed, epochs))
                continue
            model, trainer = _trainer(
                method,
                (x, y),
                seed=seed,
                steps=steps,
                batch_size=batch_size,
                max_grad_norm=setting["max_grad_norm"],
                learning_rate=setting["learning_rate"],
                tau=setting.get("tau"),
                epsilon=eps,
                calibration=calibration,
            )
            desc = f"{variant} eps={eps} seed={seed}" if eps is not None else f"{variant} seed={seed}"
            _run_steps(trainer, steps, desc, progress)
            accuracy, loss = evaluate(model, x_test, y_test)
            run = {
                "seed": seed,
                "accuracy": accuracy,
                "test_loss": loss,
                **_privacy(trainer),
                "accountant": trainer.accountant,
                "noise_multiplier": trainer.noise_multiplier,
                "steps": trainer.steps,
                "seconds": time.perf_counter() - t0,
            }
            if method == "modelmix":  # the modelmix accountant's answers, whichever accountant calibrated the run
                run["modelmix"] = _modelmix_answers(trainer)
            # the epsilon the noise was calibrated to meet, by the calibration's own measure
            run["calibration_epsilon"] = (
                run["modelmix"]["epsilon_paper_method"] if calibration == "paper_method" else run["certified_epsilon"]
            )
            runs.append(run)
            trainer.close()
        accuracies = [r["accuracy"] for r in runs]
        rows.append(
            {
                "dataset": "fashion_mnist",
                "epsilon": eps,
                "delta": None if eps is None else DELTA,
                "method": method,
                "calibration": calibration if private else None,
                "accuracy_median": statistics.median(accuracies),
                "accuracies": accuracies,
                "seeds": list(seeds),
                "certified_epsilon": max(r["certified_epsilon"] for r in runs) if private else None,
                "accountant": runs[0]["accountant"],
                # certified: the calibration's accountant proves the target (paper_method: never claimed)
                "certified": calibration == "certified" if private else None,
                "certified_by": runs[0]["certified_by"],
                "calibration_epsilon": max(r["calibration_epsilon"] for r in runs) if private else None,
                "modelmix": runs[0].get("modelmix"),
                "noise_multiplier": max(r["noise_multiplier"] for r in runs),
                "steps": min(r["steps"] for r in runs),
                "seconds": sum(r["seconds"] for r in runs),
                "max_grad_norm": setting.get("max_grad_norm"),
                "learning_rate": setting["learning_rate"],
                "tau": setting.get("tau"),
                "runs": runs,
            }
        )
        if on_row is not None:
            on_row(rows)
    return {
        **_header("table1", quick, x, x_test),
        "sampling_rate": q,
        "expected_batch_size": batch_size,
        "physical_batch_size": PHYSICAL_BATCH,
        "steps": steps,
        "delta": DELTA,
        "settings": {m: TABLE1[m] for m in ("dpsgd", "modelmix", "non_private")},
        "rows": rows,
        "note": NOTE,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "wall_time_s": time.perf_counter() - start,
    }


def _header(experiment: str, quick: bool, x: torch.Tensor, x_test: torch.Tensor) -> dict[str, Any]:
    """What every experiment's data starts with: its name, the data and the model."""
    return {
        "experiment": experiment,
        "quick": bool(quick),
        "dataset": "fashion_mnist",
        "features": {"name": "ScatterNet", "J": 2, "L": 8, "shape": list(x.shape[1:])},
        "model": "scatter_cnn_fmnist (GroupNorm(27, 81) + Tramer & Boneh's CNN)",
        "n_train": len(x),
        "n_test": len(x_test),
    }


def _modelmix_answers(trainer) -> dict[str, Any]:
    """The modelmix accountant's numbers for a ModelMix run: certified, the paper's direction, the paper's method."""
    report = ledger_epsilon(trainer.ledger, DELTA, "modelmix")  # (the bound on the mechanism: a seeded experiment)
    d = report.details
    return {
        "epsilon": report.epsilon,
        "certified": report.certified,
        "epsilon_paper_direction": d.get("epsilon_paper_direction"),
        "epsilon_paper_method": d.get("epsilon_paper_method"),
        "epsilon_dpsgd": d.get("epsilon_dpsgd"),
        "accounted_as": d.get("accounted_as"),
    }


# --- Fig. 2 -------------------------------------------------------------------------------------------------


def fig2(
    quick: bool,
    seed: int = 0,
    progress: bool = True,
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    **setting: Any,
) -> dict:
    """Fig. 2's same-noise curves (see the module docstring). Every run uses the same seed: the same initial model
    and, for the two DP-SGD runs, the same batches and noise draws. Quick: QUICK["n_train"] training examples,
    QUICK["steps"] steps, an evaluation every QUICK["eval_every"] steps. ``setting`` overrides entries of FIG2
    (e.g. ``max_grad_norm=1.0``)."""
    unknown = sorted(set(setting) - set(FIG2))
    if unknown:
        raise ConfigError(f"unknown Fig. 2 settings {unknown}; accepted: {', '.join(FIG2)}")
    cfg = {**FIG2, **setting}
    start = time.perf_counter()
    x, y, x_test, y_test = features(quick, cache_dir, progress)
    steps = QUICK["steps"] if quick else cfg["steps"]
    every = QUICK["eval_every"] if quick else cfg["eval_every"]
    q, clip, eta, tau = cfg["sampling_rate"], cfg["max_grad_norm"], cfg["eta"], cfg["tau"]
    batch_size = q * len(x)
    specs = [
        {"name": "dpsgd_eta", "method": "dpsgd", "learning_rate": eta, "tau_over_lr": None},
        {"name": "dpsgd_2eta", "method": "dpsgd", "learning_rate": 2 * eta, "tau_over_lr": None},
        {"name": "modelmix_2eta", "method": "modelmix", "learning_rate": 2 * eta, "tau_over_lr": tau},
    ]
    sigma, calibrated_by = None, None
    runs = []
    for spec in specs:
        t0 = time.perf_counter()
        model, trainer = _trainer(
            spec["method"],
            (x, y),
            seed=seed,
            steps=steps,
            batch_size=batch_size,
            max_grad_norm=clip,
            learning_rate=spec["learning_rate"],
            tau=spec["tau_over_lr"],
            epsilon=cfg["target_epsilon"] if sigma is None else None,  # the first run calibrates sigma
            noise_multiplier=sigma,
        )
        if sigma is None:
            sigma, calibrated_by = trainer.noise_multiplier, trainer.accountant
        curve: dict[str, list] = {"steps": [], "accuracy": [], "loss": []}

        def record(step: int, model=model, curve=curve) -> None:
            accuracy, loss = evaluate(model, x_test, y_test)
            curve["steps"].append(step)
            curve["accuracy"].append(accuracy)
            curve["loss"].append(loss)

        _run_steps(trainer, steps, spec["name"], progress, every, record)
        names = ("rdp", "pld") + (("modelmix",) if spec["method"] == "modelmix" else ())
        eps, refused = _epsilons(trainer, names)
        runs.append(
            {
                **spec,
                "curve": curve,
                "final_accuracy": curve["accuracy"][-1],
                "final_loss": curve["loss"][-1],
                "noise_multiplier": trainer.noise_multiplier,
                "steps": trainer.steps,
                "epsilon": eps,
                "refused": refused,
                "seconds": time.perf_counter() - t0,
            }
        )
        trainer.close()
    return {
        **_header("fig2", quick, x, x_test),
        "seed": seed,
        "sampling_rate": q,
        "expected_batch_size": batch_size,
        "physical_batch_size": PHYSICAL_BATCH,
        "max_grad_norm": clip,
        "steps": steps,
        "eval_every": every,
        "eta": eta,
        "target_epsilon": cfg["target_epsilon"],
        "delta": DELTA,
        "noise_multiplier": sigma,
        "calibrated_by": calibrated_by,
        "runs": runs,
        "note": NOTE,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "wall_time_s": time.perf_counter() - start,
    }
