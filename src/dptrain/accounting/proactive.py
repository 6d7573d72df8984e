"""Proactive DP (van Dijk, Nguyen, Nguyen, Nguyen, Nguyen, "Proactive DP: A Multiple Target
Optimization Framework for DP-SGD"): a closed-form (eps, delta) guarantee for Poisson-sampled DP-SGD
and the calculators that choose sigma, batch size and rounds *before* training.

Notation (paper Sec. 3.1 / Thm B.4): N data set size, T rounds, s_i expected batch size of round i
(Poisson rate q_i = s_i/N), K = sum_i s_i, k = K/N (epochs), s_bar = K/T, theta = s_max/s_bar.

Where the paper is inconsistent (docs/proactive.md, "Our choices where the paper is inconsistent"), the
default is the certified form and the paper's form is available only with ``paper_compat=True``:
- eq. (39)/(B.3): the first term of gamma's right-hand side is sigma/(1 - a - 2 sqrt(a)) (what
  1/(1 - u0) with u0 = 2 sqrt(a)/(1 - a) gives; the same derivation reproduces the paper's second
  term exactly), where the paper prints sigma/(1 - sqrt(a))^2, which is smaller. paper_compat uses
  the printed form.
- gamma: the default is the smallest solution of gamma >= RHS(gamma) (bisection); the paper's
  iteration from gamma = 2 with its signed stop rule returns the first iterate f(2), which is valid
  but larger (mode "paper"; it reproduces Tables 9-11).
- sigma: eq. (6) sqrt(2 (eps + ln(1/delta)) / eps). The experiment tables 3-8 use
  sqrt(2 ln(1/delta)/eps) (no "+eps"), which is NOT certified by the paper's theorem; it is only
  reachable through ``sigma_from_eps(..., paper_compat=True)``.

Pure numpy/scipy: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import dp_accounting as dpa
import numpy as np

from dptrain.accounting.base import PrivacyReport, check_delta, register_accountant
from dptrain.accounting.ledger import Ledger
from dptrain.accounting.standard import no_finite_epsilon, refuse_search
from dptrain.errors import AccountingError

E = math.e
GAMMA_MODES = ("fixed_point", "paper")


# --- closed forms -----------------------------------------------------------------------------------------


def sigma_from_eps(eps: float, delta: float, paper_compat: bool = False) -> float:
    """Eq. (6)/(35): sigma = sqrt(2 (eps + ln(1/delta)) / eps), rounded up to the float whose eps by
    :func:`eps_from_sigma` is <= ``eps`` (a plan at equality is then certified within its budget, not 1 ulp over).

    ``paper_compat=True`` gives the experiment tables' sqrt(2 ln(1/delta)/eps) (no "+eps"), which the
    paper's theorem does not certify; use it only to reproduce Tables 3-8."""
    _positive("eps", eps)
    check_delta(delta)
    if paper_compat:
        return math.sqrt(2 * math.log(1 / delta) / eps)
    sigma = math.sqrt(2 * (eps + math.log(1 / delta)) / eps)
    while eps_from_sigma(sigma, delta) > eps:
        sigma = math.nextafter(sigma, math.inf)
    return sigma


def eps_from_sigma(sigma: float, delta: float) -> float:
    """Inverse of eq. (6) (written out in App. D.4 step 1): eps = 2 ln(1/delta) / (sigma^2 - 2)."""
    check_delta(delta)
    _check_sigma(sigma)
    return 2 * math.log(1 / delta) / (sigma**2 - 2)


def _check_sigma(sigma: float) -> None:
    """Eq. (6) has a finite eps only for sigma^2 > 2: below, the noise is too small for the closed form."""
    if not sigma**2 > 2:
        raise no_finite_epsilon("the proactive closed form", f"it needs sigma^2 > 2, got sigma = {sigma:g}")


def h(x: float) -> float:
    """Thm B.4 (eq. (54)): h(x) = (sqrt(1 + (e/x)^2) - e/x)^2."""
    r = E / x
    return (math.sqrt(1 + r * r) - r) ** 2


def g(x: float) -> float:
    """Thm B.4: g(x) = min{1/(e x), h(x)}."""
    return min(1 / (E * x), h(x))


