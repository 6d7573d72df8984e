"""Reproduction of seed 003, "Privacy of Noisy Stochastic Gradient Descent: More Iterations without More Privacy
Loss" (Altschuler & Talwar; digest: shared/digests/003_noisy_sgd_privacy.md).

``run(out_dir, quick=False)`` writes ``last_iterate.md`` (the report), ``last_iterate.json`` (every number) and
PNG plots into ``out_dir``. Sections:

(a) Epsilon against the number of steps T for the digest's Example A (alpha = 8, L = D = 1, eta = 0.1, n = 1000,
    b = 10, sigma = 4, replace adjacency, random batches, M = 1), its full-batch variant (b = n, App. B.1) and a
    strongly convex variant (m = 0.1, App. B.3): the last-iterate RDP bound of ``rdp_bound`` against the
    composition bound that charges every step, and the (eps, delta = 1e-5) values of ``last_iterate_report``
    (RDP -> DP by Lemma 2.5). The paper prints no numeric table (digest 6); the reference values checked are the
    digest's own derived numbers (digest 7, items 8, 12 and 13).
(b) Regularized logistic regression (projected noisy SGD, ``dptrain.last_iterate``) on a Fashion-MNIST binary
    task at the fixed budget (eps = 1, delta = 1e-5), with sigma calibrated by composition (dp_accounting's RDP)
    and by the last-iterate accountant, for T from 1 to 100 epochs; test accuracy of the final iterate only.
(c) A soundness check of the S_alpha direction the last-iterate accountant uses (digest 4.1, 8.2), with an
    explicit neighbouring pair, and the "conservative" variant of (B.2)/(B.3) used as a third certification in (b).

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
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from dptrain.accounting import calibrate_noise, epsilon
from dptrain.accounting.last_iterate import (
    ORDERS,
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
from dptrain.reproduce import json_default, md_table, single_thread

__all__ = ["REFERENCE", "run"]

REPORT, DATA_JSON = "last_iterate.md", "last_iterate.json"
ALPHA, DELTA = 8.0, 1e-5

#: Example A of the digest (section 7): alpha = 8 (ALPHA), q = b/n = 0.01, b sigma/(2L) = 20, Dn/(L eta) = 10^4.
REFERENCE = {
    "n": 1000,
    "b": 10,
    "noise_std": 4.0,
    "lipschitz": 1.0,
    "diameter": 1.0,
    "learning_rate": 0.1,
    "smoothness": 1.0,
    "adjacency": "replace",
}
#: Digest 7 reference values ([derived] there: exact-S quadrature), checked to 4 significant digits.
REF_RDP_T1000, REF_RDP_PLATEAU, REF_SC_PLATEAU = 1.00103e-3, 2.00205e-2, 6.84902e-4
STRONG_CONVEXITY = 0.1  # digest 7 item 13, first row: m = 0.1, M = 1, eta = 0.1, c = 0.99
TABLE_T = (10, 100, 1000, 10_000, 20_000, 100_000, 1_000_000)
SETTING_LABELS = {
    "reference": "Example A (b = 10, random batches, (B.2))",
    "full_batch": "full batch (b = n = 1000, (B.1)/(B.2))",
    "strongly_convex": "strongly convex (m = 0.1, M = 1, (B.3))",
}

#: Section (b): Fashion-MNIST classes. T-shirt/top vs Pullover: a linear model on norm-1 features reaches ~95%
#: without noise (decent, not perfect); see _section_b_md for the pilot numbers behind the choice.
CLASS_NAMES = {0: "T-shirt/top", 2: "Pullover"}
NEGATIVE_CLASS, POSITIVE_CLASS = 0, 2
TRAINING = {
    "loss": "logistic",
    "feature_norm": 1.0,
    "l2": 1e-2,
    "batch_size": 256,
    "diameter": 10.0,
    "epsilon": 1.0,
    "delta": DELTA,
}


def _sig4(x: float) -> float:
    return float(f"{x:.4g}")


# --- (a) epsilon against T ----------------------------------------------------------------------------------


def settings(steps: int) -> dict[str, Setting]:
    """The three runs of section (a) at T = ``steps``: Example A, its full-batch variant (b = n, batching
    "full") and its strongly convex variant (m = 0.1, M = 1, eta = 0.1: c = 0.99, digest 7 item 13)."""
    ref = Setting(steps=steps, batching="random", paper_direction=True, **REFERENCE)  # the paper's numbers
    return {
        "reference": ref,
        "full_batch": dataclasses.replace(ref, b=ref.n, batching="full"),
        "strongly_convex": dataclasses.replace(ref, strong_convexity=STRONG_CONVEXITY),
    }


def t_grid(quick: bool) -> list[int]:
    """About 30 log-spaced T in [10, 10^6] plus the table's T values; quick: 8 values up to 10^5 (keeping the
    T = 1000 and T = 20000 reference points)."""
    if quick:
        return [10, 100, 1000, 5000, 10_000, 20_000, 50_000, 100_000]
    grid = {int(round(t)) for t in np.geomspace(10, 1e6, 30)}
    return sorted(grid | set(TABLE_T))


def full_batch_b1_plateau(st: Setting, alpha: float) -> dict[str, float]:
    """(B.1)'s second term for T -> infinity, evaluated directly (independently of ``rdp_bound``):
    alpha/(2 eta^2 sigma^2) min_Tt Tt (D~/Tt + a)^2 with a = Delta eta/n and D~ = D + a, whose real minimizer is
    Tt = D~/a (App. B.1), and the closed form 4 alpha L D~/(n eta sigma^2) (digest 4.3, replace: Delta = 2L)."""
    eta, n, sigma = st.learning_rate, st.n, st.noise_std
    a = st.delta_sens * eta / n
    d_tilde = st.diameter + a
    star = d_tilde / a
    scale = alpha / (2 * eta * eta * sigma * sigma)
    value = min(scale * w * (d_tilde / w + a) ** 2 for w in {max(1, math.floor(star)), math.ceil(star)})
    closed = 4 * alpha * st.lipschitz * d_tilde / (n * eta * sigma * sigma)
    return {"b1_plateau": value, "closed_form": closed, "d_tilde": d_tilde, "window": star}


def curves(quick: bool) -> dict[str, Any]:
    """Section (a): for every T of the grid and each setting, ``rdp_bound(setting, 8)`` (the last-iterate bound
    and ``.composition``) and ``last_iterate_report(setting, 1e-5)`` (eps and eps_composition)."""
    grid = t_grid(quick)
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
    """The digest's reference values (section 7, items 8, 12, 13), each with pass/fail."""
    ref = {r["T"]: r for r in cv["settings"]["reference"]["rows"]}
    checks = []
    got = ref[1000]["rdp"]
    checks.append(
        {
            "name": "Example A, RDP at order 8, T = 1000 (digest 7 item 8)",
            "expected": REF_RDP_T1000,
            "got": got,
            "passed": _sig4(got) == _sig4(REF_RDP_T1000),
        }
    )
    late = [r["rdp"] for t, r in ref.items() if t >= 20_000]
    checks.append(
        {
            "name": f"Example A, RDP at order 8 flat for T >= 20000 ({len(late)} grid points; digest 7 item 8)",
            "expected": REF_RDP_PLATEAU,
            "got": max(late, key=lambda v: abs(v - REF_RDP_PLATEAU)),
            "passed": bool(late) and all(_sig4(v) == _sig4(REF_RDP_PLATEAU) for v in late),
        }
    )
    fb = cv["settings"]["full_batch"]
    b1 = cv["full_batch_b1"]
    checks.append(
        {
            "name": "full batch: (B.1) plateau evaluated directly = 4 alpha L D~/(n eta sigma^2) (digest 4.3)",
            "expected": b1["closed_form"],
            "got": b1["b1_plateau"],
            "passed": abs(b1["b1_plateau"] / b1["closed_form"] - 1) < 1e-9,
        }
    )
    checks.append(
        {
            "name": "full batch: rdp_bound plateau <= 4 alpha L D~/(n eta sigma^2) (min of (B.1), (B.2) with b = n; "
            "digest 7 item 12: 2.0000e-2)",
            "expected": b1["closed_form"],
            "got": fb["plateau_rdp"],
            "passed": fb["plateau_rdp"] <= b1["closed_form"] * (1 + 1e-9)
            and _sig4(fb["plateau_rdp"]) == _sig4(2.0e-2),
        }
    )
    sc = cv["settings"]["strongly_convex"]
    checks.append(
        {
            "name": "strongly convex (m = 0.1, c = 0.99), plateau RDP at order 8 (digest 7 item 13)",
            "expected": REF_SC_PLATEAU,
            "got": sc["plateau_rdp"],
            "passed": _sig4(sc["plateau_rdp"]) == _sig4(REF_SC_PLATEAU),
        }
    )
    return checks


