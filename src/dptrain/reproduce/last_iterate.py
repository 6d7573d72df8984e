"""Reproduction of Altschuler & Talwar, "Privacy of Noisy Stochastic Gradient Descent: More Iterations without More
Privacy Loss" (NeurIPS 2022); dptrain's reading of the paper and its corrections are in docs/last_iterate.md.

``run(out_dir, quick=False)`` writes ``last_iterate.md`` (the report), ``last_iterate.json`` (every number) and
PNG plots into ``out_dir``. The experiments below return plain data; :func:`render` turns that data (or the JSON
read back) into the report. Sections:

(a) Epsilon against the number of steps T for Example A of docs/last_iterate.md (alpha = 8, L = D = 1,
    eta = 0.1, n = 1000, b = 10, sigma = 4, replace adjacency, random batches, M = 1), its full-batch variant
    (b = n, App. B.1) and a strongly convex variant (m = 0.1, App. B.3): the last-iterate RDP bound of
    ``rdp_bound`` against the composition bound that charges every step, and the (eps, delta = 1e-5) values of
    ``last_iterate_report`` (RDP -> DP by Lemma 2.5). The paper prints no numeric table (its Figures 1 and 2 are
    illustrations); the reference values checked are (B.2) and (B.3) evaluated with S_alpha by quadrature at
    T = 1000 and on the plateau, and the closed form of (B.1)'s plateau, 4 alpha L D~/(n eta sigma^2).
(b) Regularized logistic regression (projected noisy SGD, ``dptrain.last_iterate``) on a Fashion-MNIST binary
    task at the fixed budget (eps = 1, delta = 1e-5), with sigma calibrated by composition (dp_accounting's RDP)
    and by the last-iterate accountant, for T from 1 to 100 epochs; test accuracy of the final iterate only.
(c) A soundness check of the direction of S_alpha (Def 2.10) that the paper's bound uses, with an explicit
    neighbouring pair, and the "conservative" variant of (B.2)/(B.3) used as a third certification in (b).

Formulas (each cited where it is used):
- (B.2): eps(alpha) <= min{T S_alpha(b/n, b sigma/Delta), min_{sigma1^2 + sigma2^2 = sigma^2} min_Tt
  Tt S_alpha(b/n, b sigma2/Delta) + alpha D^2/(2 eta^2 sigma1^2 Tt)} (App. B.2; (3.6) with Tt = T - tau);
- (B.3): the strongly convex form, PABI term alpha D^2 (1 - c^2)/(2 eta^2 sigma1^2 (c^(-2 Tt) - 1)) with
  c = max(|1 - eta m|, |1 - eta M|) (Lemma 5.5; footnote 15 shifts);
- (B.1): alpha/(2 eta^2 sigma^2) min{T (Delta eta/n)^2, min_Tt Tt (D~/Tt + Delta eta/n)^2}, D~ = D + Delta eta/n;
- Lemma 2.5: eps_DP = eps_RDP(alpha) + log(1/delta)/(alpha - 1), minimized over orders;
- Def 2.10: S_alpha(q, s) = D_alpha(N(0, s^2) || (1 - q) N(0, s^2) + q N(1, s^2)).
Delta = 2L (replace adjacency, Sec 1.2).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from dptrain.accounting import calibrate_noise, epsilon
from dptrain.accounting.last_iterate import (
    Setting,
    last_iterate_report,
    neighboring_for,
    rdp_bound,
    s_alpha,
    sampled_gaussian_rdp,
    step_event,
    step_facts,
)
from dptrain.accounting.ledger import Ledger
from dptrain.reproduce import fashion_mnist, single_thread
from dptrain.reproduce import last_iterate_text as text
from dptrain.reproduce.last_iterate_setup import (
    ALPHA,
    CERTIFICATIONS,
    CLASS_NAMES,
    DELTA,
    FULL,
    NEGATIVE_CLASS,
    POSITIVE_CLASS,
    QUICK,
    REF_RDP_PLATEAU,
    REF_RDP_T1000,
    REF_SC_PLATEAU,
    REFERENCE,
    SETTING_LABELS,
    STRONG_CONVEXITY,
    TRAINING,
    Scale,
)
from dptrain.reproduce.report import Report, Section, figure

__all__ = [
    "FULL",
    "QUICK",
    "REFERENCE",
    "Scale",
    "constants",
    "curves",
    "paper_bound_rdp",
    "render",
    "run",
    "single_step_counterexample",
    "training_experiment",
]

REPORT, DATA_JSON = "last_iterate.md", "last_iterate.json"
def _sig4(x: float) -> float:
    return float(f"{x:.4g}")


# --- (a) epsilon against T ----------------------------------------------------------------------------------


def settings(steps: int) -> dict[str, Setting]:
    """The three runs of section (a) at T = ``steps``: Example A, its full-batch variant (b = n, batching
    "full") and its strongly convex variant (m = 0.1, M = 1, eta = 0.1: c = 0.99, Lemma 5.5)."""
    ref = Setting(steps=steps, batching="random", paper_direction=True, **REFERENCE)  # the paper's numbers
    return {
        "reference": ref,
        "full_batch": dataclasses.replace(ref, b=ref.n, batching="full"),
        "strongly_convex": dataclasses.replace(ref, strong_convexity=STRONG_CONVEXITY),
    }


def full_batch_b1_plateau(st: Setting, alpha: float) -> dict[str, float]:
    """(B.1)'s second term for T -> infinity, evaluated directly (independently of ``rdp_bound``):
    alpha/(2 eta^2 sigma^2) min_Tt Tt (D~/Tt + a)^2 with a = Delta eta/n and D~ = D + a, whose real minimizer is
    Tt = D~/a (App. B.1), and its value there, the closed form 4 alpha L D~/(n eta sigma^2) (replace adjacency:
    Delta = 2L)."""
    eta, n, sigma = st.learning_rate, st.n, st.noise_std
    a = st.delta_sens * eta / n
    d_tilde = st.diameter + a
    star = d_tilde / a
    scale = alpha / (2 * eta * eta * sigma * sigma)
    value = min(scale * w * (d_tilde / w + a) ** 2 for w in {max(1, math.floor(star)), math.ceil(star)})
    closed = 4 * alpha * st.lipschitz * d_tilde / (n * eta * sigma * sigma)
    return {"b1_plateau": value, "closed_form": closed, "d_tilde": d_tilde, "window": star}


def curves(grid: list[int] | tuple[int, ...]) -> dict[str, Any]:
    """Section (a): for every T of ``grid`` and each setting, ``rdp_bound(setting, 8)`` (the last-iterate bound
    and ``.composition``) and ``last_iterate_report(setting, 1e-5)`` (eps and eps_composition)."""
    grid = list(grid)
    out: dict[str, Any] = {"T": grid, "alpha": ALPHA, "delta": DELTA, "settings": {}}
    for name in SETTING_LABELS:
        rows = []
        for t in grid:
            st = settings(t)[name]
            bd = rdp_bound(st, ALPHA)
            rep = last_iterate_report(st, DELTA)
            rows.append(
                {
                    "T": t,
                    "rdp": bd.rdp,
                    "rdp_composition": bd.composition,
                    "window": bd.window,
                    "noise_split": bd.noise_split,
                    "plateau": bd.plateau,
                    "plateau_window": bd.plateau_window,
                    "epsilon": rep["epsilon"],
                    "epsilon_composition": rep["epsilon_composition"],
                    "order": rep["order"],
                    "burn_in_steps": rep["burn_in_steps"],
                }
            )
        rdp = [r["rdp"] for r in rows]
        eps = [r["epsilon"] for r in rows]
        out["settings"][name] = {
            "label": SETTING_LABELS[name],
            "rows": rows,
            "plateau_rdp": rows[-1]["plateau"],
            "plateau_window": rows[-1]["plateau_window"],
            "burn_in_steps": rows[-1]["burn_in_steps"],
            "contraction": settings(1)[name].contraction,
            "below_composition": all(r["rdp"] <= r["rdp_composition"] * (1 + 1e-12) for r in rows)
            and all(r["epsilon"] <= r["epsilon_composition"] * (1 + 1e-12) for r in rows),
            "non_decreasing": all(b >= a * (1 - 1e-9) for a, b in zip(rdp, rdp[1:], strict=False))
            and all(b >= a * (1 - 1e-9) for a, b in zip(eps, eps[1:], strict=False)),
        }
    conv = out["settings"]["reference"]["rows"]
    sc = out["settings"]["strongly_convex"]["rows"]
    out["strongly_convex_below_convex"] = all(
        s["rdp"] <= c["rdp"] * (1 + 1e-12) and s["epsilon"] <= c["epsilon"] * (1 + 1e-12)
        for s, c in zip(sc, conv, strict=True)
    )
    out["full_batch_b1"] = full_batch_b1_plateau(settings(1)["full_batch"], ALPHA)
    out["rederivation"] = rederivation(grid)
    out["checks"] = reference_checks(out)
    return out


def rederivation(grid: list[int]) -> list[dict[str, Any]]:
    """(B.2)/(B.3) re-evaluated by :func:`paper_bound_rdp` with the paper's S_alpha (``q_fn = s_alpha``), an
    implementation independent of ``rdp_bound`` (noise split on a grid of 49 values, so it can only be higher)."""
    rows = []
    for name in ("reference", "strongly_convex"):
        for t in sorted({1000, 20_000, grid[-1]}):
            st = settings(t)[name]
            ours, lib = paper_bound_rdp(st, ALPHA, s_alpha)[0], rdp_bound(st, ALPHA).rdp
            rows.append({"setting": name, "T": t, "ours": ours, "rdp_bound": lib, "rel_diff": ours / lib - 1})
    return rows


def reference_checks(cv: dict[str, Any]) -> list[dict[str, Any]]:
    """The reference values of Example A (:data:`REF_RDP_T1000`, :data:`REF_RDP_PLATEAU`,
    :data:`REF_SC_PLATEAU`) and the closed form of (B.1)'s plateau, each with pass/fail, for the report."""
    ref = {r["T"]: r for r in cv["settings"]["reference"]["rows"]}
    checks = []
    got = ref[1000]["rdp"]
    checks.append(
        {
            "name": "Example A, RDP at order 8, T = 1000 ((B.2)'s composition branch 1000 S_8(0.01, 20), S_alpha of Def 2.10 by quadrature)",
            "expected": REF_RDP_T1000,
            "got": got,
            "passed": _sig4(got) == _sig4(REF_RDP_T1000),
        }
    )
    late = [r["rdp"] for t, r in ref.items() if t >= 20_000]
    checks.append(
        {
            "name": f"Example A, RDP at order 8 flat for T >= 20000 ({len(late)} grid points; (B.2)'s plateau, S_alpha of Def 2.10 by quadrature)",
            "expected": REF_RDP_PLATEAU,
            "got": max(late, key=lambda v: abs(v - REF_RDP_PLATEAU)),
            "passed": bool(late) and all(_sig4(v) == _sig4(REF_RDP_PLATEAU) for v in late),
        }
    )
    fb = cv["settings"]["full_batch"]
    b1 = cv["full_batch_b1"]
    checks.append(
        {
            "name": "full batch: (B.1) plateau evaluated directly = 4 alpha L D~/(n eta sigma^2) (App. B.1)",
            "expected": b1["closed_form"],
            "got": b1["b1_plateau"],
            "passed": abs(b1["b1_plateau"] / b1["closed_form"] - 1) < 1e-9,
        }
    )
    checks.append(
        {
            "name": "full batch: rdp_bound plateau <= 4 alpha L D~/(n eta sigma^2) (min of (B.1), (B.2) with b = n; "
            "(B.2) with b = n gives 2.0000e-2)",
            "expected": b1["closed_form"],
            "got": fb["plateau_rdp"],
            "passed": fb["plateau_rdp"] <= b1["closed_form"] * (1 + 1e-9)
            and _sig4(fb["plateau_rdp"]) == _sig4(2.0e-2),
        }
    )
    sc = cv["settings"]["strongly_convex"]
    checks.append(
        {
            "name": "strongly convex (m = 0.1, c = 0.99), plateau RDP at order 8 ((B.3), S_alpha of Def 2.10 by quadrature)",
            "expected": REF_SC_PLATEAU,
            "got": sc["plateau_rdp"],
            "passed": _sig4(sc["plateau_rdp"]) == _sig4(REF_SC_PLATEAU),
        }
    )
    return checks


