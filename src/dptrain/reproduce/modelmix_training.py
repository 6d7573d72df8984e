"""Training experiments of the ModelMix reproduction (Xiao, Wan & Devadas, "Differentially Private Deep Learning with
ModelMix"): Table I's Fashion-MNIST row and the same-noise curves of Fig. 2, on ScatterNet features with the CNN of
Tramer & Boneh, "Differentially Private Learning Needs Better Features (or Much More Data)"
(:mod:`dptrain.scatternet`).

Each experiment returns plain JSON-able data; the ModelMix report (:mod:`dptrain.reproduce.modelmix`) renders it.

- :func:`table1`: test accuracy at epsilon in {0.2, 0.6, 1.0} (delta = 1e-5), median of 3 seeds, of

  * DP-SGD in Tramer & Boneh's Fashion-MNIST setting: Poisson batches of expected size 8192 (q = 8192/60000),
    clip norm C = 0.1, learning rate 4, 800 steps, plain SGD; the noise calibrated by the tightest certifying
    accountant (``make_private_with_epsilon``'s default);
  * DP-SGD + ModelMix: the same q and steps, C = 1, learning rate 0.4, tau = 0.05 lr for the first half of the
    steps and 0.025 lr for the second (:class:`dptrain.modelmix.ModelMixSGD`); the noise calibrated by the
    ``modelmix`` accountant. That accountant certifies only the range its soundness review checked
    (:data:`dptrain.accounting.modelmix.CERTIFIED_RANGE`); where a run lies outside it (Table I's first tau phase
    mixes over a width of (tau/lr) B/C = 0.05 x 8192 = 410 sensitivities) ``make_private_with_epsilon`` refuses,
    and the run falls back on ``modelmix_fallback`` (:func:`_modelmix_fallback`): "auto" (default) calibrates on
    the tightest accountant that certifies the run (pld or rdp: ModelMix's release post-processes the noisy
    gradient with secret weights); "uncertified" calibrates on the modelmix accountant's uncertified answer, the
    paper's kind of claim, and the row says ``certified: false``. Either way the row records the modelmix
    accountant's answer and why it refused;
  * a non-private baseline: DP-SGD's setting (sampling, C = 0.1 clipping, learning rate 4) without noise.

  The features are normalised per example (GroupNorm), so no budget goes to normalisation; the paper spends
  epsilon = 0.695 of its budget on private batch-norm statistics, which this reproduction does not need.
- :func:`fig2`: one noise multiplier for three runs (the paper's Fig. 2 compares DP-SGD and ModelMix at equal noise):
  sigma calibrated so that plain DP-SGD has epsilon = 8 at delta = 1e-5 over 400 steps at q = 0.05 (expected batch
  3000), C = 1; DP-SGD at learning rate eta = 0.2, DP-SGD at 2 eta, ModelMix at 2 eta with tau = 0.05 lr. Test
  accuracy and loss every 20 steps (the test set is not the private training data), and each run's epsilon under
  the rdp and pld accountants and, for the ModelMix run, the modelmix accountant.

Seeds: every run passes ``seed=`` to the engine (and seeds torch before building the model) so that the experiment
can be repeated draw for draw. Its sampling, noise and mixing weights are then reproducible, which voids the privacy
guarantee of the trained models (the engine warns ``NotPrivateWarning``, expected here): the certified epsilons are
what the same runs spend with secret randomness. The data say so in their ``note``.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dptrain.errors import AccountingError, ConfigError
from dptrain.scatternet import DEFAULT_CACHE_DIR

__all__ = [
    "DELTA",
    "FIG2",
    "METHODS",
    "MODELMIX_FALLBACKS",
    "NOTE",
    "PHYSICAL_BATCH",
    "QUICK",
    "TABLE1",
    "evaluate",
    "experiments",
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
    "non_private": {"max_grad_norm": 0.1, "learning_rate": 4.0},
}
#: Fig. 2's same-noise comparison on the same features.
FIG2: dict[str, Any] = {
    "sampling_rate": 0.05,
    "steps": 400,
    "max_grad_norm": 1.0,
    "target_epsilon": 8.0,
    "eta": 0.2,
    "tau": 0.05,
    "eval_every": 20,
}
#: Examples per physical chunk of a logical batch (the per-example gradients held at once). Performance only: the
#: logical batch, and so the privacy, is the same. Measured on 2 idle cores (2 torch threads), one DP-SGD step at
#: expected batch 8192 takes 0.9 s in chunks of 256 and 1.4 s in the engine's default chunks (2029 examples, the
#: most whose per-example gradients fit in 256 MiB).
PHYSICAL_BATCH = 256
#: Quick mode (a test's seconds): a fixed subset of Fashion-MNIST, few steps.
QUICK = {"n_train": 2000, "n_test": 1000, "steps": 20, "eval_every": 5}
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
    from :func:`dptrain.data.load_fashion_mnist` (a DataError when they are not installed)."""
    from dptrain.data import load_fashion_mnist
    from dptrain.scatternet import cached_fashion_mnist_features, scatter_features

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
    modelmix_fallback: str = "auto",
):
    """(model, trainer, why the modelmix accountant refused or None) of one run: torch seeded with ``seed``
    before the model is built (its initialization), the engine seeded with ``seed`` (sampling, noise, mixing).
    With ``epsilon`` the noise is calibrated for ``steps`` steps (:func:`make_private_with_epsilon`; DP-SGD: the
    tightest certifying accountant; ModelMix: the modelmix accountant, else :func:`_modelmix_fallback`), else
    ``noise_multiplier`` is used (0 and ``non_private`` for the baseline)."""
    from dptrain.engine import make_private, make_private_with_epsilon
    from dptrain.scatternet import scatter_cnn_fmnist

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
    if method == "non_private":
        trainer = make_private(model, optimizer, data, noise_multiplier=0.0, non_private=True, **common)
        return model, trainer, None
    accountant = "modelmix" if method == "modelmix" else "auto"
    if epsilon is None:
        trainer = make_private(
            model,
            optimizer,
            data,
            noise_multiplier=noise_multiplier,
            delta=DELTA,
            accountant=accountant,
            **common,
        )
        return model, trainer, None
    calibrated = {"target_epsilon": epsilon, "target_delta": DELTA, "steps": steps, **common}
    try:
        trainer = make_private_with_epsilon(model, optimizer, data, accountant=accountant, **calibrated)
        return model, trainer, None
    except AccountingError as e:
        if method != "modelmix":
            raise
        refused = str(e)
    return model, _modelmix_fallback(model, optimizer, data, modelmix_fallback, calibrated), refused