def gamma_rhs(gamma: float, eps: float, k: float, sigma: float, paper_compat: bool = False) -> float:
    """Right-hand side of the fixed-point inequality for gamma, Thm B.4 / Thm 3.1 (B.3), with
    a = alpha_bar = eps/(gamma k) (eq. (50)). Returns +inf outside the domain where the bound is defined
    (a < 1, sigma (1 - a) - 2 e sqrt(a) > 0, and for the certified form 1 - a - 2 sqrt(a) > 0)."""
    a = eps / (gamma * k)
    ra = math.sqrt(a)
    first_den = (1 - ra) ** 2 if paper_compat else 1 - a - 2 * ra
    second_den = sigma * (1 - a) - 2 * E * ra
    if a >= 1 or first_den <= 0 or second_den <= 0:
        return math.inf
    inner = sigma / first_den + E**3 / (sigma * second_den)
    return 2 / (1 - a) + (16 * a / (1 - a)) * inner * math.exp(3 / sigma**2)


def solve_gamma(
    eps: float, k: float, sigma: float, mode: str = "fixed_point", paper_compat: bool = False
) -> float:
    """gamma of Thm B.4: the smallest gamma with gamma >= RHS(gamma) (``fixed_point``, bisection; RHS is
    decreasing in gamma so the solutions form [gamma*, inf)), or the paper's iteration (``paper``, App. D.4
    steps 2-4: start at 2, iterate gamma <- RHS(gamma) until gamma_new - gamma <= 1e-4 gamma, signed, which
    stops at the first decrease and returns the first iterate RHS(2): valid, not smallest).
    ``mode="paper"`` always uses the paper's printed (B.3)."""
    _positive("eps", eps)
    _positive("k", k)
    return _gamma(
        lambda gm, pc: gamma_rhs(gm, eps, k, sigma, pc),
        mode,
        paper_compat,
        f"eps={eps:g}, k={k:g}, sigma={sigma:g}",
    )


def _gamma(rhs, mode: str, paper_compat: bool, what: str) -> float:
    """Solve gamma >= rhs(gamma, paper_compat) by ``mode`` (see :func:`solve_gamma`); ``what`` names the case."""
    if mode == "paper":
        gamma = 2.0
        for _ in range(10_000):
            new = rhs(gamma, True)
            if not math.isfinite(new):
                raise AccountingError(
                    f"gamma is undefined at gamma={gamma:g} for {what} (a = eps/(gamma k) "
                    "outside the domain of (B.3))"
                )
            if new - gamma <= 1e-4 * gamma:
                return gamma
            gamma = new
        raise AccountingError("the paper's gamma iteration did not stop")
    if mode != "fixed_point":
        raise AccountingError(f"unknown gamma mode {mode!r}; accepted: {', '.join(GAMMA_MODES)}")

    return _smallest_true(
        lambda gm: gm >= rhs(gm, paper_compat), 2.0, 1e12, f"no gamma satisfies (B.3) for {what}"
    )


# --- condition checks -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    name: str  # e.g. "(34)"
    holds: bool
    detail: str  # the inequality with the numbers plugged in


@dataclass(frozen=True)
class ConditionReport:
    theorem: str
    conditions: tuple[Condition, ...]
    values: dict[str, float] = field(default_factory=dict)

    @property
    def holds(self) -> bool:
        return all(c.holds for c in self.conditions)

    @property
    def failed(self) -> list[Condition]:
        return [c for c in self.conditions if not c.holds]

    def explain_failure(self) -> str:
        return "; ".join(f"{c.name} fails: {c.detail}" for c in self.failed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "theorem": self.theorem,
            "holds": self.holds,
            "values": self.values,
            "conditions": [{"name": c.name, "holds": c.holds, "detail": c.detail} for c in self.conditions],
        }


def _cond(name: str, lhs: float, op: str, rhs: float, text: str) -> Condition:
    holds = {"<": lhs < rhs, "<=": lhs <= rhs * (1 + 1e-12), ">=": lhs >= rhs * (1 - 1e-12)}[op]
    return Condition(name, bool(holds), f"{text}: {lhs:.6g} {op} {rhs:.6g}")