def _plot_curves(cv: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    try:
        colors = {"reference": "C0", "full_batch": "C1", "strongly_convex": "C2"}
        widths = {"reference": 4.0, "full_batch": 1.5, "strongly_convex": 1.5}  # A and full batch overlap
        for name, s in cv["settings"].items():
            t = [r["T"] for r in s["rows"]]
            style = {
                "color": colors[name],
                "linewidth": widths[name],
                "alpha": 0.55 if name == "reference" else 1,
            }
            axes[0].plot(t, [r["rdp"] for r in s["rows"]], label=s["label"], **style)
            axes[0].plot(t, [r["rdp_composition"] for r in s["rows"]], "--", color=colors[name], linewidth=1)
            axes[1].plot(t, [r["epsilon"] for r in s["rows"]], label=s["label"], **style)
            axes[1].plot(
                t, [r["epsilon_composition"] for r in s["rows"]], "--", color=colors[name], linewidth=1
            )
        axes[0].set_xscale("log")
        axes[0].set_yscale("log")
        axes[0].set_xlabel("T (steps)")
        axes[0].set_ylabel(f"RDP at order {ALPHA:g}")
        axes[0].set_title("last-iterate bound (solid) vs composition (dashed)")
        axes[1].set_xscale("log")
        axes[1].set_yscale("log")
        axes[1].set_xlabel("T (steps)")
        axes[1].set_ylabel(f"eps at delta = {DELTA:g} (Lemma 2.5)")
        axes[1].set_title("DP epsilon (solid) vs composition (dashed)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def _section_a_md(cv: dict[str, Any], header: str) -> str:
    parts = [f"{header}:"]
    for s in cv["settings"].values():
        by_t = {r["T"]: r for r in s["rows"]}
        rows = []
        for t in TABLE_T:
            if t not in by_t:
                continue
            r = by_t[t]
            rows.append(
                [
                    f"{t:,}",
                    f"{r['rdp']:.5e}",
                    f"{r['rdp_composition']:.5e}",
                    "composition" if r["window"] is None else f"{r['window']:,}",
                    "-" if r["noise_split"] is None else f"{r['noise_split']:.3f}",
                    f"{r['epsilon']:.4f}",
                    f"{r['epsilon_composition']:.4f}",
                    f"{r['order']:g}",
                ]
            )
        parts += [
            f"**{s['label']}** (c = {s['contraction']:g}; burn-in reported by `last_iterate_report`: "
            f"**{s['burn_in_steps']:,} steps**; plateau RDP at order 8 = {s['plateau_rdp']:.5e} with window "
            f"{s['plateau_window']:,}):",
            md_table(
                [
                    "T",
                    "RDP(8), last iterate",
                    "RDP(8), composition",
                    "window Tt",
                    "sigma1/sigma",
                    "eps (last iterate)",
                    "eps (composition)",
                    "best order",
                ],
                rows,
            ),
        ]
    checks = cv["checks"]
    parts += [
        f"Grid: {len(cv['T'])} values of T from {cv['T'][0]} to {cv['T'][-1]:,}; the table shows a subset. "
        "RDP at order 8 from `rdp_bound(setting, 8)` (its `.rdp` and `.composition`); eps at delta = 1e-5 from "
        "`last_iterate_report(setting, 1e-5)` (`epsilon`, `epsilon_composition`), both minimized over the "
        "accountant's orders 1.25..256 (Lemma 2.5). The composition column charges every step (the tau = 0 term "
        "of (B.2), T S_alpha(b/n, b sigma/(2L)), or T alpha (2L)^2/(2 n^2 sigma^2) for full batch). Window "
        "'composition' means the composition branch is the minimum. See `epsilon_vs_T.png`.",
        "**Reference checks** (digest 7; 4 significant digits):",
        md_table(
            ["check", "expected", "got", "result"],
            [
                [c["name"], f"{c['expected']:.6g}", f"{c['got']:.6g}", "PASS" if c["passed"] else "FAIL"]
                for c in checks
            ],
        ),
        "Properties over the whole grid: last-iterate bound <= composition at every T: "
        + ", ".join(f"{n} {'PASS' if s['below_composition'] else 'FAIL'}" for n, s in cv["settings"].items())
        + "; non-decreasing in T: "
        + ", ".join(f"{n} {'PASS' if s['non_decreasing'] else 'FAIL'}" for n, s in cv["settings"].items())
        + f"; strongly convex <= convex at every T: {'PASS' if cv['strongly_convex_below_convex'] else 'FAIL'}.",
        "Independent re-evaluation of (B.2)/(B.3) (`paper_bound_rdp` in this module, same S_alpha, noise split "
        "on a 49-point grid) against `rdp_bound`, relative difference at order 8: "
        + ", ".join(f"{r['setting']} T = {r['T']:,}: {r['rel_diff']:+.1e}" for r in cv["rederivation"])
        + ".",
        "Full batch: `rdp_bound` takes the smaller of (B.1) and (B.2) with b = n; (B.2) has no D~ inflation and "
        f"gives the plateau {cv['settings']['full_batch']['plateau_rdp']:.6g}, (B.1) alone gives "
        f"{cv['full_batch_b1']['b1_plateau']:.6g} = 4 alpha L D~/(n eta sigma^2) with D~ = D + 2 eta L/n = "
        f"{cv['full_batch_b1']['d_tilde']:.6g} (window D~ n/(2 eta L) = {cv['full_batch_b1']['window']:.0f}). "
        "The burn-in of `last_iterate_report` is where the bound stops growing: the plateau window plus one step, "
        "or where the composition line reaches the plateau, whichever is later; for Example A that is "
        f"{cv['settings']['reference']['burn_in_steps']:,} steps, twice the paper's Tbar = Dn/(L eta) = 10,000 "
        "(the linear regime meets the plateau at 2 Dn/(L eta), digest 7 item 8).",
    ]
    return "\n\n".join(parts)


# --- (c) soundness check and the conservative variant -------------------------------------------------------


@functools.lru_cache(maxsize=1 << 18)
def _q_accountant(alpha: float, q: float, s: float) -> float:
    """The sampled-Gaussian RDP in the accountant direction, D_alpha(mixture || N(0)) (Mironov, Talwar & Zhang
    2019; digest 4.1 (b)); it is >= S_alpha of Def 2.10 (digest 7 item 3)."""
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
    or, for c < 1, the root of (x-1)^2/x = -alpha D^2 (1-c^2) log c/(Q eta^2 sigma1^2), x = c^(-2 Tt) (digest 4.5,
    the corrected first-order condition). With ``q_fn = s_alpha`` this re-derives ``rdp_bound`` (to the grid's
    resolution); with the default it is the conservative variant of section (c)."""
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


#: The integer orders of the accountant's grid (fewer orders only loosen Lemma 2.5; dp_accounting's series for
#: fractional orders below 2 may fail to converge at small noise multipliers).
CONSERVATIVE_ORDERS = tuple(a for a in ORDERS if a == int(a))


def conservative_epsilon(st: Setting, delta: float) -> float:
    """dptrain's last-iterate epsilon: the library bound with its default, dominating per-step direction
    (``step_cost``), i.e. what the `last_iterate` accountant reports (not certified)."""
    return last_iterate_report(dataclasses.replace(st, paper_direction=False), delta)["epsilon"]


def paper_epsilon(st: Setting, delta: float) -> float:
    """The bound as published: Def 2.10's direction D(N(0) || mixture) (section (c) shows it can fail)."""
    return last_iterate_report(dataclasses.replace(st, paper_direction=True), delta)["epsilon"]


def _calibrate(eps_fn, target: float, rel: float = 1e-5) -> float:
    """Smallest sigma (to relative tolerance ``rel``, rounded up) with eps_fn(sigma) <= target, by geometric
    bisection; eps_fn is non-increasing in sigma (digest 4.8)."""
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


def single_step_counterexample(n: int, b: int, lipschitz: float, diameter: float, lr: float, l2: float):
    """One step (T = 1) of projected noisy SGD with the constants of section (b), d = 1, w_0 = 0, and the
    admissible neighbouring pair F_i(w) = (l2/2) w^2 for all i (dataset X) vs. the same with F_i*(w) = L w +
    (l2/2) w^2 (X'; the unregularized part is L-Lipschitz, convex, 0-smooth). The output is Proj_K[-eta (G + Z)]
    with G = 0 under X and G = (L/b) 1[i* in B] under X'; P[i* in B] = b/n. Events S_theta = {w_1 <= -theta}
    (theta < D/2, so the projection does not change them) give the lower bound
    delta_X',X(eps) >= max_theta P_X'(S_theta) - e^eps P_X(S_theta)  (Def 2.2)
    on the true privacy profile, to compare with what the accountant certifies for this one-step ledger."""
    q = b / n
    shift = lipschitz / b  # in units of eta: w_1 = -eta (shift 1[i* in B] + Z)

    def delta_lower(eps: float, sigma: float) -> float:
        thetas = np.linspace(0.0, min(diameter / 2 / lr, shift + 8 * sigma) * 0.999, 4001)
        p = stats.norm.sf(thetas / sigma)
        p_prime = (1 - q) * p + q * stats.norm.sf((thetas - shift) / sigma)
        return float(np.max(p_prime - math.exp(eps) * p))

    rows = []
    for sigma in (1e-3, 3e-3, 1e-2):
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


CERTIFICATIONS = {
    "composition": "composition (dp_accounting RDP, sampled w/o replacement): certified",
    "last_iterate": "the paper's last-iterate bound as published (Def 2.10 direction; fails section (c))",
    "conservative": "dptrain's last-iterate bound (dominating direction; the `last_iterate` accountant, NOT certified)",
}


def training_experiment(quick: bool) -> dict[str, Any]:
    """Section (b). sigma per (certification, T) at (eps, delta) = (1, 1e-5): ``calibrate_noise`` with "rdp" or
    "last_iterate" on the run's ledger, or :func:`_calibrate` on :func:`conservative_epsilon`; then train and
    report the test accuracy of the final iterate and the certified eps of the trainer's own ledger."""
    from dptrain.data import load_dataset

    data = load_dataset("fashion-mnist")
    per_class = 1000 if quick else None
    train, test = _binary(data.train, per_class), _binary(data.test, None)
    n, b = len(train[1]), TRAINING["batch_size"]
    glm = _glm()
    consts = glm.constants(TRAINING["diameter"])
    lip, big_m, m = consts["L"], consts["M"], consts["m"]
    lr = 2 / (big_m + m)  # minimizes c = max(|1 - eta m|, |1 - eta M|) (App. B.3 stepsize note); < 2/M
    epoch = math.ceil(n / b)
    seeds = [0] if quick else [0, 1, 2]
    epochs = {
        "composition": [1, 5] if quick else [1, 5, 20, 100],
        "last_iterate": [1, 5] if quick else [1, 5, 20, 100],
        "conservative": [1, 5] if quick else [1, 5, 20, 100],
    }
    eps_target, delta, diameter = TRAINING["epsilon"], TRAINING["delta"], TRAINING["diameter"]

    def ledger_for(steps: int, d: float = diameter):
        return lambda s: _ledger(n, b, s, steps, lip, d, lr, m)

    def setting_for(sigma: float, steps: int, d: float = diameter) -> Setting:
        return Setting(
            n=n,
            b=b,
            noise_std=sigma,
            lipschitz=lip,
            diameter=d,
            learning_rate=lr,
            steps=steps,
            strong_convexity=m,
            smoothness=big_m,
        )

    rtol = 1e-3 if quick else 1e-6  # quick: fewer accountant evaluations (each "rdp" one takes ~0.3 s)

    def calibrate(cert: str, steps: int, d: float = diameter) -> float:
        if cert == "conservative":
            return _calibrate(
                lambda s: conservative_epsilon(setting_for(s, steps, d), delta), eps_target, rtol
            )
        if cert == "last_iterate":  # the paper's bound as published (Def 2.10 direction)
            return _calibrate(lambda s: paper_epsilon(setting_for(s, steps, d), delta), eps_target, rtol)
        return calibrate_noise(eps_target, delta, ledger_for(steps, d), "rdp", rtol=rtol)

    rows = []
    for cert, eps_list in epochs.items():
        for e in eps_list:
            steps = e * epoch
            t0 = time.perf_counter()
            sigma = calibrate(cert, steps)
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
                    "eps_last_iterate": paper_epsilon(setting_for(sigma, steps), delta),
                    "eps_composition": epsilon(trainer.ledger, delta, "rdp").epsilon,
                    "eps_conservative": conservative_epsilon(setting_for(sigma, steps), delta),
                    "accuracies": accs,
                    "mean": float(np.mean(accs)),
                    "std": float(np.std(accs)),
                    "calibration_s": cal_s,
                    "training_s": train_s,
                    "ms_per_step": 1e3 * train_s / (steps * len(seeds)),
                }
            )

    ref_epochs = 5 if quick else 20
    nonprivate = {}
    for d in (diameter, 1000.0):
        nonprivate[f"D={d:g}"] = [
            _train(train, test, 1e-12, ref_epochs * epoch, seed, d, lr)[0] for seed in seeds
        ]
    nonprivate_1 = [_train(train, test, 1e-12, epoch, seed, diameter, lr)[0] for seed in seeds]

    sweep = []
    if not quick:  # the D sweep of the last-iterate certifications at 100 epochs
        for d in (2.0, 10.0, 50.0):
            ref = float(np.mean([_train(train, test, 1e-12, 20 * epoch, s, d, lr)[0] for s in seeds]))
            for cert in ("last_iterate", "conservative"):
                steps = 100 * epoch
                sigma = calibrate(cert, steps, d)
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
        dataclasses.replace(setting_for(0.02, 100 * epoch), strong_convexity=0.0), delta
    )
    strongly = last_iterate_report(setting_for(0.02, 100 * epoch), delta)
    return {
        "classes": CLASS_NAMES,
        "n": n,
        "test_size": len(test[1]),
        "dim": int(train[0][0].numel()) + 1,
        "batch_size": b,
        "epoch_steps": epoch,
        "learning_rate": lr,
        "constants": {k: v for k, v in consts.items() if k != "derivation"},
        "contraction": setting_for(0.02, 2).contraction,
        "seeds": seeds,
        "quick": quick,
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
        "soundness": single_step_counterexample(n, b, lip, diameter, lr, m),
        **{k: TRAINING[k] for k in ("l2", "diameter", "epsilon", "delta")},
    }


