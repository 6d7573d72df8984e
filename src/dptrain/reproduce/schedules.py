"""Reproduction of App. D of "On Dynamic Noise Influence in Differential Private Learning" (anonymous ICLR 2021
submission; docs/schedules.md): noise influence estimated by retraining, and uniform vs dynamic vs exponential
schedules of private gradient descent at the same budget.

``run(out_dir, quick=False)`` writes ``schedules.md``, ``schedules.json`` and the plots into ``out_dir``.

Setting (App. D): N = 1000 training examples, full-batch private gradient descent theta_{t+1} = theta_t - eta
(mean_i clip_G(grad_i) + G sigma_t nu_t / N), nu_t ~ N(0, I), eta = 0.1, per-example clipping at G = 4, theta_1 = 0,
T = 100 steps, budget R = 0.3927 (rho = 0.1963-zCDP, i.e. (4, 1e-8) by Lemma B.3), 100 repeats. Preprocessing: each
feature centred and scaled to std 1, then every example scaled by one factor so that max_n ||x_n|| = the data
scale (swept). Labels are +-1; the squared loss is 1/2 (theta.x - y)^2 and the logistic loss ln(1 + e^(-y theta.x)).

Data sets:

- ``synthetic``: 100-dimensional, two classes around the points +-0.5 (1, ..., 1) of the hypercube (Euclidean
  distance 10) with unit Gaussian noise: linearly separable (the paper's scikit-learn call is not given);
  logistic loss.
- ``fmnist``: 1000 Fashion-MNIST training images of classes 5 (sandal) and 7 (sneaker), projected onto their first
  60 principal components. The paper uses MNIST 3 vs 5, which cannot be downloaded here. The PCA is computed on the
  same 1000 images without privacy (the paper does not account for it either). Squared and logistic loss.

Per (data set, loss, data scale):

1. Influence by retraining (:func:`dptrain.schedules.influence.estimate_influence`): base schedule uniform
   (sigma_t^2 = T/R, Thm 4.2), sigma_t on App. D's grid 20..200, final loss fitted as c2 sigma_t^2 + c0, q_t = c2,
   at every 10th step (t = 1, 10, ..., 100; App. D estimates all 100) and interpolated log-linearly in between.
   For the squared loss also the analytic influence from the Hessian eigenvalues
   (:func:`dptrain.schedules.influence.quadratic_influence`, which ignores clipping).
2. Schedules at T = 100, all spending R exactly (zCDP, the paper's accounting): ``uni``; ``dyn`` (Lemma 4.1 on the
   estimated q); ``exp`` (sigma_0 e^(-k t) fitted to dyn by least squares in log space, then rescaled to R, as App. D
   does with Yu et al.'s exponential decay). The same three shapes calibrated by the exact accountant at (4, 1e-8)
   (full-batch Gaussian steps compose into one Gaussian: Dong, Roth & Su) show what the tighter accounting buys.
3. Mean final training loss over ``repeats`` runs (seeds disjoint from the influence runs), the relative loss
   (x - uni)/uni, Lemma 4.1's predicted relative gain of the bound T^2 Var(sqrt q)/(T sum q) (eq. 25, normalised),
   and the fraction of clipped per-example gradients under ``uni``.

Deviations: T is fixed at 100 for every schedule (the paper grid-searches T per schedule by final loss, ignoring
the tuning's privacy cost); the influence is estimated at 10 steps, not all 100; the DNN with momentum (Fig. 2 right)
is not reproduced. The training here is a vectorised re-implementation of the engine's full-batch step (clip, sum,
Gaussian noise of std G sigma_t on the sum, divide by N); tests/test_reproduce_schedules.py checks that it follows the
engine's trajectory exactly without noise.
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy import special

from dptrain.reproduce import md_table
from dptrain.reproduce.report import Report, Section, figure
from dptrain.schedules.bounds_constants import R_from_eps_delta
from dptrain.schedules.calibration import calibrate_shape
from dptrain.schedules.influence import PAPER_GRID, estimate_influence, quadratic_influence

EPSILON, DELTA = 4.0, 1e-8
R_BUDGET = R_from_eps_delta(EPSILON, DELTA)  # 0.3927 (Lemma B.3, the root that reproduces the paper's example)
FULL = {
    "n": 1000,
    "T": 100,
    "lr": 0.1,
    "clip": 4.0,
    "repeats": 100,
    "grid": PAPER_GRID,
    "t_estimated": (1, *range(10, 101, 10)),
    "scales": (1.0, 5.0, 10.0, 15.0, 20.0),
    "experiments": (("synthetic", "logistic"), ("fmnist", "squared"), ("fmnist", "logistic")),
    "dim": 100,
    "pca": 60,
    "fits_at": (10, 60, 90),
    "momentum": {"data": "fmnist", "n": 1000, "n_test": 10000, "scales": (5.0, 15.0, 25.0), "T": (50, 100),
                 "tune_seeds": 10, "eval_seeds": 20},
}
QUICK = {
    **FULL,
    "n": 200,
    "T": 20,
    "repeats": 20,
    "grid": (20.0, 80.0, 140.0, 200.0),
    "t_estimated": (1, 5, 10, 15, 20),
    "scales": (1.0, 10.0),
    "experiments": (("synthetic", "logistic"), ("synthetic", "squared")),
    "dim": 10,
    "fits_at": (5, 15),
    "momentum": {"data": "synthetic", "n": 150, "n_test": 150, "scales": (5.0,), "T": (10,), "tune_seeds": 2,
                 "eval_seeds": 3},
}
FMNIST_CLASSES = (5, 7)
SCHEDULES = ("uni", "dyn", "exp")


# --- data ---------------------------------------------------------------------------------------------------------


def app_d_scaled(x: np.ndarray, scale: float) -> np.ndarray:
    """App. D's preprocessing: centre and standardise each feature, then scale so that max_n ||x_n|| = scale."""
    x = x - x.mean(axis=0)
    std = x.std(axis=0)
    x = x / np.where(std > 0, std, 1.0)
    return x * (scale / np.max(np.linalg.norm(x, axis=1)))