# --- (c) soundness check and the conservative variant -------------------------------------------------------


@functools.lru_cache(maxsize=1 << 18)
def _q_accountant(alpha: float, q: float, s: float) -> float:
    """The sampled-Gaussian RDP in the accountant direction, D_alpha(mixture || N(0)) (Mironov, Talwar & Zhang,
    "Renyi Differential Privacy of the Sampled Gaussian Mechanism", 2019); it is >= S_alpha of Def 2.10 (see
    docs/last_iterate.md)."""
    return sampled_gaussian_rdp(alpha, q, s)


_SPLITS = np.linspace(
    0.02, 0.98, 49
)  # sigma1/sigma grid; any split is valid (App. B.2), the grid only loosens


def paper_bound_rdp(st: Setting, alpha: float, q_fn=_q_accountant) -> tuple[float, float]:
    """(B.2) (c = 1) or (B.3) (c < 1) for random batches and a constant step, with the per-step sampled-Gaussian
    cost ``q_fn(alpha, b/n, s)`` in place of S_alpha; returns (bound, composition branch).

    bound = min{T Q(sigma), min_{u on a grid} min_{Tt} Tt Q(sqrt(1-u^2) sigma) + PABI(Tt, u sigma)}, with
    PABI = alpha D^2/(2 eta^2 sigma1^2 Tt) ((3.6)) or alpha D^2 (1-c^2)/(2 eta^2 sigma1^2 (c^(-2 Tt) - 1)) ((B.3),
    footnote 15), and Tt in {1, T-1, floor/ceil of the real minimizer}: D/(eta sigma1) sqrt(alpha/(2Q)) (App. B.2)
    or, for c < 1, the root of (x-1)^2/x = -alpha D^2 (1-c^2) log c/(Q eta^2 sigma1^2), x = c^(-2 Tt) (the
    first-order condition of (B.3), with the (1 - c^2) that App. B.3's printed window formula has as (1 - c)^2;
    docs/last_iterate.md). With ``q_fn = s_alpha`` this re-derives ``rdp_bound`` (to the grid's resolution); with
    the default it is the conservative variant of section (c)."""
    d, eta, big_t, c = st.diameter, st.learning_rate, st.steps, st.contraction
    delta = st.delta_sens
    comp = big_t * q_fn(alpha, st.q, st.b * st.noise_std / delta)
    best = comp
    if big_t < 2:
        return best, comp
    for u in _SPLITS:
        sigma1, sigma2 = u * st.noise_std, math.sqrt(1 - u * u) * st.noise_std
        cost = q_fn(alpha, st.q, st.b * sigma2 / delta)
        base = alpha * d * d / (2 * eta * eta * sigma1 * sigma1)
        if c >= 1:
            star = d / (eta * sigma1) * math.sqrt(alpha / (2 * cost)) if cost > 0 else math.inf

            def pabi(w: int, base=base) -> float:
                return base / w
        else:
            g = -alpha * d * d * (1 - c * c) * math.log(c) / (cost * eta * eta * sigma1 * sigma1)
            star = math.log(((2 + g) + math.sqrt((2 + g) ** 2 - 4)) / 2) / (-2 * math.log(c))

            def pabi(w: int, base=base) -> float:
                e = -2 * w * math.log(c)
                return base * (1 - c * c) / math.expm1(e) if e < 700 else 0.0

        cands = {1, big_t - 1}
        if math.isfinite(star):
            cands |= {min(max(math.floor(star), 1), big_t - 1), min(max(math.ceil(star), 1), big_t - 1)}
        best = min(best, min(w * cost + pabi(w) for w in cands))
    return best, comp