def check_theorem_3_1(
    eps: float,
    delta: float,
    sigma: float,
    n: int,
    k: float,
    steps: float,
    theta: float = 1.0,
    gamma: float | None = None,
) -> ConditionReport:
    """Conditions of Thm 3.1: N >= 1e4, theta <= 6.85, eps < 0.5, delta <= 1/N, sigma >= (6), (7), (8)."""
    gamma = solve_gamma(eps, k, sigma) if gamma is None else gamma
    conds = (
        _cond("N >= 1e4", n, ">=", 1e4, "data set size"),
        _cond("theta <= 6.85", theta, "<=", 6.85, "theta = s_max/s_bar"),
        _cond("eps < 0.5", eps, "<", 0.5, "epsilon"),
        _cond("delta <= 1/N", delta, "<=", 1 / n, "delta"),
        _cond("(6)", sigma, ">=", sigma_from_eps(eps, delta), "sigma >= sqrt(2(eps + ln(1/delta))/eps)"),
        _cond(
            "(7)", (2 / E) ** 2 * k**2, ">=", 0.5 + math.log(1 / delta), "(2/e)^2 k^2 >= 1/2 + ln(1/delta)"
        ),
        _cond("(8)", steps, ">=", gamma * theta**2 * k**2 / eps, "T >= gamma theta^2 k^2 / eps"),
    )
    return ConditionReport("Thm 3.1", conds, {"gamma": gamma, "k": k, "theta": theta})


@dataclass(frozen=True)
class SampleSizes:
    """Summary of a sample-size sequence s_0..s_{T-1} (expected batch sizes) over a data set of size N."""

    n: int
    steps: int
    total: float  # K
    s_max: float

    @classmethod
    def of(cls, sizes: Sequence[float] | np.ndarray, n: int) -> SampleSizes:
        s = np.asarray(sizes, dtype=float)
        if s.ndim != 1 or len(s) == 0 or (s <= 0).any() or (s > n).any():
            raise AccountingError(f"sample sizes must be a non-empty sequence in (0, N={n}]")
        return cls(int(n), len(s), float(s.sum()), float(s.max()))

    @classmethod
    def constant(cls, s: float, steps: int, n: int) -> SampleSizes:
        return cls(int(n), int(steps), float(s) * steps, float(s))

    @property
    def k(self) -> float:
        return self.total / self.n

    @property
    def s_bar(self) -> float:
        return self.total / self.steps

    @property
    def theta(self) -> float:
        return self.s_max / self.s_bar


def check_theorem_b4(
    eps: float,
    delta: float,
    sigma: float,
    sizes: SampleSizes,
    gamma_mode: str = "fixed_point",
    paper_compat: bool = False,
) -> ConditionReport:
    """Conditions (32)-(35) of Thm B.4 (valid for any eps > 0, delta > 0)."""
    k, theta, s_bar, n = sizes.k, sizes.theta, sizes.s_bar, sizes.n
    gamma = solve_gamma(eps, k, sigma, gamma_mode, paper_compat)
    x = sigma_from_eps(eps, delta)
    conds = (
        _cond("(32)", s_bar, "<=", g(x) / theta * n, "s_bar <= g(sqrt(2(eps + ln(1/delta))/eps)) N / theta"),
        _cond("(33)", eps, "<=", gamma * h(sigma) * k, "eps <= gamma h(sigma) K/N"),
        _cond("(34)", eps, ">=", gamma * theta**2 * k * s_bar / n, "eps >= gamma theta^2 (K/N)(s_bar/N)"),
        _cond("(35)", sigma, ">=", x, "sigma >= sqrt(2(eps + ln(1/delta))/eps)"),
    )
    return ConditionReport(
        "Thm B.4",
        conds,
        {"gamma": gamma, "k": k, "theta": theta, "s_bar": s_bar, "T_min": gamma * theta**2 * k**2 / eps},
    )


def certify_theorem_b4(sigma: float, delta: float, sizes: SampleSizes) -> tuple[float, ConditionReport]:
    """Smallest eps for which Thm B.4 certifies (eps, delta)-DP for this run, or AccountingError naming the
    conditions that fail. (35) gives eps >= 2 ln(1/delta)/(sigma^2 - 2); (34) gives eps >= gamma(eps)
    theta^2 k s_bar/N, solved by bisection since gamma(eps) grows slower than eps; (32) and (33) are then
    checked at that eps."""
    eps = eps_from_sigma(sigma, delta)
    coef = sizes.theta**2 * sizes.k * sizes.s_bar / sizes.n

    def meets_34(e: float) -> bool:
        try:
            return e >= solve_gamma(e, sizes.k, sigma) * coef
        except AccountingError:
            return False

    eps = _smallest_true(
        meets_34,
        eps,
        1e6,
        "Thm B.4 cannot certify this run: (34) cannot be met (batch too large for the number of rounds)",
    )
    report = check_theorem_b4(eps, delta, sigma, sizes)
    if not report.holds:
        raise AccountingError(f"Thm B.4 cannot certify this run at eps={eps:.6g}: {report.explain_failure()}")
    return eps, report


