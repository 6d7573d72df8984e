"""Reproduction of the counter-example of Sun, Suresh & Menon, "The importance of feature preprocessing for
differentially private linear optimization" (Sec. 4, Theorem 3, Lemmas 2 and 8, App. A;
docs/dpsgd_f.md).

``run(out_dir, quick=False)`` writes ``counterexample.md`` (the report), ``counterexample.json`` (every number) and
``counterexample.png`` into ``out_dir``.

The data set D' (d = 2): n/2 copies of x = mu e1 + e2 with y = +1 and n/2 copies of x = mu e1 - e2 with y = -1.
Hinge loss l(z, y) = max{1 - y z, 0} on the score z = w.x + b of a ``torch.nn.Linear(2, 1)`` started at w = 0,
b = 0 (footnote 3: a bias feature gives the same result; w* = (0, 1), b* = 0 has zero loss, so min L = 0 and the
reported gap is L(w, D') itself). Every point has norm R = sqrt(mu^2 + 1), so feature normalization to C_F = R
changes nothing (the hinge loss is not scale invariant: C_F = R keeps the problem the paper's).

Formulas (each cited where it is used):

- Lemma 2: L(w, D') - min L >= E[max{1 - w(2), 0}] >= Pr(w(2) <= 0), for every iterate and the average iterate;
  the same holds with the labels flipped (D''), and both bounds hold with any bias since
  0.5 max{1 - s - w(2), 0} + 0.5 max{1 + s - w(2), 0} >= max{1 - w(2), 0} for s = mu w(1) + b (convexity).
- Lemma 8 (App. A, with Bassily et al.'s noise sigma^2 = 8 T C^2 log(1/delta)/(n^2 eps^2) on the averaged
  gradient, w_0(2) <= 0): Pr(avg w(2) <= 0) >= Pr(N(m, v) <= 0) = Phi(-m/sqrt(v)), m = min{1, C/sqrt(mu^2 + 1)},
  v = 16 (2T + 1) C^2 log(1/delta) / (3 (T + 1) n^2 eps^2) (the printed last display has the inequality
  reversed; the lemma's statement has the right direction).
- The universal floor (derived from Lemma 8): since m < C/mu and (2T + 1)/(T + 1) >= 3/2, for n < mu/eps
  m/sqrt(v) <= n eps/(mu sqrt(8 log(1/delta))) < 1/sqrt(8 log(1/delta)), so Pr(w(2) <= 0) >=
  Phi(-1/sqrt(8 log(1/delta))) = 0.4585 at delta = 1e-5, whatever C, eta and T.
- DPSGD-F's residual offset (derived, not in the paper): ||mu_hat - mu|| ~ sigma_F R sqrt(d)/n for the
  Gaussian mean of Algorithm 3 (and of this library's Algorithm 2, which uses the same Gaussian mean instead of
  Huang et al.'s estimator), so DPSGD-F is DPSGD on a counter-example with mu replaced by that offset.

The methods, all through :func:`dptrain.dpsgd_f.make_private_dpsgd_f` at (eps, delta) = (1, 1e-5) except the
non-private reference: ``dpsgd`` (kind "none": DP-SGD on the raw features, Poisson sampling, PLD-calibrated
noise), ``dpsgd_f`` (kind "private_mean", eps_F = 0.1: Algorithm 3), ``dpsgd_f_theory`` (kind "dpsgd_f_theory":
Algorithm 2 with the paper's quantile tail (100/eps) ln n), ``dpsgd_f_theory_median`` (Algorithm 2 with
quantile_tail = n/2: tau = a private median of the distances; see the report for why) and ``nonprivate``
(:func:`dptrain.engine.make_private` with ``non_private=True``: the same clipped (S)GD without noise, a reference
for what is an optimization limit and what a privacy one).

Hyper-parameters: one grid for every method (normalized learning rate kappa = lr C^2 x clip norm C x schedule);
the best configuration per (method, mu) is chosen by the mean gap over separate tuning seeds, then re-run on the
evaluation seeds (the paper also tunes without accounting for it, footnote 8). Both outputs are reported: the model
``run.raw_model()`` returns (the last iterate) and the average of the iterates w_1..w_T (Algorithm 1's output;
post-processing, free), each with its own selection.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats
from torch import nn

from dptrain.accounting import certified_epsilon, gaussian_mechanism_noise
from dptrain.reproduce import md_table, single_thread
from dptrain.reproduce.report import Report, Section, figure

__all__ = [
    "FULL",
    "METHODS",
    "QUICK",
    "Config",
    "counterexample_data",
    "experiment",
    "hinge_per_example",
    "lemma8_bound",
    "render",
    "run",
    "train_once",
    "universal_floor",
]

REPORT, DATA_JSON, PLOT = "counterexample.md", "counterexample.json", "counterexample.png"
EPSILON, DELTA, EPS_F = 1.0, 1e-5, 0.1

#: name -> (label, make_private_dpsgd_f kind or None for the non-private reference)
METHODS: dict[str, tuple[str, str | None]] = {
    "dpsgd": ("DPSGD", "none"),
    "dpsgd_f": ("DPSGD-F Alg. 3 (eps_F = 0.1)", "private_mean"),
    "dpsgd_f_theory": ("DPSGD-F Alg. 2 (tail (100/eps) ln n)", "dpsgd_f_theory"),
    "dpsgd_f_theory_median": ("DPSGD-F Alg. 2 (tail n/2: median)", "dpsgd_f_theory"),
    "nonprivate": ("clipped GD, no noise (not private)", None),
}
PRIVATE_METHODS = ("dpsgd", "dpsgd_f", "dpsgd_f_theory", "dpsgd_f_theory_median")
#: The non-private reference also tries these larger normalized rates: without noise nothing limits the step, and
#: at mu = 1e6 with C = 1 the clipped signal on w(2) is 1/R per step.
NONPRIVATE_EXTRA_KAPPAS = (1e5, 1e6, 1e7)
#: Algorithm 2 sets the clip norm itself (sqrt(2) G tau), so the grid's clip axis is one point for it.
CLIP_FREE = ("dpsgd_f_theory", "dpsgd_f_theory_median")


@dataclass(frozen=True)
class Config:
    n: int
    mus: tuple[float, ...]
    kappas: tuple[float, ...]  # normalized learning rates: lr = kappa / C^2, C the clip norm in effect
    clips: tuple[
        str, ...
    ]  # "1" (C = 1, the paper's C_G) or "R" (C = R = sqrt(mu^2 + 1): DPSGD clips nothing)
    schedules: tuple[tuple[int, float], ...]  # (epochs, expected batch size as a fraction of n)
    tune_seeds: tuple[int, ...]
    eval_seeds: tuple[int, ...]


FULL = Config(
    n=10_000,
    mus=(1e1, 1e2, 1e3, 1e4, 3e4, 1e5, 1e6),
    kappas=(1e-4, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4),
    clips=("1", "R"),
    schedules=((10, 0.1), (300, 1.0)),
    tune_seeds=(100, 101),
    eval_seeds=(0, 1, 2, 3, 4),
)
QUICK = Config(
    n=10_000,
    mus=(1e1, 1e3, 2e4),
    kappas=(1e-4, 1e-2, 1e-1, 1.0, 10.0, 100.0),
    clips=("1",),
    schedules=((10, 0.1),),
    tune_seeds=(100,),
    eval_seeds=(0, 1, 2),
)


# --- data, loss, bounds ---------------------------------------------------------------------------------------


def counterexample_data(n: int, mu: float) -> tuple[torch.Tensor, torch.Tensor]:
    """D' of Sec. 4: n/2 copies of (mu, 1) with y = +1, n/2 copies of (mu, -1) with y = -1 (y as float)."""
    if n < 2 or n % 2:
        raise ValueError(f"n must be even and >= 2, got {n}")
    x = torch.zeros(n, 2)
    x[:, 0] = mu
    x[: n // 2, 1], x[n // 2 :, 1] = 1.0, -1.0
    y = torch.ones(n)
    y[n // 2 :] = -1.0
    return x, y


def hinge_per_example(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """max{1 - y z, 0} per example, z the score (outputs [B, 1]) and y in {-1, +1} (float targets [B])."""
    return torch.clamp(1 - targets * outputs.squeeze(1), min=0)


@torch.no_grad()
def hinge_gap(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """L(w, D') - min L = L(w, D') (min L = 0), evaluated in float64 on a float64 copy of ``model`` (the returned
    float32 parameters are kept exactly; only the arithmetic is exact enough at mu = 1e6)."""
    m = copy.deepcopy(model).double()
    return float(hinge_per_example(m(x.double()), y.double()).mean())


def universal_floor(delta: float = DELTA) -> float:
    """Phi(-1/sqrt(8 log(1/delta))): the floor of Pr(w(2) <= 0), hence of the gap (Lemma 2), for n < mu/eps,
    derived from Lemma 8 (App. A) with m < C/mu and (2T + 1)/(T + 1) >= 3/2."""
    return float(stats.norm.cdf(-1.0 / math.sqrt(8 * math.log(1 / delta))))


def lemma8_bound(
    mu: float, n: int, clip: float, steps: int, epsilon: float = EPSILON, delta: float = DELTA
) -> float:
    """Lemma 8 (App. A): Pr(avg w(2) <= 0) >= Phi(-m/sqrt(v)), m = min{1, C/sqrt(mu^2 + 1)},
    v = 16 (2T + 1) C^2 log(1/delta)/(3 (T + 1) n^2 eps^2) (Bassily et al.'s noise, w_0(2) <= 0)."""
    m = min(1.0, clip / math.sqrt(mu * mu + 1))
    v = 16 * (2 * steps + 1) * clip**2 * math.log(1 / delta) / (3 * (steps + 1) * n * n * epsilon**2)
    return float(stats.norm.cdf(-m / math.sqrt(v)))


# --- one run ------------------------------------------------------------------------------------------------------


def _zero_linear() -> nn.Linear:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    return model


def train_once(
    method: str,
    n: int,
    mu: float,
    kappa: float,
    clip: str,
    epochs: int,
    batch_frac: float,
    seed: int,
    certify=None,
) -> dict[str, Any]:
    """One training run; returns the gaps of the last and of the average iterate (on the raw features) and what
    the preprocessing released. The SGD learning rate is kappa / C^2 with C the clip norm in effect: the grid's C
    for DPSGD and Alg. 3, sqrt(2) tau for Alg. 2 (tau is released, so the rate is post-processing)."""
    from dptrain.dpsgd_f import make_private_dpsgd_f
    from dptrain.engine import make_private

    x, y = counterexample_data(n, mu)
    r = math.sqrt(mu * mu + 1)
    c = 1.0 if clip == "1" else r
    batch = batch_frac * n
    model = _zero_linear()

    def sgd(params, clip_norm: float) -> torch.optim.Optimizer:  # lr = kappa / C^2, C the clip norm in effect
        return torch.optim.SGD(params, lr=kappa / clip_norm**2)

    torch.manual_seed(seed)
    out: dict[str, Any] = {"seed": seed}
    if method == "nonprivate":
        trainer = make_private(
            model,
            sgd(model.parameters(), c),
            (x, y),
            noise_multiplier=0.0,
            non_private=True,
            max_grad_norm=c,
            batch_size=batch,
            loss_fn=hinge_per_example,
            seed=seed,
        )
        to_raw = lambda m: m  # noqa: E731  (raw features already; normalization to R is the identity)
        prep = None
    else:
        kind = METHODS[method][1]
        options: dict[str, Any] = {}
        if method == "dpsgd_f":
            options["eps_f"] = EPS_F
        if method == "dpsgd_f_theory_median":
            options["quantile_tail"] = n // 2
        run = make_private_dpsgd_f(
            model,
            sgd,
            (x, y),
            target_epsilon=EPSILON,
            target_delta=DELTA,
            feature_norm=r,
            kind=kind,
            epochs=epochs,
            batch_size=batch,
            max_grad_norm=c,
            loss_fn=hinge_per_example,
            lipschitz=1.0,  # the hinge loss is 1-Lipschitz in the score (Alg. 2's clip norm sqrt(2) G tau)
            seed=seed,
            **options,
        )
        trainer, prep = run.trainer, run.preprocessing
        to_raw = prep.raw_model
    out["lr"] = trainer.optimizer.param_groups[0]["lr"]
    trained = trainer.model
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in trained.state_dict().items()}
    count = 0

    def accumulate(_result) -> None:
        nonlocal count
        for k, v in trained.state_dict().items():
            total[k] += v.double()
        count += 1

    try:
        trainer.train(epochs=epochs, callback=accumulate)
    finally:
        trainer.close()
    average = copy.deepcopy(trained)
    average.load_state_dict({k: (v / max(count, 1)).float() for k, v in total.items()})
    last_raw, avg_raw = to_raw(trained), to_raw(average)
    out["gap_last"] = hinge_gap(last_raw, x, y)
    out["gap_avg"] = hinge_gap(avg_raw, x, y)
    w_last, w_avg = _raw_weight(last_raw), _raw_weight(avg_raw)
    out["w2_last"], out["w2_avg"] = w_last[1], w_avg[1]
    out["steps"] = trainer.steps
    out["noise_multiplier"] = trainer.noise_multiplier
    out["clip_norm"] = float(trainer.clipping.sensitivity)
    if prep is not None:
        if certify is not None:
            out["epsilon"] = float(certify(trainer.ledger, DELTA, trainer.accountant).epsilon)
        if prep.mean is not None:
            out["mean_error"] = float(
                (prep.mean.double() - torch.tensor([mu, 0.0], dtype=torch.float64)).norm()
            )
        if prep.tau is not None:
            out["tau"] = float(prep.tau)
    return out


def _raw_weight(model: nn.Module) -> list[float]:
    layer = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return [float(v) for v in layer.weight.detach().reshape(-1)]


# --- the experiment ----------------------------------------------------------------------------------------------


def _grid(config: Config, method: str) -> list[dict[str, Any]]:
    clips = ("1",) if method in CLIP_FREE else config.clips
    kappas = config.kappas + (NONPRIVATE_EXTRA_KAPPAS if method == "nonprivate" else ())
    return [
        {"kappa": k, "clip": c, "epochs": e, "batch_frac": b}
        for (e, b) in config.schedules
        for c in clips
        for k in kappas
    ]


def _summary(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    v = np.array([r[key] for r in runs], dtype=np.float64)
    return {
        "values": v.tolist(),
        "mean": float(v.mean()),
        "median": float(np.median(v)),
        "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
    }


def experiment(config: Config, log=None) -> dict[str, Any]:
    """For every mu and method: the grid on the tuning seeds, the best configuration for the last and for the
    average iterate (smallest mean gap), each re-run on the evaluation seeds."""
    results: dict[str, Any] = {"config": asdict(config), "cells": []}
    certify = certified_epsilon  # memoized by ledger content inside dptrain.accounting
    for mu in config.mus:
        for method in METHODS:
            t0 = time.perf_counter()
            tune_seeds = config.tune_seeds[:1] if method == "nonprivate" else config.tune_seeds
            grid = []
            for cfg in _grid(config, method):
                runs = [train_once(method, config.n, mu, seed=s, certify=certify, **cfg) for s in tune_seeds]
                grid.append(
                    {
                        **cfg,
                        "gap_last": float(np.mean([r["gap_last"] for r in runs])),
                        "gap_avg": float(np.mean([r["gap_avg"] for r in runs])),
                    }
                )
            cell: dict[str, Any] = {"mu": mu, "method": method, "grid": grid}
            evaluated: dict[tuple, list[dict[str, Any]]] = {}
            for output in ("last", "avg"):
                best = min(grid, key=lambda g, o=output: g[f"gap_{o}"])  # first (smallest kappa) on ties
                cfg = {k: best[k] for k in ("kappa", "clip", "epochs", "batch_frac")}
                key = tuple(cfg.values())
                if key not in evaluated:
                    evaluated[key] = [
                        train_once(method, config.n, mu, seed=s, certify=certify, **cfg)
                        for s in config.eval_seeds
                    ]
                runs = evaluated[key]
                gap = _summary(runs, f"gap_{output}")
                w2 = np.array([r[f"w2_{output}"] for r in runs])
                entry = {
                    "selected": cfg,
                    "tune_gap": best[f"gap_{output}"],
                    "gap": gap,
                    "w2": w2.tolist(),
                    "pr_w2_nonpositive": float(np.mean(w2 <= 0)),
                    "steps": runs[0]["steps"],
                    "noise_multiplier": runs[0]["noise_multiplier"],
                    "clip_norm": runs[0]["clip_norm"],
                    "lr": _summary(runs, "lr"),
                    "epsilon": runs[0].get("epsilon"),
                }
                for extra in ("tau", "mean_error"):
                    if extra in runs[0]:
                        entry[extra] = _summary(runs, extra)
                if method == "dpsgd":
                    entry["lemma8_bound"] = lemma8_bound(mu, config.n, runs[0]["clip_norm"], runs[0]["steps"])
                cell[output] = entry
            cell["seconds"] = time.perf_counter() - t0
            results["cells"].append(cell)
            if log is not None:
                log(
                    f"mu={mu:g} {method}: last {cell['last']['gap']['mean']:.3g}, avg {cell['avg']['gap']['mean']:.3g}"
                    f" ({cell['seconds']:.1f} s)"
                )
    return results


def _cell(results: dict[str, Any], mu: float, method: str) -> dict[str, Any]:
    return next(c for c in results["cells"] if c["mu"] == mu and c["method"] == method)


# --- report ------------------------------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 1e3 or abs(x) < 1e-3:
        return f"{x:.2e}"
    return f"{x:.3f}"


def _mus(results: dict[str, Any]) -> list[float]:
    return list(results["config"]["mus"])


def _big(results: dict[str, Any], mu: float) -> bool:
    """n < mu/eps: the regime of Theorem 3."""
    return results["config"]["n"] < mu / EPSILON


def _gap_table(results: dict[str, Any], output: str) -> str:
    floor = universal_floor()
    head = ["mu", "n < mu/eps"] + [METHODS[m][0] for m in METHODS] + ["floor (n < mu/eps)", "Lemma 8 (DPSGD)"]
    rows = []
    for mu in _mus(results):
        row = [f"{mu:g}", "yes" if _big(results, mu) else "no"]
        for m in METHODS:
            g = _cell(results, mu, m)[output]["gap"]
            row.append(f"{_fmt(g['mean'])} +- {_fmt(g['std'])} ({_fmt(g['median'])})")
        d = _cell(results, mu, "dpsgd")[output]
        row.append(f"{floor:.4f}" if _big(results, mu) else "-")
        row.append(f"{d['lemma8_bound']:.4f}")
        rows.append(row)
    return md_table(head, rows)


def _selected_table(results: dict[str, Any], output: str) -> str:
    rows = []
    for mu in _mus(results):
        for m in METHODS:
            e = _cell(results, mu, m)[output]
            s = e["selected"]
            extra = []
            if "mean_error" in e:
                extra.append(f"mean error {_fmt(e['mean_error']['mean'])}")
            if "tau" in e:
                extra.append(f"tau {_fmt(e['tau']['mean'])}")
            rows.append(
                [
                    f"{mu:g}",
                    m,
                    f"{s['kappa']:g}",
                    _fmt(e["lr"]["median"]),
                    "R"
                    if s["clip"] == "R" and m not in CLIP_FREE
                    else "1"
                    if m not in CLIP_FREE
                    else "sqrt(2) tau",
                    f"{e['clip_norm']:.4g}" if m not in CLIP_FREE else "-",
                    f"{s['epochs']} ep, q = {s['batch_frac']:g}",
                    e["steps"],
                    f"{e['noise_multiplier']:.3f}",
                    "-" if e["epsilon"] is None else f"{e['epsilon']:.4f}",
                    f"{e['pr_w2_nonpositive']:.1f}",
                    f"{_fmt(e['gap']['mean'])} (tuning: {_fmt(e['tune_gap'])})",
                    "; ".join(extra) or "-",
                ]
            )
    return md_table(
        [
            "mu",
            "method",
            "kappa",
            "lr (median)",
            "clip",
            "C",
            "schedule",
            "T",
            "noise mult.",
            "eps (certified)",
            "frac. w(2) <= 0",
            "gap (eval seeds)",
            "released (mean over eval seeds)",
        ],
        rows,
    )


def _mus_where(results: dict[str, Any], method: str, output: str, test) -> str:
    got = [f"{mu:g}" for mu in _mus(results) if test(_cell(results, mu, method)[output]["gap"]["mean"])]
    return "{" + ", ".join(got) + "}" if got else "no mu"


def _observations(results: dict[str, Any]) -> list[str]:
    n = results["config"]["n"]
    floor = universal_floor()
    mus = _mus(results)
    big = [mu for mu in mus if _big(results, mu)]
    obs = []
    for output, name in (("last", "Returned model (last iterate)"), ("avg", "Average iterate")):
        text = (
            f"**{name}.** DPSGD's mean gap is >= the floor {floor:.4f} at mu in "
            f"{_mus_where(results, 'dpsgd', output, lambda v: v >= floor)} and < 0.1 at mu in "
            f"{_mus_where(results, 'dpsgd', output, lambda v: v < 0.1)}. Mean gap < 0.1: "
            + "; ".join(
                f"{METHODS[m][0]} at mu in {_mus_where(results, m, output, lambda v: v < 0.1)}"
                for m in ("dpsgd_f", "dpsgd_f_theory_median", "dpsgd_f_theory")
            )
            + "."
        )
        if big:
            pairs = []
            for mu in big:
                d = _cell(results, mu, "dpsgd")[output]["gap"]["mean"]
                best = min(
                    PRIVATE_METHODS[1:], key=lambda m, mu=mu: _cell(results, mu, m)[output]["gap"]["mean"]
                )
                pairs.append(
                    f"mu = {mu:g}: DPSGD {_fmt(d)} vs {METHODS[best][0]} "
                    f"{_fmt(_cell(results, mu, best)[output]['gap']['mean'])}"
                )
            text += f" Where n < mu/eps (Theorem 3's regime, n = {n:,}): " + "; ".join(pairs) + "."
        obs.append(text)
    if big:
        dp = {mu: _cell(results, mu, "dpsgd") for mu in big}
        lo = {o: min(c[o]["gap"]["mean"] for c in dp.values()) for o in ("last", "avg")}
        fracs = [c["avg"]["pr_w2_nonpositive"] for c in dp.values()]
        frac = ", ".join(f"{mu:g}: {f:.1f}" for mu, f in zip(big, fracs, strict=True))
        worse = any(c["last"]["gap"]["mean"] > c["avg"]["gap"]["mean"] + 0.1 for c in dp.values())
        obs.append(
            f"**DPSGD where n < mu/eps.** Its smallest mean gap there is {_fmt(lo['avg'])} (average iterate) and "
            f"{_fmt(lo['last'])} (last iterate), "
            + ("above" if min(lo.values()) >= floor else "NOT above")
            + f" the floor {floor:.4f}. A gap of 1 is what w = 0 scores: at the selected rates DPSGD barely moves. "
            + (
                "The last iterate, selected on the tuning seeds, is worse on the evaluation seeds at some mu (the "
                "winner's curse of selecting on few seeds). "
                if worse
                else ""
            )
            + "With C = R and lr = kappa/R^2 the DPSGD runs are the same up to scale for every mu (same seeds), "
            "hence identical gaps across mu where that configuration wins. Lemma 2's Pr(w(2) <= 0) for the "
            f"average iterate (fraction of evaluation seeds, per mu: {frac}) is "
            + ("below" if all(f < floor for f in fracs) else "not below")
            + f" Lemma 8's {floor:.4f}, which assumes Bassily et al.'s (larger) noise; the bound it implies for the "
            "gap (Lemma 2) is respected by the gaps themselves."
        )
    np_ok = _mus_where(results, "nonprivate", "last", lambda v: v < 1e-3)
    obs.append(
        f"The non-private reference (same grid, clipping and steps, no noise) reaches gap < 1e-3 at mu in {np_ok}: "
        "where it does and a private method does not, the noise, not the step budget, is what fails the private "
        "method."
    )
    first_fail = next(
        (
            mu
            for mu in mus
            if _cell(results, mu, "dpsgd")["avg"]["gap"]["mean"] >= floor
            and _cell(results, mu, "nonprivate")["avg"]["gap"]["mean"] < 1e-3
        ),
        None,
    )
    offsets = {
        "dpsgd": [(mu, mu) for mu in mus],
        "dpsgd_f": [(mu, _cell(results, mu, "dpsgd_f")["avg"]["mean_error"]["mean"]) for mu in mus],
        "dpsgd_f_theory_median": [
            (mu, _cell(results, mu, "dpsgd_f_theory_median")["avg"]["mean_error"]["mean"]) for mu in mus
        ],
    }
    lines, fail_from = [], []
    for m, pairs in offsets.items():
        gaps = [_cell(results, mu, m)["avg"]["gap"]["mean"] for mu, _ in pairs]
        ok = [o for (_, o), g in zip(pairs, gaps, strict=True) if g < 0.1]
        bad = [o for (_, o), g in zip(pairs, gaps, strict=True) if g >= floor]
        if bad:
            fail_from.append(min(bad))
        lines.append(
            f"{METHODS[m][0]}: gap < 0.1 up to offset {_fmt(max(ok)) if ok else '-'}, gap >= {floor:.4f} from "
            f"offset {_fmt(min(bad)) if bad else '-'}"
        )
    far_below = bool(fail_from) and max(fail_from) < n * EPSILON / 10
    obs.append(
        "**The offset decides.** Take each method's offset: mu for DPSGD, the mean error ||mu_hat - mu|| left "
        "after centering for DPSGD-F (average iterate, mean over seeds): "
        + "; ".join(lines)
        + ". DPSGD-F behaves like DPSGD on a counter-example with mu replaced by its offset (the paper's Sec. 4, last paragraph)"
        + (
            f"; the offsets from which these runs fail, at most {_fmt(max(fail_from))}, are far below n eps = "
            f"{n * EPSILON:g}, where Theorem 3's condition n < mu/eps and a back-of-envelope estimate put the "
            "threshold. Theorem 3 is only a lower bound"
            + (
                f": DPSGD already fails at mu = {first_fail:g} on this grid while the non-private reference does not"
                if first_fail is not None
                else ""
            )
            if far_below
            else ""
        )
        + ". [Interpretation, not measured separately: the noise on the weight that carries the offset moves the "
        "score by offset times as much, and the hinge loss charges that shift beyond the margin, so the excess "
        "grows roughly like offset^2/(n eps) for the iterates we return, rather than offset/(n eps).]"
    )
    th = [_cell(results, mu, "dpsgd_f_theory")["last"] for mu in mus]
    ratios = ", ".join(
        f"{mu:g}: {e['tau']['mean'] / math.sqrt(mu * mu + 1):.2f}" for mu, e in zip(mus, th, strict=True)
    )
    tail = math.ceil(100 / EPSILON * math.log(n))
    obs.append(
        "**Algorithm 2 with the paper's quantile tail**: tau/R per mu: "
        f"{ratios}. On D' the distances ||x_i - mu_hat|| take two values (half of the points each), so "
        "#{i : d_i <= t} jumps 0 -> n/2 -> n and never equals the target rank r = n - (100/eps) ln n = "
        f"n - {tail}. Without dptrain's tie-breaking jitter (U[0, 2 C_F / n) added to every distance, "
        "docs/dpsgd_f.md) the utility -|count - r| would be best on all of [max_i d_i, 2 C_F], almost all of the "
        "~n^2 grid points, and tau would land anywhere there (an earlier run of this reproduction, before the "
        "jitter, measured tau/R = 0.91 at every mu, breaking Lemma 4's E[tau | mu_hat] <= 2 max_i ||x_i - mu_hat|| "
        "+ 2R/n^2); with it tau lands just above max_i d_i, as Lemma 4 needs. "
        "With "
        "quantile_tail = n/2 the target rank n/2 is attained on [d_(n/2), d_(n/2+1)) and tau lands there "
        "(mean tau per mu: "
        + ", ".join(
            f"{mu:g}: {_fmt(_cell(results, mu, 'dpsgd_f_theory_median')['last']['tau']['mean'])}"
            for mu in mus
        )
        + "); about half of the rows are then clipped slightly (Alg. 2 step 3)."
    )
    sigma_f = results["sigma_f"]
    errs = ", ".join(
        f"{mu:g}: {_fmt(_cell(results, mu, 'dpsgd_f')['last']['mean_error']['mean'])} "
        f"(~{_fmt(sigma_f * math.sqrt(mu * mu + 1) * math.sqrt(math.pi / 2) / n)})"
        for mu in mus
    )
    obs.append(
        "**The private mean's error grows with R.** ||mu_hat - mu|| of Alg. 3 (mean over seeds; in brackets "
        f"sigma_F R sqrt(pi/2)/n, the mean norm of its 2-d Gaussian error): {errs}. After centering, DPSGD-F faces "
        "the same counter-example with mu replaced by this offset (Sec. 4, last paragraph), so it fails too once the "
        "offset is large enough. Huang et al.'s estimator (the paper's Algorithm 2) has an error that scales with "
        "the diameter, not R; both DPSGD-F variants here use the Gaussian mean instead."
    )
    return obs


def _draw(results: dict[str, Any]):
    mus, n = _mus(results), results["config"]["n"]

    def draw(fig, axes) -> None:
        styles = {
            "dpsgd": ("C3", "o"),
            "dpsgd_f": ("C0", "s"),
            "dpsgd_f_theory": ("C1", "v"),
            "dpsgd_f_theory_median": ("C2", "^"),
            "nonprivate": ("0.5", "x"),
        }
        for ax, output, title in (
            (axes[0], "last", "returned model (last iterate)"),
            (axes[1], "avg", "average iterate (Algorithm 1's output)"),
        ):
            for m, (label, _) in METHODS.items():
                mean = [_cell(results, mu, m)[output]["gap"]["mean"] for mu in mus]
                std = [_cell(results, mu, m)[output]["gap"]["std"] for mu in mus]
                color, marker = styles[m]
                ax.errorbar(
                    mus,
                    mean,
                    yerr=std,
                    label=label,
                    color=color,
                    marker=marker,
                    capsize=3,
                    linestyle=":" if m == "nonprivate" else "-",
                )
            ax.axhline(
                universal_floor(), color="k", linestyle="--", linewidth=1, label="floor 0.4585 (n < mu/eps)"
            )
            ax.axvline(n * EPSILON, color="k", linestyle=":", linewidth=1, label="mu = n eps")
            ax.set_xscale("log")
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_ylim(bottom=0)
            ax.set_yticks([0, 0.25, 0.5, 0.75, 1, 2, 5, 10])
            ax.set_yticklabels(["0", "0.25", "0.5", "0.75", "1", "2", "5", "10"])
            ax.set_xlabel("mu")
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("gap L(w, D') - min L (linear below 1, log above)")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
        fig.suptitle(
            f"Sec. 4 counter-example: n = {n:,}, eps = {EPSILON:g}, delta = {DELTA:g}; mean +- std over "
            f"{len(results['config']['eval_seeds'])} seeds",
            fontsize=11,
        )
        fig.tight_layout(rect=(0, 0.1, 1, 1))

    return draw


def render(results: dict[str, Any]) -> Report:
    """The report of ``results`` (what :func:`run` writes to ``counterexample.json``; loaded back from it gives the
    same report)."""
    config = results["config"]
    n = config["n"]
    floor = universal_floor()
    kappas = ", ".join(f"{v:g}" for v in config["kappas"])
    clips = ", ".join("1" if c == "1" else "R = sqrt(mu^2 + 1)" for c in config["clips"])
    schedules = "; ".join(
        f"{e} epochs at expected batch {b:g} n (T = {round(e / b)} steps, "
        + ("Poisson sampling" if b < 1 else "q = 1: every example in every step")
        + ")"
        for e, b in config["schedules"]
    )
    mode = "QUICK mode (reduced grid and seeds; not the reported results)" if results["quick"] else "full run"
    what_was_run = [
        f"Data D' (d = 2): n/2 = {n // 2:,} copies of x = mu e1 + e2 with y = +1 and {n // 2:,} copies of mu e1 - e2 "
        "with y = -1; hinge loss max{1 - y z, 0} on the score z of `torch.nn.Linear(2, 1)` (bias allowed: footnote "
        "3) started at w = 0, b = 0; min_w L(w, D') = 0 (w* = (0, 1)), so the gap is L(w, D'), evaluated in float64 "
        "on the raw features. Feature normalization to C_F = R = sqrt(mu^2 + 1), the norm of every point (so it "
        f"changes nothing). (eps, delta) = ({EPSILON:g}, {DELTA:g}) for the whole pipeline of every private method.",
        '- **DPSGD**: `make_private_dpsgd_f(kind="none")`: DP-SGD on the raw features, noise calibrated by the PLD '
        "accountant;\n"
        f"- **DPSGD-F Alg. 3**: `kind='private_mean'`, eps_F = {EPS_F:g} (sigma_F = {results['sigma_f']:.2f}): Gaussian mean, "
        "centering, DP-SGD with the noise calibrated so that the PLD composition of the mean and the steps is "
        "(1, 1e-5), bias mapped back (`run.raw_model()`);\n"
        '- **DPSGD-F Alg. 2**: `kind="dpsgd_f_theory"`, `lipschitz=1` (hinge): thirds of the budget by basic '
        "composition; Gaussian mean (not Huang et al.'s estimator); exponential-mechanism quantile tau; features "
        "(x - mu_hat, tau) clipped to sqrt(2) tau; DP-SGD without bias and with clip norm sqrt(2) G tau (so the "
        "grid's C does not apply). Once with the paper's quantile tail (100/eps) ln n = "
        f"{math.ceil(100 / EPSILON * math.log(n))} and once with `quantile_tail = n/2` (tau = a private median; "
        "why: observations);\n"
        "- **non-private reference**: `dptrain.engine.make_private(noise_multiplier=0, non_private=True)`: the same clipped (S)GD "
        "without noise, not private (tuned on the first tuning seed only, with kappa also in "
        f"{{{', '.join(f'{k:g}' for k in NONPRIVATE_EXTRA_KAPPAS)}}}: without noise nothing limits the step).",
        f"Grid, the same for every method: normalized learning rate kappa in {{{kappas}}} (plain SGD with lr = "
        "kappa / C^2, C the clip norm in effect: the grid's C, or Alg. 2's released sqrt(2) tau, so the rate follows "
        f"each seed's tau) x clip norm C in {{{clips}}} x schedule in {{{schedules}}}. The best configuration per "
        f"(method, mu) is the smallest mean gap over the tuning seeds {list(config['tune_seeds'])}, chosen "
        "separately for the last and the average iterate, then re-run on the evaluation seeds "
        f"{list(config['eval_seeds'])}: the tables give mean +- std (ddof 1) (median) over those. Why C in {{1, R}}: "
        "with C = R DPSGD clips nothing (and lr = kappa/R^2 makes its steps scale-free in mu), with C = 1 it clips "
        "every active gradient by the same factor; Theorem 3 says no C, T or eta helps once n < mu/eps.",
    ]
    bounds = (
        f"**floor** = Phi(-1/sqrt(8 log(1/delta))) = {floor:.4f}: the paper's lower bound on Pr(avg w(2) <= 0), "
        "hence on the gap (Lemma 2), for any DPSGD when n < mu/eps (Theorem 3, App. A). **Lemma 8 (DPSGD)** = "
        "Phi(-m/sqrt(v)) with m = min{1, C/sqrt(mu^2 + 1)} and v = 16 (2T + 1) C^2 log(1/delta)/(3 (T + 1) n^2 "
        "eps^2) for the selected DPSGD configuration (its C and T). Both assume Bassily et al.'s calibration "
        "sigma^2 = 8 T C^2 log(1/delta)/(n^2 eps^2) on the averaged gradient and the average iterate; our DP-SGD "
        "adds PLD-calibrated noise (smaller for the same (eps, delta)) on Poisson (or q = 1) batches and the first "
        "table is the last iterate, so these bounds are indicative, not theorems about these runs."
    )
    return Report(
        REPORT,
        "Counter-example for DPSGD and the DPSGD-F fix (Sun, Suresh & Menon, Sec. 4 / App. A): reproduction",
        intro=[
            f"Produced by `{results['command']}` ({mode}). Wall time {results['wall_s']:.0f} s. All numbers (the "
            f"whole tuning grid included) are in `{DATA_JSON}`; the plot is `{PLOT}`."
        ],
        sections=[
            Section("What was run", what_was_run),
            Section(
                "Gap of the returned model (`run.raw_model()`: the last iterate)",
                [_gap_table(results, "last")],
            ),
            Section(
                "Gap of the average iterate w_1..w_T (Algorithm 1's output; post-processing of the same runs)",
                [_gap_table(results, "avg"), bounds],
            ),
            Section(
                "Observations", ["\n".join(f"{i}. {o}" for i, o in enumerate(_observations(results), 1))]
            ),
            Section("Selected configurations (last iterate)", [_selected_table(results, "last")]),
            Section("Selected configurations (average iterate)", [_selected_table(results, "avg")]),
        ],
        data={DATA_JSON: results},
        plots=[figure(PLOT, _draw(results), figsize=(12, 5.4), ncols=2, sharey=True)],
    )


def run(out_dir: str | Path, quick: bool = False) -> Path:
    """Run the reproduction into ``out_dir`` (created if needed); returns the path of ``counterexample.md``.
    ``quick``: 3 values of mu, a 6-point learning-rate grid with C = 1 and one schedule, 1 tuning seed and 3
    evaluation seeds (about 20 s)."""
    command = f"dptrain reproduce dpsgd-f-counterexample --out {Path(out_dir)}" + (
        " --quick" if quick else ""
    )
    start = time.perf_counter()
    with single_thread():  # a 3-parameter model
        results = experiment(QUICK if quick else FULL)
    results.update(
        command=command,
        quick=quick,
        wall_s=time.perf_counter() - start,
        epsilon=EPSILON,
        delta=DELTA,
        eps_f=EPS_F,
        sigma_f=gaussian_mechanism_noise(EPS_F, DELTA),
        floor=universal_floor(),
    )
    return render(results).write(out_dir)