MODELMIX_FALLBACKS = ("auto", "uncertified")


def _modelmix_fallback(model, optimizer, data, fallback: str, calibrated: dict):
    """The trainer of a ModelMix run that the modelmix accountant cannot certify at its target.

    The modelmix accountant certifies only the parameter range where the soundness review checked the paper's
    reductions (:data:`dptrain.accounting.modelmix.CERTIFIED_RANGE`); outside it ``make_private_with_epsilon``
    refuses. ``fallback``:

    - "auto": calibrate on every accountant and keep the tightest certified one (pld or rdp certify a ModelMix
      run: its release post-processes the noisy gradient and the released iterates with secret weights). The
      budget is enforced as for DP-SGD.
    - "uncertified": calibrate on the modelmix accountant's uncertified answer (the paper's kind of claim); the run
      takes exactly its planned steps with no enforced budget, and its row says ``certified: false`` and gives
      the epsilon that a certifying accountant proves for it."""
    from dptrain.accounting import calibrate_noise
    from dptrain.engine import make_private, make_private_with_epsilon

    if fallback == "auto":
        return make_private_with_epsilon(model, optimizer, data, accountant="auto", **calibrated)
    if fallback != "uncertified":
        raise ConfigError(
            f"modelmix_fallback must be one of {', '.join(MODELMIX_FALLBACKS)}, got {fallback!r}"
        )
    common = {k: calibrated[k] for k in ("max_grad_norm", "batch_size", "seed", "max_physical_batch_size")}
    steps = calibrated["steps"]
    probe = make_private(
        model, optimizer, data, noise_multiplier=1.0, delta=DELTA, accountant="modelmix", **common
    )
    sigma = calibrate_noise(
        calibrated["target_epsilon"],
        DELTA,
        lambda s: probe.ledger_after(steps, s),
        "modelmix",
        require_certified=False,
    )
    probe.close()
    return make_private(
        model, optimizer, data, noise_multiplier=sigma, delta=DELTA, accountant="modelmix", **common
    )