def synthetic(n: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two classes around +-0.5 (1, ..., 1) (distance sqrt(dim)) with unit Gaussian noise; labels +-1."""
    rng = np.random.default_rng(seed)
    y = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
    x = y[:, None] * 0.5 * (10 / math.sqrt(dim)) * np.ones(dim) + rng.standard_normal((n, dim))
    return x, y


def fmnist_pca(n: int, components: int) -> tuple[np.ndarray, np.ndarray]:
    """The first n Fashion-MNIST training images of FMNIST_CLASSES (labels +1, -1) on their first principal
    components (computed on these images, not privately)."""
    from dptrain.reproduce import fashion_mnist

    train = fashion_mnist().train
    a, b = FMNIST_CLASSES
    labels = train.y.numpy()
    idx = np.flatnonzero((labels == a) | (labels == b))[:n]
    x = train.x[idx].reshape(len(idx), -1).numpy().astype(np.float64)
    x = x - x.mean(axis=0)
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    return x @ vt[:components].T, np.where(labels[idx] == a, 1.0, -1.0)


# --- private gradient descent, vectorised over repeats -----------------------------------------------------------


def _coef(z: np.ndarray, y: np.ndarray, loss: str) -> np.ndarray:
    """d loss / d z at z = theta.x (per example)."""
    return z - y if loss == "squared" else -y * special.expit(-y * z)


def _loss(z: np.ndarray, y: np.ndarray, loss: str) -> np.ndarray:
    return 0.5 * (z - y) ** 2 if loss == "squared" else np.logaddexp(0.0, -y * z)


def private_gd(
    x: np.ndarray, y: np.ndarray, loss: str, sigmas, seeds, *, lr: float, clip: float
) -> tuple[np.ndarray, np.ndarray]:
    """(final training loss, fraction of clipped per-example gradients) of one run per seed of private GD with
    noise multipliers ``sigmas`` (see the module doc). Repeat r's noise comes from numpy's generator seeded with
    seeds[r] alone, so the same seed gives the same noise whatever the sigmas (common random numbers)."""
    sigmas = np.asarray(sigmas, dtype=float)
    n, d = x.shape
    noise = np.stack([np.random.default_rng(s).standard_normal((sigmas.size, d)) for s in seeds])
    theta = np.zeros((len(seeds), d))
    norms = np.linalg.norm(x, axis=1)
    clipped = np.zeros(len(seeds))
    for t, sigma in enumerate(sigmas):
        coef = _coef(theta @ x.T, y, loss)
        g_norm = np.abs(coef) * norms
        factor = np.minimum(1.0, clip / np.maximum(g_norm, 1e-300))
        clipped += (g_norm > clip).mean(axis=1)
        grad = (coef * factor) @ x / n + clip * sigma * noise[:, t] / n
        theta = theta - lr * grad
    return _loss(theta @ x.T, y, loss).mean(axis=1), clipped / max(1, sigmas.size)


def _final_losses(x, y, loss, lr, clip, sigmas, seeds):
    return private_gd(x, y, loss, sigmas, seeds, lr=lr, clip=clip)[0]


# --- schedules -------------------------------------------------------------------------------------------------------


def _interpolated(t_est: list[int], q_est: np.ndarray, T: int) -> tuple[np.ndarray, int]:  # noqa: N803
    """q at t = 1..T, log-linear between the estimated steps; non-positive estimates are raised to 1e-3 of the largest
    (returns how many were)."""
    q = np.asarray(q_est, dtype=float)
    floor = 1e-3 * np.max(q) if np.max(q) > 0 else 1.0
    bad = int(np.sum(~(q > 0)))
    q = np.where(q > 0, q, floor)
    return np.exp(np.interp(np.arange(1, T + 1), t_est, np.log(q))), bad


def _exp_fit(sigmas: np.ndarray) -> np.ndarray:
    """sigma_0 e^(-k t) fitted to ``sigmas`` by least squares in log space (its shape; rescaled by calibration)."""
    t = np.arange(1, sigmas.size + 1, dtype=float)
    slope, _ = np.polyfit(t, np.log(sigmas), 1)
    return np.exp(slope * (t - 1))


def schedules(q: np.ndarray, T: int) -> dict[str, dict[str, list[float]]]:  # noqa: N803
    """uni / dyn / exp noise multipliers, calibrated by zCDP to R (the paper's) and exactly to (4, 1e-8)."""
    shapes = {"uni": np.ones(T), "dyn": q**-0.25}  # Lemma 4.1: sigma_t^2 proportional to 1/sqrt(q_t)
    shapes["exp"] = _exp_fit(calibrate_shape(shapes["dyn"], R=R_BUDGET).sigmas)
    out: dict[str, dict[str, list[float]]] = {"zcdp": {}, "exact": {}}
    for name, shape in shapes.items():
        out["zcdp"][name] = calibrate_shape(shape, R=R_BUDGET).sigmas.tolist()
        out["exact"][name] = calibrate_shape(shape, epsilon=EPSILON, delta=DELTA, accountant="exact").sigmas.tolist()
    return out


# --- the experiment ------------------------------------------------------------------------------------------------


def _data(name: str, config: dict) -> tuple[np.ndarray, np.ndarray]:
    if name == "synthetic":
        return synthetic(config["n"], config["dim"])
    return fmnist_pca(config["n"], config["pca"])


def one_setting(name: str, loss: str, scale: float, config: dict, workers: int | None, cache: Path | None) -> dict:
    raw_x, y = _data(name, config)
    x = app_d_scaled(raw_x, scale)
    T, lr, clip, repeats = config["T"], config["lr"], config["clip"], config["repeats"]  # noqa: N806
    uniform = np.full(T, math.sqrt(T / R_BUDGET))  # Thm 4.2
    run = functools.partial(_final_losses, x, y, loss, lr, clip)
    t_est = list(config["t_estimated"])
    est = estimate_influence(
        run,
        uniform,
        steps=t_est,
        grid=config["grid"],
        repeats=repeats,
        seed=0,
        workers=workers,
        cache=cache,
        setting={"data": name, "loss": loss, "scale": scale, "n": config["n"], "dim": config["dim"], "lr": lr, "clip": clip},
        batched=True,
    )
    q_est = est.q[np.asarray(t_est) - 1]
    q, non_positive = _interpolated(t_est, q_est, T)
    sched = schedules(q, T)
    seeds = list(range(10**6, 10**6 + repeats))  # disjoint from the influence runs' seeds
    results: dict[str, dict[str, Any]] = {}
    finals: dict[tuple[str, str], np.ndarray] = {}
    clipped_uni = None
    for accounting, by_name in sched.items():
        results[accounting] = {}
        for sname, sig in by_name.items():
            final, clipped = private_gd(x, y, loss, sig, seeds, lr=lr, clip=clip)
            finals[accounting, sname] = final
            results[accounting][sname] = {"mean": float(final.mean()), "se": _se(final)}
            if accounting == "zcdp" and sname == "uni":
                clipped_uni = float(clipped.mean())
    uni = finals["zcdp", "uni"]
    noise_free = float(private_gd(x, y, loss, np.zeros(T), [0], lr=lr, clip=clip)[0][0])
    for (accounting, sname), final in finals.items():  # paired over the seeds (the same noise for every schedule)
        diff = (final - uni) / uni.mean()
        excess = (final - uni) / (uni.mean() - noise_free)  # relative to the loss the noise adds under uni
        results[accounting][sname].update(
            relative=float(diff.mean()),
            relative_se=_se(diff),
            excess_relative=float(excess.mean()),
            excess_relative_se=_se(excess),
        )
    sq = np.sqrt(q)
    out = {
        "data": name,
        "loss": loss,
        "scale": scale,
        "t_estimated": t_est,
        "q_estimated": q_est.tolist(),
        "non_positive_estimates": non_positive,
        "fits": {
            str(t): {
                "c2": f.c2,
                "c0": f.c0,
                "loss_mean": f.loss_mean,
                "loss_var": f.loss_var,
                "relative_variance": f.relative_variance,
                "c2_relative_variance": f.c2_relative_variance,
            }
            for t, f in est.fits.items()
        },
        "grid": list(est.grid),
        "predicted_gain": float(T**2 * np.var(sq) / (T * np.sum(q))),  # Lemma 4.1, eq. 25, relative to uni
        "T2_var_sqrt_q": float(T**2 * np.var(sq)),
        "schedules": sched,
        "final_loss": results,
        "clipped_fraction_uni": clipped_uni,
        "noise_free_loss": noise_free,
    }
    if loss == "squared" and clipped_uni < 0.05:  # the analytic influence of H = X^T X / N (valid without clipping)
        eig = np.linalg.eigvalsh(x.T @ x / len(x))
        out["q_analytic"] = quadratic_influence(np.clip(eig, 0, None), T, lr, clip, len(x)).tolist()
    return out


def momentum_experiment(config: dict, log=None) -> list[dict]:
    """The two-layer network with momentum (:mod:`dptrain.reproduce.schedules_momentum`) at each scale and T."""
    from dptrain.reproduce import schedules_momentum as sm

    m = config["momentum"]
    if m["data"] == "fmnist":
        x, y, xt, yt = sm.fmnist_pca10(m["n"], m["n_test"], config["pca"])
    else:
        x, y, xt, yt = sm.synthetic10(m["n"], m["n_test"], config["dim"])
    tune = list(range(2 * 10**6, 2 * 10**6 + m["tune_seeds"]))
    evaluate = list(range(3 * 10**6, 3 * 10**6 + m["eval_seeds"]))
    rows = []
    for scale in m["scales"]:
        xs, xts = sm.scaled(x, xt, scale)
        for T in m["T"]:  # noqa: N806
            t0 = time.perf_counter()
            out = sm.compare(xs, y, xts, yt, T=T, R=R_BUDGET, lr=config["lr"], clip=config["clip"], tune_seeds=tune,
                             eval_seeds=evaluate)
            rows.append({"scale": scale, **out})
            if log is not None:
                log(f"momentum network scale {scale:g} T {T}: {time.perf_counter() - t0:.1f} s")
    return rows


def experiment(config: dict, workers: int | None = None, cache: Path | None = None, log=None) -> dict:
    rows = []
    for name, loss in config["experiments"]:
        for scale in config["scales"]:
            t0 = time.perf_counter()
            rows.append(one_setting(name, loss, scale, config, workers, cache))
            if log is not None:
                log(f"{name}/{loss} scale {scale:g}: {time.perf_counter() - t0:.1f} s")
    return {
        "rows": rows,
        "momentum": momentum_experiment(config, log),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()},
    }


def _se(v: np.ndarray) -> float:
    return float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0


# --- report ------------------------------------------------------------------------------------------------------------


def _pct(r: dict) -> str:
    return f"{100 * r['relative']:+.1f} +- {100 * r.get('relative_se', 0.0):.1f}%"


def _comparison_table(rows: list[dict]) -> str:
    head = ["data / loss", "scale", "uni (zCDP)", "no noise", "dyn", "exp", "uni exact", "dyn exact",
            "dyn: change of the noise's excess loss", "predicted by Lemma 4.1", "clipped (uni)"]
    body = []
    for r in rows:
        z, e = r["final_loss"]["zcdp"], r["final_loss"]["exact"]
        body.append([
            f"{r['data']} / {r['loss']}",
            f"{r['scale']:g}",
            f"{z['uni']['mean']:.4g} +- {z['uni']['se']:.2g}",
            f"{r['noise_free_loss']:.4g}",
            _pct(z["dyn"]),
            _pct(z["exp"]),
            _pct(e["uni"]),
            _pct(e["dyn"]),
            f"{100 * z['dyn']['excess_relative']:+.0f} +- {100 * z['dyn']['excess_relative_se']:.0f}%",
            f"{-100 * r['predicted_gain']:.0f}%" + (" *" if r["non_positive_estimates"] else ""),
            f"{100 * r['clipped_fraction_uni']:.0f}%",
        ])
    return md_table(head, body)


def _fits_table(rows: list[dict], fits_at) -> str:
    head = ["data / loss", "scale", *[f"t = {t}: rel. var. of final loss / of c2" for t in fits_at]]
    body = []
    for r in rows:
        cells = []
        for t in fits_at:
            f = r["fits"].get(str(t))
            cells.append("-" if f is None else f"{f['relative_variance']:.3g} / {f['c2_relative_variance']:.3g}")
        body.append([f"{r['data']} / {r['loss']}", f"{r['scale']:g}", *cells])
    return md_table(head, body)


def _draw_influence(rows: list[dict]):
    def draw(fig, axes):
        groups = sorted({(r["data"], r["loss"]) for r in rows})
        for ax, (data, loss) in zip(np.atleast_1d(axes), groups, strict=False):
            for r in rows:
                if (r["data"], r["loss"]) != (data, loss):
                    continue
                q = np.asarray(r["q_estimated"], dtype=float)
                ax.plot(r["t_estimated"], q / np.max(np.abs(q)), marker="o", label=f"scale {r['scale']:g}")
                if "q_analytic" in r:
                    qa = np.asarray(r["q_analytic"])
                    ax.plot(np.arange(1, qa.size + 1), qa / qa.max(), ls="--", color=ax.lines[-1].get_color())
            ax.set_title(f"{data} / {loss}")
            ax.set_xlabel("step t")
            ax.set_ylabel("q_t / max q (retraining; dashed: analytic)")
            ax.legend(fontsize=7)
        fig.tight_layout()

    return draw


def _fit_rows(rows: list[dict]) -> list[dict]:
    """The settings whose loss-vs-sigma_t^2 fits are drawn: each (data, loss) at its middle data scale."""
    out = []
    for group in sorted({(r["data"], r["loss"]) for r in rows}):
        rs = [r for r in rows if (r["data"], r["loss"]) == group]
        out.append(rs[len(rs) // 2])
    return out


def _draw_fits(rows: list[dict], fits_at):
    def draw(fig, axes):
        grid = None
        for ax, r in zip(np.atleast_1d(axes), _fit_rows(rows), strict=False):
            grid = np.asarray(r["grid"]) ** 2
            for t in fits_at:
                f = r["fits"].get(str(t))
                if f is None:
                    continue
                line = ax.plot(grid, f["loss_mean"], "o", ms=3, label=f"t = {t}")[0]
                ax.plot(grid, f["c2"] * grid + f["c0"], color=line.get_color(), lw=1)
            ax.set_title(f"{r['data']} / {r['loss']}, scale {r['scale']:g}", fontsize=9)
            ax.set_xlabel("sigma_t^2")
            ax.set_ylabel("mean final loss")
            ax.legend(fontsize=7)
        fig.tight_layout()

    return draw


def _draw_relative(rows: list[dict]):
    def draw(fig, ax):
        for data, loss in sorted({(r["data"], r["loss"]) for r in rows}):
            rs = [r for r in rows if (r["data"], r["loss"]) == (data, loss)]
            scales = [r["scale"] for r in rs]
            line = ax.plot(scales, [100 * r["final_loss"]["zcdp"]["dyn"]["excess_relative"] for r in rs], marker="o",
                           label=f"{data}/{loss}: dyn")[0]
            ax.plot(scales, [100 * r["final_loss"]["zcdp"]["exp"]["excess_relative"] for r in rs], marker="s", ls=":",
                    color=line.get_color(), label=f"{data}/{loss}: exp")
            ax.plot(scales, [-100 * r["predicted_gain"] for r in rs], ls="--", color=line.get_color(),
                    label=f"{data}/{loss}: Lemma 4.1 (bound)")
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xlabel("data scale (max ||x||)")
        ax.set_ylabel("change of the noise's excess loss vs uni, %")
        ax.set_ylim(-100, 50)  # (at data scale 1 the noise adds almost no loss and the ratio is meaningless)
        ax.legend(fontsize=7)
        fig.tight_layout()

    return draw


def _momentum_table(rows: list[dict]) -> str:
    head = ["scale", "T", "uni: train loss / test acc.", "expinfl (chosen)", "momexpinfl (chosen)"]
    body = []
    for r in rows:
        res = r["results"]
        u = res["uni"]
        cells = [f"{r['scale']:g}", str(r["T"]), f"{u['train_loss_mean']:.4f} / {100 * u['test_accuracy_mean']:.1f}%"]
        for family in ("expinfl", "momexpinfl"):
            x = res[family]
            params = ", ".join(f"{k}={v:g}" for k, v in x["params"].items())
            cells.append(
                f"{100 * x['relative']:+.1f} +- {100 * x['relative_se']:.1f}% loss, "
                f"{100 * x['test_accuracy_mean']:.1f}% acc. ({params})"
            )
        body.append(cells)
    return md_table(head, body)


def render(data: dict) -> Report:
    rows, config = data["rows"], data["config"]
    groups = sorted({(r["data"], r["loss"]) for r in rows})
    intro = [
        f"Command: `{data['command']}` ({data['wall_s'] / 60:.1f} min on {data['cpu_count']} cores, "
        f"{data['date']}). Budget R = {R_BUDGET:.4f} (rho = {R_BUDGET / 2:.4f}-zCDP, (epsilon, delta) = ({EPSILON:g}, "
        f"{DELTA:g}) by Lemma B.3); N = {config['n']}, T = {config['T']}, eta = {config['lr']:g}, clip G = "
        f"{config['clip']:g}, {config['repeats']} repeats; influence estimated at t = "
        f"{', '.join(str(t) for t in config['t_estimated'])} on the grid {', '.join(f'{g:g}' for g in config['grid'])}.",
        "Data: `synthetic` (100-dim separable, logistic); `fmnist`: Fashion-MNIST classes "
        f"{FMNIST_CLASSES[0]} vs {FMNIST_CLASSES[1]} on 60 PCA components, standing in for the paper's MNIST 3 vs 5. "
        "The module docstring of dptrain.reproduce.schedules gives every setting and deviation." if not data["quick"]
        else "Quick mode: a reduced synthetic setting for tests; the numbers mean nothing.",
    ]
    sections = [
        Section(
            "Uniform vs dynamic vs exponential at the same budget",
            [
                "Mean final training loss over the repeats ('no noise': the same clipped GD without noise); the next "
                "columns are (loss - uni)/uni under the same budget: dyn and exp calibrated as the paper does (zCDP, "
                "sum sigma_t^-2 = R), and uni and dyn calibrated exactly at (4, 1e-8) (full-batch Gaussian steps "
                "compose into one Gaussian). Then dyn's change of the loss the noise adds, (dyn - uni)/(uni - no "
                "noise), beside what Lemma 4.1 predicts for the bound's noise term from the estimated influence, "
                "-T^2 Var(sqrt q)/(T sum q) (eq. 25). Negative is better; +- is the standard error of the "
                "difference, paired over the seeds (every schedule sees the same noise draws). *: some influence "
                "estimates were not positive (the noise barely moves the final loss at that scale, and the "
                "estimates are mostly noise), so the predicted gain there measures estimation noise.",
                _comparison_table(rows),
                "![relative loss](relative_loss.png)",
            ],
        ),
        Section(
            "Influence by retraining",
            [
                "q_t estimated by retraining (App. D), normalised by its largest value; dashed: the analytic influence "
                "of the squared loss from the Hessian eigenvalues, shown where under 5% of the gradients are clipped (it ignores "
                "clipping; with clipping at larger scales, plain GD at eta = 0.1 would diverge and the formula with it).",
                "![influence](influence.png)",
                "Relative variance (variance / mean over repeats) of the final loss on the grid, and of the quadratic "
                "coefficient c2 fitted to each repeat (paper, squared loss on MNIST35: 0.14 / 0.032 / 0.016 at t = 10 / "
                "60 / 90; logistic, of c2: 0.025 / 0.024 / 0.027).",
                _fits_table(rows, config["fits_at"]),
                "Final loss against sigma_t^2 with the fitted line c2 sigma_t^2 + c0 (each (data, loss) at its middle "
                "data scale):",
                "![fits](fits.png)",
            ],
        ),
        Section(
            "Two-layer network with momentum (Fig. 2 right)",
            [
                "A 100-unit ReLU network, cross-entropy on 10 classes, full-batch private GD with bias-corrected "
                "momentum (beta = 0.9), every schedule spending R exactly under zCDP. expinfl: Lemma 4.1 on "
                "q_t = e^(a t); momexpinfl: on q_t = c1 g^(T+t) + c2 g^(T-t); each family's parameters chosen on a grid "
                f"by the mean final training loss of {config['momentum']['tune_seeds']} tuning seeds, then evaluated "
                f"on {config['momentum']['eval_seeds']} other seeds, paired with uni ((loss - uni)/uni; test accuracy "
                "on held-out images). The paper: expinfl ~ momexpinfl, momexpinfl better only at data scale 25 with "
                "T = 100.",
                _momentum_table(data.get("momentum", [])),
            ],
        ),
    ]
    plots = [
        figure("influence.png", _draw_influence(rows), ncols=len(groups), figsize=(4.5 * len(groups), 3.6)),
        figure("relative_loss.png", _draw_relative(rows), figsize=(6.5, 4.2)),
        figure("fits.png", _draw_fits(rows, config["fits_at"]), ncols=len(groups), figsize=(4.5 * len(groups), 3.4)),
    ]
    return Report("schedules.md", "Dynamic noise schedules: App. D reproduced", intro, sections,
                  {"schedules.json": data}, plots)


def run(out_dir: str | Path, quick: bool = False) -> Path:
    """Run the reproduction into ``out_dir``; returns the path of ``schedules.md``. The influence runs use every core
    and are cached in ``out_dir/cache``; ``quick``: a reduced synthetic setting (seconds, for tests)."""
    out = Path(out_dir)
    config = QUICK if quick else FULL
    start = time.perf_counter()
    data = experiment(
        config,
        workers=1 if quick else os.cpu_count(),
        cache=None if quick else out / "cache",
        log=None if quick else (lambda m: print(m, flush=True)),
    )
    data.update(
        command=f"dptrain reproduce schedules --out {out}" + (" --quick" if quick else ""),
        quick=quick,
        wall_s=time.perf_counter() - start,
        cpu_count=os.cpu_count(),
        date=time.strftime("%Y-%m-%d"),
    )
    return render(data).write(out)