# --- Thm B.2: general sample-size sequences ---------------------------------------------------------------


def theorem_b2_sigma_min(
    eps: float, delta: float, sizes: Sequence[float], n: int
) -> tuple[float, dict[str, float]]:
    """Thm B.2: the smallest sigma for which the general varying-batch analysis certifies (eps, delta).

    S_hat_j = (1/T) sum_i s_i^j / (N (N - s_i)^{j-1}), rho = S_hat_1 S_hat_3 / S_hat_2^2, rho_hat =
    S_hat_1^2 / S_hat_2, c1 = eps / (T S_hat_1^2), c0 = c(c1) with
    c(x) = min{(sqrt(2 r rho x + 1) - 1)/(r rho x), 2/(rho_hat x)}, and
    sigma >= (2/sqrt(c0)) sqrt(S_hat_2 T (eps + ln(1/delta))) / eps.
    r0 is the smallest allowed, sigma max_i s_i/N (r grows with r0), which must satisfy r0 <= 1/e and
    u0, u1 < 1; sigma must be >= 216/215. Because r0 depends on sigma, the bound is solved as the
    fixed point sigma = bound(sigma) by bisection. Raises AccountingError when no sigma qualifies."""
    s = np.asarray(sizes, dtype=float)
    steps = len(s)
    check_delta(delta)
    s_hat = [float(np.mean(s**j / (n * (n - s) ** (j - 1)))) for j in (1, 2, 3)]
    rho = s_hat[0] * s_hat[2] / s_hat[1] ** 2
    rho_hat = s_hat[0] ** 2 / s_hat[1]
    c1 = eps / (steps * s_hat[0] ** 2)
    q_max = float(s.max()) / n

    def bound(sigma: float) -> float:
        r0 = sigma * q_max
        if r0 > 1 / E or sigma < 216 / 215 or sigma <= r0:
            return math.inf
        u0 = 2 * math.sqrt(r0 * sigma) / (sigma - r0)
        u1 = 2 * E * math.sqrt(r0 * sigma) / ((sigma - r0) * sigma)
        if u0 >= 1 or u1 >= 1:
            return math.inf
        r = r0 * 8 * (1 / (1 - u0) + E**3 / ((1 - u1) * sigma**3)) * math.exp(3 / sigma**2)
        x = r * rho * c1
        c0 = min((math.sqrt(2 * x + 1) - 1) / x, 2 / (rho_hat * c1))
        return (2 / math.sqrt(c0)) * math.sqrt(s_hat[1] * steps * (eps + math.log(1 / delta))) / eps

    # feasible sigma satisfy sigma >= bound(sigma); the bound grows with sigma through r0 only mildly,
    # so scan up from 216/215 on a geometric grid, then bisect down to the smallest feasible point.
    grid = np.geomspace(216 / 215, 1e4, 400)
    feasible = [x for x in grid if x >= bound(x)]
    if not feasible:
        raise AccountingError(
            "Thm B.2 cannot certify this run: no sigma meets its conditions "
            "(r0 = sigma max s_i/N <= 1/e, u0, u1 < 1)"
        )
    hi = feasible[0]
    idx = int(np.searchsorted(grid, hi))
    lo = grid[idx - 1] if idx > 0 else 216 / 215
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if mid >= bound(mid) else (mid, hi)
    return float(hi), {
        "S_hat_1": s_hat[0],
        "S_hat_2": s_hat[1],
        "S_hat_3": s_hat[2],
        "rho": rho,
        "rho_hat": rho_hat,
        "c1": c1,
    }