def _plot_training(exp: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    try:
        for cert, marker in zip(CERTIFICATIONS, ("o", "s", "^"), strict=True):
            rs = [r for r in exp["rows"] if r["certification"] == cert]
            e = [r["epochs"] for r in rs]
            axes[0].errorbar(
                e, [r["mean"] for r in rs], yerr=[r["std"] for r in rs], marker=marker, capsize=3, label=cert
            )
            axes[1].plot(e, [r["sigma"] for r in rs], marker=marker, label=cert)
        key = f"D={exp['diameter']:g}"
        axes[0].axhline(
            np.mean(exp["nonprivate"][key]), color="k", linestyle="--", linewidth=1, label="non-private"
        )
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("epochs (T = epochs x ceil(n/b))")
        axes[0].set_ylabel("test accuracy of the last iterate")
        axes[1].set_yscale("log")
        axes[1].set_ylabel("calibrated sigma at (eps, delta) = (1, 1e-5)")
        axes[0].set_title("Fashion-MNIST T-shirt/top vs Pullover")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def _verdict(exp: dict[str, Any]) -> str:
    """Which certification gives the better final model at the budget: at equal T, and best over T (a
    difference within one standard deviation over seeds is called a tie)."""
    rows = exp["rows"]
    by = {(r["certification"], r["epochs"]): r for r in rows}

    def cmp(a: dict[str, Any], b: dict[str, Any]) -> str:
        gap = a["mean"] - b["mean"]
        if abs(gap) <= max(a["std"], b["std"]):
            return "tie (within one std)"
        return "last iterate better" if gap > 0 else "composition better"

    same = sorted(e for (c, e) in by if c == "composition" and ("last_iterate", e) in by)
    best = {
        c: max((r for r in rows if r["certification"] == c), key=lambda r: r["mean"]) for c in CERTIFICATIONS
    }
    li, comp = best["last_iterate"], best["composition"]
    parts = [
        "At equal T: "
        + "; ".join(
            f"{e} epoch{'s' if e > 1 else ''}: {by[('last_iterate', e)]['mean']:.4f} (last iterate, sigma "
            f"{by[('last_iterate', e)]['sigma']:.4g}) vs {by[('composition', e)]['mean']:.4f} (composition, sigma "
            f"{by[('composition', e)]['sigma']:.4g}): {cmp(by[('last_iterate', e)], by[('composition', e)])}"
            for e in same
        )
        + ".",
        "Best over T: "
        + "; ".join(
            f"{c}: {r['mean']:.4f} +- {r['std']:.4f} at {r['epochs']} epoch{'s' if r['epochs'] > 1 else ''}"
            for c, r in best.items()
        )
        + f"; last iterate vs composition: **{cmp(li, comp)}**.",
    ]
    return "\n\n".join(parts)


def _why(exp: dict[str, Any]) -> str:
    """The mechanism behind the table, with its numbers."""
    comp = sorted((r for r in exp["rows"] if r["certification"] == "composition"), key=lambda r: r["epochs"])
    li = sorted((r for r in exp["rows"] if r["certification"] == "last_iterate"), key=lambda r: r["epochs"])
    c = exp["contraction"]
    key = f"D={exp['diameter']:g}"
    b_li, b_comp = max(li, key=lambda r: r["mean"]), max(comp, key=lambda r: r["mean"])
    tie = abs(b_li["mean"] - b_comp["mean"]) <= max(b_li["std"], b_comp["std"])
    return (
        f"Reading: with c = {c:.4f} the iteration forgets its start within about 1/(1 - c) = {1 / (1 - c):.0f} "
        f"steps, so the final iterate is near its stationary accuracy after one epoch (non-private: "
        f"{np.mean(exp['nonprivate_1_epoch']):.4f} after 1 epoch vs {np.mean(exp['nonprivate'][key]):.4f} after "
        f"{exp['nonprivate_epochs']}), and the accuracy is then set by sigma. Composition must raise sigma with T "
        f"({comp[0]['sigma']:.4g} at {comp[0]['epochs']} epoch to {comp[-1]['sigma']:.4g} at {comp[-1]['epochs']} "
        f"epochs) and loses accuracy; the last-iterate certification keeps sigma flat after its burn-in "
        f"({li[-1]['sigma']:.4g} from {min(r['epochs'] for r in li if r['sigma'] == li[-1]['sigma'])} epochs on), "
        "so T can be chosen freely at no privacy cost. "
        + (
            "On this task, though, extra iterations buy no accuracy, so the best model over T is about as good "
            "under either certification; the gain is robustness to the choice of T (and, with the conservative "
            "variant, it survives the correction of section (c))."
            if tie
            else "The best model over T differs between the certifications (see above)."
        )
    )


def _section_b_md(exp: dict[str, Any], header: str) -> str:
    c = exp["constants"]
    table = md_table(
        [
            "certification",
            "T (steps)",
            "epochs",
            "sigma",
            "b sigma/(2L)",
            "eps last_iterate",
            "eps composition (rdp)",
            "eps conservative",
            f"test accuracy (mean +- std, {len(exp['seeds'])} seed{'s' if len(exp['seeds']) > 1 else ''})",
            "ms/step (incl. setup)",
        ],
        [
            [
                r["certification"],
                f"{r['steps']:,}",
                r["epochs"],
                f"{r['sigma']:.5f}",
                f"{r['noise_multiplier']:.3f}",
                f"{r['eps_last_iterate']:.4f}",
                f"{r['eps_composition']:.4f}",
                f"{r['eps_conservative']:.4f}",
                f"{r['mean']:.4f} +- {r['std']:.4f}",
                f"{r['ms_per_step']:.2f}",
            ]
            for r in exp["rows"]
        ],
    )
    ref_rows = [
        [
            f"projected SGD, sigma = 1e-12, {k}, {exp['nonprivate_epochs']} epochs",
            f"{np.mean(v):.4f} +- {np.std(v):.4f}",
        ]
        for k, v in exp["nonprivate"].items()
    ]
    burn = exp["burn_in_sigma_0.02"]
    parts = [
        f"{header}:",
        f"Task: Fashion-MNIST **{CLASS_NAMES[NEGATIVE_CLASS]} ({NEGATIVE_CLASS}) vs {CLASS_NAMES[POSITIVE_CLASS]} "
        f"({POSITIVE_CLASS})**, label 1 = Pullover; n = {exp['n']:,} training examples"
        + (" (QUICK: the first 1000 of each class)" if exp["quick"] else " (all of both classes)")
        + f", all {exp['test_size']:,} test examples of the two classes. Why this pair: T-shirt/top vs Trouser is "
        "nearly separable (no room to see differences); in a pilot (non-private projected SGD, 20 epochs, D = 10, "
        "b = 64, this feature scaling) Pullover vs Coat reached 0.72 and T-shirt/top vs Shirt 0.80, so the noise "
        "effects drown in a weak model, while T-shirt/top vs Pullover reached 0.95: decent, not perfect.",
        f'Model: `ConvexGLM("logistic", feature_norm=1, fit_bias=True, l2={exp["l2"]:g})`: features flattened '
        f"(d = {exp['dim']} with the bias) and rescaled per example to norm <= 1, so L = sqrt(2) = {c['L']:.4f} "
        f"(of the unregularized loss, Sec 5.4), M = 2/4 + l2 = {c['M']:.4g}, m = l2 = {c['m']:g}. Domain K: the ball "
        f"of diameter D = {exp['diameter']:g} around 0 (w_0 = 0). Batch b = {exp['batch_size']} drawn uniformly "
        f"without replacement each step (eq 3.1), one epoch = ceil(n/b) = {exp['epoch_steps']} steps. Step size "
        f"eta = 2/(M + m) = {exp['learning_rate']:.4f} (< 2/M; it minimizes the contraction "
        f"c = max(|1 - eta m|, |1 - eta M|) = {exp['contraction']:.4f}, App. B.3). Replace adjacency, Delta = 2L.",
        "Certifications, each at (eps, delta) = (1, 1e-5): **composition**: `calibrate_noise(1, 1e-5, ledger_for, "
        '"rdp")` on the run\'s ledger (every step a Gaussian on the averaged gradient, noise multiplier '
        "b sigma/(2L), sampled without replacement: dp_accounting's RDP accountant), the only CERTIFIED one; "
        "**last_iterate**: the paper's bound as published ((B.3), since m = l2 > 0, with Def 2.10's direction of "
        "S, which section (c) shows can fail), calibrated by bisection; **conservative**: dptrain's `last_iterate` "
        "accountant, (B.3) with the dominating per-step direction (max of both), calibrated by bisection: "
        "reported, NOT certified (the paper's coupling argument is not re-proven for both orderings). The eps "
        "columns apply the three to the ledger the trainer recorded (identical for every seed).",
        "**Only the composition rows are private guarantees.** The last_iterate and conservative rows show what "
        "the last-iterate analyses would allow; comparisons with them below are about that analysis, not about a "
        "certified budget (the 1-epoch last_iterate row, certified 83.8 by composition, is the defect of section "
        "(c) at work).",
        table,
        "Non-private reference (same model, eta, b and projection):",
        md_table(["run", "test accuracy"], ref_rows),
        _verdict(exp),
        _why(exp),
        "**Only the last iterate is released**: `ProjectedNoisySGD.train()` returns w_T alone, and every accuracy "
        "above is computed from that final model on the test set; no intermediate iterate, average or training "
        "loss is used or reported.",
        f"Why the last-iterate bound pays off here: with m = l2 = {exp['l2']:g} and eta = 2/(M + m) the "
        f"contraction c = {exp['contraction']:.4f} makes (B.3) saturate after "
        f"{burn['strongly_convex']:,} steps (burn-in of `last_iterate_report` at sigma = 0.02, i.e. "
        f"{burn['strongly_convex'] / exp['epoch_steps']:.1f} epochs). Declaring the loss merely convex (m = 0, a "
        f"weaker but valid assumption) the burn-in is {burn['convex_only']:,} steps "
        f"({burn['convex_only'] / exp['epoch_steps']:.0f} epochs, about D n/(L eta), Thm 3.1): at 100 epochs and "
        f"sigma = 0.02 the convex reading certifies eps = {burn['convex_only_epsilon']:.3f} against "
        f"{burn['strongly_convex_epsilon']:.3f} with m = l2. So in this experiment the gain comes from the "
        "strongly convex analysis (Sec 5.1), not from the diameter argument of Thm 3.1.",
    ]
    if exp["diameter_sweep"]:
        parts += [
            "Diameter sweep (100 epochs, last-iterate certifications; same eta, b, l2; the non-private column is "
            "projected SGD with sigma = 1e-12 for 20 epochs in the same ball):",
            md_table(
                ["D", "certification", "sigma", "test accuracy", "non-private, same D"],
                [
                    [
                        f"{r['diameter']:g}",
                        r["certification"],
                        f"{r['sigma']:.5f}",
                        f"{r['mean']:.4f} +- {r['std']:.4f}",
                        f"{r['nonprivate']:.4f}",
                    ]
                    for r in exp["diameter_sweep"]
                ],
            ),
        ]
    parts.append("See `training.png`.")
    return "\n\n".join(parts)


def _section_c_md(exp: dict[str, Any], header: str) -> str:
    s = exp["soundness"]
    comp1 = min((r for r in exp["rows"] if r["certification"] == "composition"), key=lambda r: r["epochs"])
    rows = [
        [
            f"{r['sigma']:g}",
            f"{r['noise_multiplier']:.3f}",
            f"{r['eps_last_iterate']:.4f}",
            f"{r['delta_lower_at_eps_last_iterate']:.3e}",
            f"{r['delta_lower_at_eps_1']:.3e}",
            f"{r['eps_rdp']:.3f}",
            f"{r['eps_conservative']:.3f}",
        ]
        for r in s["rows"]
    ]
    verdict = (
        "**The certificate is violated**: the lower bound on the true delta at the certified eps exceeds "
        f"delta = {DELTA:g}."
        if s["violated"]
        else "No violation found on this pair."
    )
    return "\n\n".join(
        [
            f"{header}:",
            "Def 2.10 (and hence the paper's (B.2)/(B.3)) uses S_alpha(q, s) = "
            "D_alpha(N(0, s^2) || (1-q) N(0, s^2) + q N(1, s^2)), the direction with the pure Gaussian first "
            "(digest 4.1). That direction is bounded by log(1/(1-q)) for every s, because the mixture is at least "
            "(1-q) N(0, s^2); so for small noise the accountant's per-step cost stops depending on sigma. RDP "
            "(Def 2.4) must hold for both orderings of a neighbouring pair, and the reverse direction "
            "D_alpha(mixture || N(0)) grows without bound as s -> 0.",
            f"Explicit check, T = 1 with the constants of section (b) (n = {exp['n']:,}, b = {exp['batch_size']}, "
            f"q = {s['q']:.4f}, L = sqrt(2), D = {exp['diameter']:g}, eta = {exp['learning_rate']:.4f}, "
            f"m = {exp['l2']:g}), in d = 1: F_i(w) = (l2/2) w^2 for every i vs. the same with F_i*(w) = L w + "
            "(l2/2) w^2 (convex, the unregularized part L-Lipschitz and 0-smooth, so every assumption of the "
            "ledger holds). The released w_1 = Proj_K[-eta (G + Z)] is N(0, eta^2 sigma^2) under one dataset and "
            "the mixture with probability q of the shift eta L/b under the other; threshold events give a lower "
            "bound on the true delta(eps) (Def 2.2):",
            md_table(
                [
                    "sigma",
                    "b sigma/L",
                    "eps by the paper's bound (Def 2.10 direction)",
                    "true delta at that eps >=",
                    "true delta at eps = 1 >=",
                    "eps (rdp accountant)",
                    "eps (dptrain last_iterate, dominating direction)",
                ],
                rows,
            ),
            verdict
            + f" The same defect shows in section (b) below the burn-in, where the last-iterate bound is the "
            f"composition branch in the paper's direction: the composition-calibrated {comp1['epochs']}-epoch run "
            f"(dp_accounting: eps = {comp1['eps_composition']:.3f}) gets eps = "
            f"{comp1['eps_last_iterate']:.3f} from the paper's bound, a gap due only to the direction of S."
            + " The `rdp` accountant (dp_accounting, both directions) and dptrain's `last_iterate` accountant, which "
            "takes the dominating direction D_alpha(mixture || N(0)) >= S_alpha per step (digest 7 item 3), do not "
            "give these runs a small epsilon. Using the dominating direction fixes this one defect; it is not a "
            "proof. The paper's coupling (Sec. 3.2) must be re-checked for both orderings before the last-iterate "
            "bound can certify anything, so dptrain reports it as NOT certified. In Example A (section (a), b sigma/(2L) "
            "= 20) the two directions differ by 0.04% (S_8 = 1.001027e-6 vs 1.001400e-6), which is why the "
            "reference values are unaffected; in section (b) the noise multipliers are ~1, where they differ by "
            "orders of magnitude.",
        ]
    )


# --- driver -------------------------------------------------------------------------------------------------


def run(out_dir: str | Path, quick: bool = False) -> Path:
    """Run the reproduction into ``out_dir`` (created if needed); returns the path of ``last_iterate.md``.
    ``quick``: section (a) on 8 values of T up to 10^5; section (b) on 2000 training examples, one seed, T of 1
    and 5 epochs, no diameter sweep."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = f"dptrain reproduce last-iterate --out {out}" + (" --quick" if quick else "")
    header = f"Produced by `{command}`"
    start = time.perf_counter()
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    cv = curves(quick)
    _plot_curves(cv, out / "epsilon_vs_T.png")
    timings["a"] = time.perf_counter() - t0

    with single_thread():  # a 785-parameter model
        t0 = time.perf_counter()
        exp = training_experiment(quick)
        _plot_training(exp, out / "training.png")
        timings["b"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - start

    mode = "QUICK mode (reduced grid and experiment; not the reported results)" if quick else "full run"
    md = (
        "\n\n".join(
            [
                "# Privacy of noisy SGD: more iterations without more privacy loss (seed 003): reproduction",
                f"{header} ({mode}). Wall time {timings['total']:.0f} s (a: {timings['a']:.1f} s, "
                f"b + c: {timings['b']:.0f} s). All numbers are in `last_iterate.json`.",
                "## (a) Epsilon vs T: last-iterate bound vs composition",
                _section_a_md(cv, header),
                "## (b) Logistic regression at (eps, delta) = (1, 1e-5): composition vs last-iterate certification",
                _section_b_md(exp, header),
                "## (c) Soundness check of the S_alpha direction",
                _section_c_md(exp, header),
            ]
        )
        + "\n"
    )
    report = out / REPORT
    report.write_text(md)
    payload = {
        "command": command,
        "quick": quick,
        "timings_s": timings,
        "curves": cv,
        "training": exp,
    }
    (out / DATA_JSON).write_text(json.dumps(payload, indent=1, default=json_default))
    return report