def _privacy(trainer) -> dict[str, Any]:
    """The run's epsilon at DELTA by the accountant it was calibrated with (certified or not), and a certified
    epsilon: that same one when it is certified, else the tightest that any accountant certifies."""
    if trainer.non_private:
        return {
            "certified": None,
            "calibration_epsilon": None,
            "certified_epsilon": None,
            "certified_by": None,
        }
    report = trainer.epsilon(DELTA)
    best = report if report.certified else trainer.epsilon(DELTA, accountant="auto")
    out = {
        "certified": report.certified,
        "calibration_epsilon": report.epsilon,
        "certified_epsilon": best.epsilon,
        "certified_by": best.accountant,
    }
    if not report.certified:
        out["not_certified_because"] = report.details.get("note", "the accountant gives an approximation")
    return out


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
    ledger gets None, and its reason in the second dict."""
    values, refused = {}, {}
    for name in names:
        try:
            report = trainer.epsilon(DELTA, accountant=name)
            values[name] = {"epsilon": report.epsilon, "certified": report.certified}
        except AccountingError as e:
            values[name], refused[name] = None, str(e)
    return values, refused


# --- Table I ------------------------------------------------------------------------------------------------


def table1(
    quick: bool,
    seeds=(0, 1, 2),
    epsilons=(0.2, 0.6, 1.0),
    progress: bool = True,
    methods=METHODS,
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    modelmix_fallback: str = "auto",
) -> dict:
    """Table I's Fashion-MNIST row (see the module docstring): one row per (epsilon, method) and one non-private
    row, each with the median test accuracy over ``seeds``. Quick: QUICK["n_train"] training examples (same q,
    so an expected batch of about 273), QUICK["steps"] steps, the first seed and the largest epsilon only (its
    calibration is the quickest). ``modelmix_fallback``: how a ModelMix run that the modelmix accountant cannot
    certify is calibrated (:func:`_modelmix_fallback`)."""
    if modelmix_fallback not in MODELMIX_FALLBACKS:
        raise ConfigError(
            f"modelmix_fallback must be one of {', '.join(MODELMIX_FALLBACKS)}, got {modelmix_fallback!r}"
        )
    start = time.perf_counter()
    x, y, x_test, y_test = features(quick, cache_dir, progress)
    steps = QUICK["steps"] if quick else TABLE1["steps"]
    seeds, epsilons = ((tuple(seeds)[0],), (max(epsilons),)) if quick else (tuple(seeds), tuple(epsilons))
    q = TABLE1["sampling_rate"]
    batch_size = q * len(x)
    cells = [(eps, m) for eps in epsilons for m in ("dpsgd", "modelmix") if m in methods]
    if "non_private" in methods:
        cells.append((None, "non_private"))
    rows = []
    for eps, method in cells:
        setting = TABLE1[method]
        runs = []
        for seed in seeds:
            t0 = time.perf_counter()
            model, trainer, refused = _trainer(
                method,
                (x, y),
                seed=seed,
                steps=steps,
                batch_size=batch_size,
                max_grad_norm=setting["max_grad_norm"],
                learning_rate=setting["learning_rate"],
                tau=setting.get("tau"),
                epsilon=eps,
                modelmix_fallback=modelmix_fallback,
            )
            desc = f"{method} eps={eps} seed={seed}" if eps is not None else f"{method} seed={seed}"
            _run_steps(trainer, steps, desc, progress)
            accuracy, loss = evaluate(model, x_test, y_test)
            runs.append(
                {
                    "seed": seed,
                    "accuracy": accuracy,
                    "test_loss": loss,
                    **_privacy(trainer),
                    "accountant": None if trainer.non_private else trainer.accountant,
                    "noise_multiplier": trainer.noise_multiplier,
                    "steps": trainer.steps,
                    "seconds": time.perf_counter() - t0,
                }
            )
            if (
                method == "modelmix"
            ):  # the modelmix accountant's answer, whichever accountant calibrated the run
                runs[-1]["modelmix_epsilon"] = _epsilons(trainer, ("modelmix",))[0]["modelmix"]
                runs[-1]["modelmix_refused"] = refused
            trainer.close()
        accuracies = [r["accuracy"] for r in runs]
        private = runs[0]["certified"] is not None
        rows.append(
            {
                "dataset": "fashion_mnist",
                "epsilon": eps,
                "delta": None if eps is None else DELTA,
                "method": method,
                "accuracy_median": statistics.median(accuracies),
                "accuracies": accuracies,
                "seeds": list(seeds),
                "certified_epsilon": max(r["certified_epsilon"] for r in runs) if private else None,
                "accountant": runs[0]["accountant"],
                "certified": all(r["certified"] for r in runs) if private else None,
                "certified_by": runs[0]["certified_by"],
                "calibration_epsilon": max(r["calibration_epsilon"] for r in runs) if private else None,
                "not_certified_because": runs[0].get("not_certified_because"),
                "modelmix_epsilon": runs[0].get("modelmix_epsilon"),
                "modelmix_refused": runs[0].get("modelmix_refused"),
                "modelmix_fallback": modelmix_fallback if runs[0].get("modelmix_refused") else None,
                "noise_multiplier": max(r["noise_multiplier"] for r in runs),
                "steps": min(r["steps"] for r in runs),
                "seconds": sum(r["seconds"] for r in runs),
                "max_grad_norm": setting["max_grad_norm"],
                "learning_rate": setting["learning_rate"],
                "tau": setting.get("tau"),
                "runs": runs,
            }
        )
    return {
        "experiment": "table1",
        "quick": bool(quick),
        "dataset": "fashion_mnist",
        "features": {"name": "ScatterNet", "J": 2, "L": 8, "shape": list(x.shape[1:])},
        "model": "scatter_cnn_fmnist (GroupNorm(27, 81) + Tramer & Boneh's CNN)",
        "n_train": len(x),
        "n_test": len(x_test),
        "sampling_rate": q,
        "expected_batch_size": batch_size,
        "physical_batch_size": PHYSICAL_BATCH,
        "steps": steps,
        "delta": DELTA,
        "settings": {m: TABLE1[m] for m in METHODS if m in methods},
        "modelmix_fallback": modelmix_fallback,
        "rows": rows,
        "note": NOTE,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "wall_time_s": time.perf_counter() - start,
    }


# --- Fig. 2 -------------------------------------------------------------------------------------------------


def fig2(
    quick: bool, seed: int = 0, progress: bool = True, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR
) -> dict:
    """Fig. 2's same-noise curves (see the module docstring). Every run uses the same seed: the same initial model
    and, for the two DP-SGD runs, the same batches and noise draws. Quick: QUICK["n_train"] training examples,
    QUICK["steps"] steps, an evaluation every QUICK["eval_every"] steps."""
    start = time.perf_counter()
    x, y, x_test, y_test = features(quick, cache_dir, progress)
    steps = QUICK["steps"] if quick else FIG2["steps"]
    every = QUICK["eval_every"] if quick else FIG2["eval_every"]
    q, clip, eta, tau = FIG2["sampling_rate"], FIG2["max_grad_norm"], FIG2["eta"], FIG2["tau"]
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
        model, trainer, _ = _trainer(
            spec["method"],
            (x, y),
            seed=seed,
            steps=steps,
            batch_size=batch_size,
            max_grad_norm=clip,
            learning_rate=spec["learning_rate"],
            tau=spec["tau_over_lr"],
            epsilon=FIG2["target_epsilon"] if sigma is None else None,  # the first run calibrates sigma
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
        "experiment": "fig2",
        "quick": bool(quick),
        "dataset": "fashion_mnist",
        "features": {"name": "ScatterNet", "J": 2, "L": 8, "shape": list(x.shape[1:])},
        "model": "scatter_cnn_fmnist (GroupNorm(27, 81) + Tramer & Boneh's CNN)",
        "n_train": len(x),
        "n_test": len(x_test),
        "seed": seed,
        "sampling_rate": q,
        "expected_batch_size": batch_size,
        "physical_batch_size": PHYSICAL_BATCH,
        "max_grad_norm": clip,
        "steps": steps,
        "eval_every": every,
        "eta": eta,
        "target_epsilon": FIG2["target_epsilon"],
        "delta": DELTA,
        "noise_multiplier": sigma,
        "calibrated_by": calibrated_by,
        "runs": runs,
        "note": NOTE,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "wall_time_s": time.perf_counter() - start,
    }


def experiments(quick: bool, out_dir: str | Path | None = None, progress: bool = True) -> dict:
    """Both experiments: {"table1": ..., "fig2": ...}. Nothing is written to ``out_dir`` (the caller's writer does);
    the full runs cache the features in :data:`dptrain.scatternet.DEFAULT_CACHE_DIR`."""
    return {"table1": table1(quick, progress=progress), "fig2": fig2(quick, progress=progress)}