def certify_theorem_b2(sigma: float, delta: float, sizes: Sequence[float], n: int) -> tuple[float, dict]:
    """Smallest eps certified by Thm B.2 for noise sigma (bisection on eps; the required sigma falls as eps
    grows)."""

    def ok(eps: float) -> bool:
        try:
            return sigma >= theorem_b2_sigma_min(eps, delta, sizes, n)[0]
        except AccountingError:
            return False

    hi = _smallest_true(ok, 1e-6, 1e4, f"Thm B.2 cannot certify this run with sigma={sigma:g}")
    return hi, theorem_b2_sigma_min(hi, delta, sizes, n)[1]


# --- calculators ------------------------------------------------------------------------------------------


def dp_calculator_simple(
    sigma: float,
    n: int,
    k: float,
    theta: float = 1.0,
    gamma_mode: str = "fixed_point",
    delta: float | None = None,
) -> dict[str, Any]:
    """The simplified DP calculator of App. D.4 (based on Thm 3.1): delta = 1/N, eps from (6) inverted,
    gamma, T_min = gamma theta^2 k^2/eps, T_min_asym = theta^2 k^2/(2 eps), s_max = floor(kN/T_min),
    s_max_asym = floor(kN/T_min_asym). ``gamma_mode="paper"`` reproduces Tables 9-11."""
    delta = 1 / n if delta is None else delta
    eps = eps_from_sigma(sigma, delta)
    gamma = solve_gamma(eps, k, sigma, gamma_mode)
    t_min = gamma * theta**2 * k**2 / eps
    t_asym = theta**2 * k**2 / (2 * eps)
    check = check_theorem_3_1(eps, delta, sigma, n, k, t_min, theta, gamma)
    # Thm B.4 has no eps < 0.5 / N >= 1e4 requirements: check it for the plan actually printed (s_max, T).
    s_max = math.floor(k * n / t_min)
    b4 = (
        check_theorem_b4(
            eps, delta, sigma, SampleSizes(n, math.ceil(k * n / s_max), k * n, s_max * theta), gamma_mode
        )
        if s_max >= 1
        else None
    )
    return {
        "epsilon": eps,
        "delta": delta,
        "noise_multiplier": sigma,
        "gamma": gamma,
        "gamma_mode": gamma_mode,
        "theta": theta,
        "k": k,
        "dataset_size": n,
        "T_min": t_min,
        "s_max": math.floor(k * n / t_min),
        "T_min_asym": t_asym,
        "s_max_asym": math.floor(k * n / t_asym),
        "theorem_3_1": check.to_dict(),
        "theorem_b4": b4.to_dict() if b4 is not None else None,
        "certified": check.holds or (b4 is not None and b4.holds),
    }


def certified_batch(
    eps: float,
    delta: float,
    sigma: float,
    n: int,
    k: float,
    s_start: int,
    theta: float = 1.0,
    gamma_mode: str = "fixed_point",
) -> tuple[int, int, ConditionReport]:
    """The largest (mean) batch s <= ``s_start``, run for T = ceil(kN/s) rounds (largest batch theta s), for which
    Thm B.4 certifies (eps, delta), with the conditions checked for that run: (s, T, report).

    Rounding (s down, T up) makes K = sT exceed kN, which raises the right-hand side of (34), gamma theta^2
    (K/N)(s_bar/N), and can break it by a hair (sigma = 6.572, N = 50,000, k = 7: s = 800 misses by 0.07%). So s
    steps down, T up, until every condition holds. Only (32) and (34) improve that way: a failure of (33) or (35)
    is final."""
    report = None
    for s in range(s_start, 0, -1):
        steps = math.ceil(k * n / s - 1e-9)
        report = check_theorem_b4(eps, delta, sigma, SampleSizes(n, steps, s * steps, theta * s), gamma_mode)
        if report.holds:
            return s, steps, report
        if {c.name for c in report.failed} - {"(32)", "(34)"}:
            break
    why = report.explain_failure() if report else "there is no batch size >= 1 to try"
    raise AccountingError(f"Thm B.4 certifies no batch size <= {s_start} at eps = {eps:.6g}: {why}")