def conservative_epsilon(st: Setting, delta: float) -> float:
    """dptrain's last-iterate epsilon: the library bound with its default, dominating per-step direction
    (``step_cost``), i.e. what the `last_iterate` accountant reports (not certified)."""
    return last_iterate_report(dataclasses.replace(st, paper_direction=False), delta)["epsilon"]


def paper_epsilon(st: Setting, delta: float) -> float:
    """The bound as published: Def 2.10's direction D(N(0) || mixture) (section (c) shows it can fail)."""
    return last_iterate_report(dataclasses.replace(st, paper_direction=True), delta)["epsilon"]


def _calibrate(eps_fn, target: float, rel: float = 1e-5) -> float:
    """Smallest sigma (to relative tolerance ``rel``, rounded up) with eps_fn(sigma) <= target, by geometric
    bisection; eps_fn is non-increasing in sigma (the RDP bounds decrease in sigma: App. B.2 says "increasing",
    a typo)."""
    hi = 1.0
    while eps_fn(hi) > target:
        hi *= 2
    lo = hi / 2
    while eps_fn(lo) <= target and lo > 1e-6:
        hi, lo = lo, lo / 2
    while hi / lo > 1 + rel:
        mid = math.sqrt(lo * hi)
        if eps_fn(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def single_step_counterexample(
    n: int,
    b: int,
    lipschitz: float,
    diameter: float,
    lr: float,
    l2: float,
    sigmas: tuple[float, ...] = (1e-3, 3e-3, 1e-2),
) -> dict[str, Any]:
    """One step (T = 1) of projected noisy SGD with the constants of section (b), d = 1, w_0 = 0, and the
    admissible neighbouring pair F_i(w) = (l2/2) w^2 for all i (dataset X) vs. the same with F_i*(w) = L w +
    (l2/2) w^2 (X'; the unregularized part is L-Lipschitz, convex, 0-smooth). The output is Proj_K[-eta (G + Z)]
    with G = 0 under X and G = (L/b) 1[i* in B] under X'; P[i* in B] = b/n. Events S_theta = {w_1 <= -theta}
    (theta < D/2, so the projection does not change them) give the lower bound
    delta_X',X(eps) >= max_theta P_X'(S_theta) - e^eps P_X(S_theta)  (Def 2.2)
    on the true privacy profile, to compare with what the accountant certifies for this one-step ledger at each
    noise std in ``sigmas``."""
    q = b / n
    shift = lipschitz / b  # in units of eta: w_1 = -eta (shift 1[i* in B] + Z)

    def delta_lower(eps: float, sigma: float) -> float:
        thetas = np.linspace(0.0, min(diameter / 2 / lr, shift + 8 * sigma) * 0.999, 4001)
        p = stats.norm.sf(thetas / sigma)
        p_prime = (1 - q) * p + q * stats.norm.sf((thetas - shift) / sigma)
        return float(np.max(p_prime - math.exp(eps) * p))

    rows = []
    for sigma in sigmas:
        ledger = _ledger(n, b, sigma, 1, lipschitz, diameter, lr, l2)
        eps_rdp = epsilon(ledger, DELTA, "rdp").epsilon
        st = Setting(
            n=n,
            b=b,
            noise_std=sigma,
            lipschitz=lipschitz,
            diameter=diameter,
            learning_rate=lr,
            steps=1,
            strong_convexity=l2,
            smoothness=_glm().constants(diameter)["M"],  # the ledger's M; the pair's losses are l2-smooth
        )
        eps_li = paper_epsilon(st, DELTA)
        rows.append(
            {
                "sigma": sigma,
                "noise_multiplier": b * sigma / lipschitz,
                "eps_last_iterate": eps_li,
                "eps_rdp": eps_rdp,
                "eps_conservative": conservative_epsilon(st, DELTA),
                "delta_lower_at_eps_last_iterate": delta_lower(eps_li, sigma),
                "delta_lower_at_eps_1": delta_lower(1.0, sigma),
            }
        )
    return {"q": q, "rows": rows, "violated": any(r["delta_lower_at_eps_last_iterate"] > DELTA for r in rows)}


# --- (b) training -------------------------------------------------------------------------------------------


def _glm():
    from dptrain.last_iterate import ConvexGLM

    return ConvexGLM(TRAINING["loss"], TRAINING["feature_norm"], True, TRAINING["l2"])


def _ledger(
    n: int, b: int, sigma: float, steps: int, lipschitz: float, diameter: float, lr: float, l2: float
) -> Ledger:
    """The ledger the trainer records for T = ``steps`` steps (the same event and facts, Sec 1.2 replace
    adjacency: Delta = 2L), built without training."""
    consts = _glm().constants(diameter)
    ledger = Ledger(neighboring=neighboring_for("replace"))
    ledger.record(
        step_event("random", n, b, sigma, 2 * lipschitz),
        step_facts(
            batching="random",
            n=n,
            b=b,
            noise_std=sigma,
            lipschitz=lipschitz,
            adjacency="replace",
            diameter=diameter,
            smoothness=consts["M"],
            learning_rate=lr,
            strong_convexity=l2,
        ),
        steps,
    )
    return ledger


def _binary(split, per_class: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The examples of the two classes, label 1 for POSITIVE_CLASS; with ``per_class``, the first that many of
    each class in file order (deterministic)."""
    parts = []
    for c in (NEGATIVE_CLASS, POSITIVE_CLASS):
        idx = (split.y == c).nonzero().squeeze(1)
        parts.append(idx if per_class is None else idx[:per_class])
    idx = torch.cat(parts).sort().values
    return split.x[idx], (split.y[idx] == POSITIVE_CLASS).long()


def _train(train, test, sigma: float, steps: int, seed: int, diameter: float, lr: float):
    from dptrain.last_iterate import ProjectedNoisySGD, accuracy

    glm = _glm()
    trainer = ProjectedNoisySGD(
        glm,
        train,
        noise_std=sigma,
        learning_rate=lr,
        steps=steps,
        batch_size=TRAINING["batch_size"],
        batching="random",
        diameter=diameter,
        seed=seed,
    )
    w = trainer.train()  # only the last iterate w_T leaves the trainer
    return accuracy(w, glm, *test), trainer


def constants(n: int) -> dict[str, Any]:
    """Section (b)'s constants for ``n`` training examples: L, M and m of the regularized GLM on norm-1 features
    at D = 10 (Sec 5.4), the batch b, the step eta = 2/(M + m), which minimizes c = max(|1 - eta m|, |1 - eta M|)
    (App. B.3's step-size note; it is < 2/M), and the steps of one epoch, ceil(n/b)."""
    consts = _glm().constants(TRAINING["diameter"])
    b = TRAINING["batch_size"]
    return {
        "n": n,
        "b": b,
        "L": consts["L"],
        "M": consts["M"],
        "m": consts["m"],
        "lr": 2 / (consts["M"] + consts["m"]),
        "epoch": math.ceil(n / b),
        "glm": {k: v for k, v in consts.items() if k != "derivation"},
    }


def setting_for(
    k: dict[str, Any], sigma: float, steps: int, diameter: float = TRAINING["diameter"]
) -> Setting:
    """The accountant's :class:`Setting` of a section (b) run with constants ``k`` (:func:`constants`)."""
    return Setting(
        n=k["n"],
        b=k["b"],
        noise_std=sigma,
        lipschitz=k["L"],
        diameter=diameter,
        learning_rate=k["lr"],
        steps=steps,
        strong_convexity=k["m"],
        smoothness=k["M"],
    )


def calibrate(
    k: dict[str, Any], cert: str, steps: int, rtol: float, diameter: float = TRAINING["diameter"]
) -> float:
    """sigma at (eps, delta) = (1, 1e-5) for T = ``steps`` under the certification ``cert`` (a key of
    :data:`CERTIFICATIONS`): ``calibrate_noise(.., "rdp")`` on the run's ledger for "composition", else
    :func:`_calibrate` on :func:`paper_epsilon` ("last_iterate") or :func:`conservative_epsilon`."""
    eps_target, delta = TRAINING["epsilon"], TRAINING["delta"]
    if cert == "conservative":
        return _calibrate(
            lambda s: conservative_epsilon(setting_for(k, s, steps, diameter), delta), eps_target, rtol
        )
    if cert == "last_iterate":  # the paper's bound as published (Def 2.10 direction)
        return _calibrate(
            lambda s: paper_epsilon(setting_for(k, s, steps, diameter), delta), eps_target, rtol
        )
    ledger_for = lambda s: _ledger(k["n"], k["b"], s, steps, k["L"], diameter, k["lr"], k["m"])  # noqa: E731
    return calibrate_noise(eps_target, delta, ledger_for, "rdp", rtol=rtol)


def training_experiment(scale: Scale) -> dict[str, Any]:
    """Section (b). sigma per (certification, T) at (eps, delta) = (1, 1e-5) by :func:`calibrate`; then train and
    report the test accuracy of the final iterate and the eps of the trainer's own ledger under each
    certification; the non-private references, the diameter sweep and section (c)'s one-step check."""

    data = fashion_mnist()
    train, test = _binary(data.train, scale.per_class), _binary(data.test, None)
    k = constants(len(train[1]))
    n, b, lip, m, lr, epoch = k["n"], k["b"], k["L"], k["m"], k["lr"], k["epoch"]
    seeds = list(scale.seeds)
    delta, diameter = TRAINING["delta"], TRAINING["diameter"]

    rows = []
    for cert in CERTIFICATIONS:
        for e in scale.epochs:
            steps = e * epoch
            t0 = time.perf_counter()
            sigma = calibrate(k, cert, steps, scale.rtol)
            cal_s = time.perf_counter() - t0
            accs, train_s = [], 0.0
            trainer = None
            for seed in seeds:
                t0 = time.perf_counter()
                acc, trainer = _train(train, test, sigma, steps, seed, diameter, lr)
                train_s += time.perf_counter() - t0
                accs.append(acc)
            rows.append(
                {
                    "certification": cert,
                    "epochs": e,
                    "steps": steps,
                    "sigma": sigma,
                    "noise_multiplier": b * sigma / (2 * lip),
                    "eps_last_iterate": paper_epsilon(setting_for(k, sigma, steps), delta),
                    "eps_composition": epsilon(trainer.ledger, delta, "rdp").epsilon,
                    "eps_conservative": conservative_epsilon(setting_for(k, sigma, steps), delta),
                    "accuracies": accs,
                    "mean": float(np.mean(accs)),
                    "std": float(np.std(accs)),
                    "calibration_s": cal_s,
                    "training_s": train_s,
                    "ms_per_step": 1e3 * train_s / (steps * len(seeds)),
                }
            )

    ref_epochs = scale.nonprivate_epochs
    nonprivate = {}
    for d in (diameter, 1000.0):
        nonprivate[f"D={d:g}"] = [
            _train(train, test, 1e-12, ref_epochs * epoch, seed, d, lr)[0] for seed in seeds
        ]
    nonprivate_1 = [_train(train, test, 1e-12, epoch, seed, diameter, lr)[0] for seed in seeds]

    sweep = []
    for d in scale.diameter_sweep:  # the D sweep of the last-iterate certifications at 100 epochs
        ref = float(np.mean([_train(train, test, 1e-12, 20 * epoch, s, d, lr)[0] for s in seeds]))
        for cert in ("last_iterate", "conservative"):
            steps = 100 * epoch
            sigma = calibrate(k, cert, steps, scale.rtol, d)
            accs = [_train(train, test, sigma, steps, seed, d, lr)[0] for seed in seeds]
            sweep.append(
                {
                    "diameter": d,
                    "certification": cert,
                    "epochs": 100,
                    "steps": steps,
                    "sigma": sigma,
                    "mean": float(np.mean(accs)),
                    "std": float(np.std(accs)),
                    "accuracies": accs,
                    "nonprivate": ref,
                }
            )
    # the merely convex reading (m = 0 declared; valid, weaker): Thm 3.1's burn-in D n/(L eta)
    convex_only = last_iterate_report(
        dataclasses.replace(setting_for(k, 0.02, 100 * epoch), strong_convexity=0.0), delta
    )
    strongly = last_iterate_report(setting_for(k, 0.02, 100 * epoch), delta)
    return {
        "classes": CLASS_NAMES,
        "n": n,
        "test_size": len(test[1]),
        "dim": int(train[0][0].numel()) + 1,
        "batch_size": b,
        "epoch_steps": epoch,
        "learning_rate": lr,
        "constants": k["glm"],
        "contraction": setting_for(k, 0.02, 2).contraction,
        "seeds": seeds,
        "quick": scale.quick,
        "rows": rows,
        "nonprivate": nonprivate,
        "nonprivate_epochs": ref_epochs,
        "nonprivate_1_epoch": nonprivate_1,
        "diameter_sweep": sweep,
        "burn_in_sigma_0.02": {
            "strongly_convex": strongly["burn_in_steps"],
            "convex_only": convex_only["burn_in_steps"],
            "convex_only_epsilon": convex_only["epsilon"],
            "strongly_convex_epsilon": strongly["epsilon"],
        },
        "soundness": single_step_counterexample(n, b, lip, diameter, lr, m, scale.soundness_sigmas),
        **{key: TRAINING[key] for key in ("l2", "diameter", "epsilon", "delta")},
    }


# --- driver -------------------------------------------------------------------------------------------------


def render(data: dict[str, Any]) -> Report:
    """The report of ``data`` (what :func:`run` writes to ``last_iterate.json``): three sections and two plots,
    whose text is built by :mod:`dptrain.reproduce.last_iterate_text`."""
    cv, exp, timings = data["curves"], data["training"], data["timings_s"]
    header = f"Produced by `{data['command']}`"
    mode = (
        "QUICK mode (reduced grid and experiment; not the reported results)" if data["quick"] else "full run"
    )
    return Report(
        REPORT,
        "Privacy of noisy SGD: more iterations without more privacy loss (Altschuler & Talwar): reproduction",
        intro=[
            f"{header} ({mode}). Wall time {timings['total']:.0f} s (a: {timings['a']:.1f} s, "
            f"b + c: {timings['b']:.0f} s). All numbers are in `last_iterate.json`."
        ],
        sections=[
            Section("(a) Epsilon vs T: last-iterate bound vs composition", [text.section_a(cv, header)]),
            Section(
                "(b) Logistic regression at (eps, delta) = (1, 1e-5): composition vs last-iterate certification",
                [text.section_b(exp, header)],
            ),
            Section("(c) Soundness check of the S_alpha direction", [text.section_c(exp, header)]),
        ],
        data={DATA_JSON: data},
        plots=[
            figure("epsilon_vs_T.png", text.draw_curves(cv), figsize=(11, 4.2), ncols=2),
            figure("training.png", text.draw_training(exp), figsize=(11, 4.2), ncols=2),
        ],
    )


def run(out_dir: str | Path, quick: bool = False) -> Path:
    """Run the reproduction into ``out_dir`` (created if needed); returns the path of ``last_iterate.md``.
    ``quick`` runs :data:`QUICK`: section (a) on 8 values of T up to 10^5; section (b) on 2000 training examples,
    one seed, T of 1 and 5 epochs, no diameter sweep."""
    scale = QUICK if quick else FULL
    command = f"dptrain reproduce last-iterate --out {Path(out_dir)}" + (" --quick" if quick else "")
    start = time.perf_counter()
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    cv = curves(scale.grid)
    timings["a"] = time.perf_counter() - t0

    with single_thread():  # a 785-parameter model
        t0 = time.perf_counter()
        exp = training_experiment(scale)
        timings["b"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - start
    data = {"command": command, "quick": quick, "timings_s": timings, "curves": cv, "training": exp}
    return render(data).write(out_dir)