def plan_proactive(eps: float, delta: float, n: int, k: float, theta: float = 1.0) -> dict[str, Any]:
    """The pro-active plan for a target budget (Sec. 3.2 steps 1-3, certified by Thm B.4): sigma by (6) at
    equality, gamma at the fixed point, T = ceil(T_min), the largest constant batch s = floor(kN/T) that Thm B.4
    certifies for T = ceil(kN/s) rounds (:func:`certified_batch`)."""
    sigma = sigma_from_eps(eps, delta)
    gamma = solve_gamma(eps, k, sigma)
    t_min = math.ceil(gamma * theta**2 * k**2 / eps - 1e-9)
    s_max = math.floor(k * n / t_min)
    if s_max < 1:
        raise AccountingError(
            f"no batch size meets the budget: T_min = {t_min} rounds exceeds kN = {k * n:g}"
        )
    s, steps, report = certified_batch(eps, delta, sigma, n, k, s_max)
    return {
        "epsilon": eps,
        "delta": delta,
        "noise_multiplier": sigma,
        "gamma": gamma,
        "T_min": steps,
        "s_max": s,
        "sampling_rate": s / n,
        "theorem_b4": report.to_dict(),
        "valid": report.holds,
    }


def dp_calculator_full(
    n: int,
    phase_gradients: float,
    eps_target: float,
    previous: Sequence[tuple[float, int]] = (),
    sigma: float | None = None,
    gamma_mode: str = "fixed_point",
    s_limit: int | None = None,
) -> dict[str, Any]:
    """The full (phased) DP calculator of App. E.1 (based on Thm B.4), for the current phase j with K_j =
    ``phase_gradients`` gradient computations. ``previous`` lists (s_i, T_i) of earlier phases; ``sigma`` is
    the client-chosen sigma_j < sigma_{j-1} for j > 0 (earlier rounds are treated as if they used it).
    Scans s = 1, 2, ... and returns the largest accepted s: (32), (33) hold and eps <= eps_target. Rounds are
    whole (T_j = ceil(K_j/s)), and, unlike the paper's scan, rejected sizes before the first accepted one are
    skipped (in a later phase a small s makes theta = s_max/s_bar large); the scan stops at the first rejection
    after that, as in the paper."""
    delta = 1 / n
    prev_k = sum(s * t for s, t in previous)
    prev_t = sum(t for _, t in previous)
    prev_max = max((s for s, _ in previous), default=0.0)
    best = None
    for s in range(1, (s_limit or n) + 1):
        t_j = math.ceil(
            phase_gradients / s - 1e-9
        )  # whole rounds: the run then computes s * t_j >= K_j gradients
        total_k, total_t = prev_k + s * t_j, prev_t + t_j
        s_bar = total_k / total_t
        theta = max(prev_max, s) / s_bar
        k = total_k / n

        coef34 = theta**2 * s_bar * total_k / n**2  # (34) at equality: eps = gamma * coef34
        try:
            gm = _gamma(
                partial(_e1_rhs, coef34=coef34, k=k, sigma=sigma, delta=delta), gamma_mode, False, f"s={s}"
            )
        except AccountingError:
            break
        eps, sg = _e1_eps_sigma(gm, coef34, sigma, delta)
        sizes = SampleSizes(n, total_t, total_k, max(prev_max, s))
        x = sigma_from_eps(eps, delta)
        accept = (s_bar <= g(x) / theta * n) and (eps <= gm * h(sg) * k) and eps <= eps_target
        if not accept:
            if (
                best is None
            ):  # deviation: in a later phase small s make theta large; skip until one is accepted
                continue
            break
        best = {
            "s": s,
            "T": t_j,
            "epsilon": eps,
            "noise_multiplier": sg,
            "gamma": gm,
            "theta": theta,
            "delta": delta,
            "k": sizes.k,
        }
    if best is None:
        raise AccountingError(f"no batch size meets eps_target={eps_target:g} in this phase (App. E.1)")
    return best


def _e1_eps_sigma(gamma: float, coef34: float, sigma: float | None, delta: float) -> tuple[float, float]:
    """App. E.1 step 3: eps from (34) at equality; phase 0 sets sigma by (35) at equality, a later phase keeps
    its chosen sigma and takes eps = max(eps of (35), eps of (34))."""
    e34 = gamma * coef34
    if sigma is None:
        return e34, sigma_from_eps(e34, delta)
    return max(eps_from_sigma(sigma, delta), e34), sigma


def _e1_rhs(
    gamma: float, paper_compat: bool, *, coef34: float, k: float, sigma: float | None, delta: float
) -> float:
    eps, sg = _e1_eps_sigma(gamma, coef34, sigma, delta)
    return gamma_rhs(gamma, eps, k, sg, paper_compat)


def increasing_sample_sizes(mean: float, steps: int, power: float, n: int) -> np.ndarray:
    """s_i proportional to (i+1)^p with mean ``mean`` (App. B.4 'increasing sample sizes': theta -> 1 + p),
    capped at N."""
    if power < 0:
        raise AccountingError(f"power must be >= 0, got {power}")
    w = np.arange(1, steps + 1, dtype=float) ** power
    return np.minimum(mean * w / w.mean(), n)


# --- the accountant ---------------------------------------------------------------------------------------


def _ledger_sizes(ledger: Ledger) -> tuple[float, int, list[tuple[float, int]]]:
    """(sigma, N, [(s_i, count)]) of a ledger of Poisson-sampled Gaussian DP-SGD steps, or a refusal."""
    if ledger.neighboring != "add_or_remove_one":
        raise AccountingError("the proactive accountant covers add/remove adjacency only (Sec. 2.1)")
    sigmas, sizes, ns = set(), [], set()
    for e in ledger.entries:
        ev = e.event
        if not (isinstance(ev, dpa.PoissonSampledDpEvent) and isinstance(ev.event, dpa.GaussianDpEvent)):
            raise AccountingError(
                f"the proactive accountant covers Poisson-sampled Gaussian DP-SGD steps only "
                f"(App. B.2.1, footnote 14), not {type(ev).__name__}"
            )
        _check_sigma(ev.event.noise_multiplier)
        n = e.facts.get("dataset_size")
        if not n:
            raise AccountingError("the proactive accountant needs the data set size in the ledger facts")
        ns.add(int(n))
        sigmas.add(ev.event.noise_multiplier)
        sizes.append((ev.sampling_probability * n, e.count))
    if not sizes:
        raise AccountingError("the proactive accountant needs at least one step")
    if len(sigmas) != 1 or len(ns) != 1:
        raise AccountingError(
            "the proactive analysis assumes one constant sigma and one data set (Thm B.2/B.4)"
        )
    return sigmas.pop(), ns.pop(), sizes


class ProactiveAccountant:
    name = "proactive"
    description = (
        "closed-form bound of Proactive DP (van Dijk et al.): Thm B.4, Thm B.2 for varying batch sizes"
    )

    def report(self, ledger: Ledger, delta: float) -> PrivacyReport:
        refuse_search(ledger, self.name)
        sigma, n, runs = _ledger_sizes(ledger)
        steps = sum(c for _, c in runs)
        constant = len({s for s, _ in runs}) == 1
        if constant:
            sizes = SampleSizes.constant(runs[0][0], steps, n)
        else:
            sizes = SampleSizes(n, steps, sum(s * c for s, c in runs), max(s for s, _ in runs))
        candidates, refusals = [], []
        try:
            eps, rep = certify_theorem_b4(sigma, delta, sizes)
            candidates.append(
                (
                    eps,
                    {"theorem": "Thm B.4", "gamma": rep.values["gamma"], "theta": sizes.theta, "k": sizes.k},
                )
            )
        except AccountingError as e:
            refusals.append(str(e))
        if not constant:
            seq = np.concatenate([np.full(c, s) for s, c in runs])
            try:
                eps, vals = certify_theorem_b2(sigma, delta, seq, n)
                candidates.append((eps, {"theorem": "Thm B.2", "theta": sizes.theta, "k": sizes.k, **vals}))
            except AccountingError as e:
                refusals.append(str(e))
        if not candidates:
            raise AccountingError("; ".join(refusals))
        eps, details = min(candidates, key=lambda c: c[0])
        return PrivacyReport(float(eps), delta, self.name, True, details)


def _smallest_true(ok, start: float, limit: float, failure: str) -> float:
    """Smallest x >= start with ok(x), for a predicate that is false below some point and true above it:
    doubling to bracket, then bisection to relative precision 1e-12. The returned x always satisfies ok."""
    if ok(start):
        return start
    lo, hi = start, start * 2
    while not ok(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            raise AccountingError(failure)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        if hi - lo <= 1e-12 * hi:
            break
    return hi


def _positive(name: str, v: float) -> None:
    if not (v > 0 and math.isfinite(v)):
        raise AccountingError(f"{name} must be a finite number > 0, got {v}")


register_accountant(ProactiveAccountant())
