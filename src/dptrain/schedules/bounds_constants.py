"""The constants and budget conversions of "On Dynamic Noise Influence in Differential Private Learning" (anonymous
ICLR 2021 submission; "Dynamic Noise Influence"): gamma from kappa (Eq. 2, and for other step sizes), the momentum
contraction (Thm 4.4), alpha (Eq. 2), and the budgets R = 2 rho (Thm 3.1) and (epsilon, delta) (Lemma B.3, with the
minus root that reproduces the paper's App. D example). numpy only."""

from __future__ import annotations

import math

from dptrain.errors import ConfigError
from dptrain.schedules.bounds_inputs import (
    _gamma,
    _kappa,
    _positive,
    _real,
)


def gamma_from_kappa(kappa: float, eta: float = 1.0) -> float:
    """gamma of gradient descent with step size eta/M on an M-smooth, mu-PL loss, kappa = M/mu:
    gamma = 1 - eta (2 - eta)/kappa, in [0, 1). It is the per-step contraction 1 - 2 mu eta_t (1 - M eta_t / 2) of the
    proof of Dynamic Noise Influence, Thm 4.1 (App. C.1), at eta_t = eta/M (derived here). The paper takes eta = 1,
    which gives its gamma = 1 - 1/kappa (Eq. 2); eta in (0, 2)."""
    kappa = _kappa(kappa)
    eta = _real("eta", eta)
    if not 0 < eta < 2:
        raise ConfigError(f"eta={eta!r} is invalid; accepted: a number in (0, 2) (the step size times M)")
    return max(0.0, 1.0 - eta * (2.0 - eta) / kappa)  # eta (2 - eta) <= 1: never below 0 but for rounding


def kappa_from_gamma(gamma: float) -> float:
    """kappa = 1/(1 - gamma) >= 1, the inverse of gamma = 1 - 1/kappa (Dynamic Noise Influence, Eq. 2; eta = 1)."""
    return 1.0 / (1.0 - _gamma(gamma))


def momentum_gamma(kappa: float, eta0: float) -> float:
    """gamma of gradient descent with bias-corrected momentum and step size eta0/(2M): gamma = 1 - eta0/kappa, in
    [0, 1) for eta0 in (0, kappa] (Dynamic Noise Influence, Thm 4.4; rebuilt from a garbled print of its proof)."""
    kappa = _kappa(kappa)
    eta0 = _real("eta0", eta0)
    if not 0 < eta0 <= kappa:
        raise ConfigError(f"eta0={eta0!r} is invalid; accepted: a number in (0, kappa] = (0, {kappa:g}]")
    return max(0.0, 1.0 - eta0 / kappa)


def alpha_constant(*, D: float, G: float, M: float, N: float, R: float, initial_gap: float) -> float:
    """alpha = D G^2 / (2 R M N^2 (f(theta_1) - f(theta*))) (Dynamic Noise Influence, Eq. 2).

    D: parameter dimension; G: per-sample Lipschitz constant (the clip norm when gradients are clipped);
    M: smoothness of the empirical loss; N: number of samples (the batch size n for private SGD, Sec. 4.3,
    with R replaced by R/p^2); R: the paper's budget (R = 2 rho); initial_gap: f(theta_1) - f(theta*) > 0.
    """
    D, G, M, N, R = (_positive(k, v) for k, v in (("D", D), ("G", G), ("M", M), ("N", N), ("R", R)))
    gap = _positive("initial_gap", initial_gap)
    return D * G * G / (2.0 * R * M * N * N * gap)


def R_from_rho(rho: float) -> float:
    """The paper's budget R for a rho-zCDP guarantee: R = 2 rho (Dynamic Noise Influence, Thm 3.1)."""
    return 2.0 * _positive("rho", rho)


def rho_from_R(R: float) -> float:
    """The zCDP parameter of a run that spends the paper's budget R: rho = R/2 (Dynamic Noise Influence, Thm 3.1)."""
    return _positive("R", R) / 2.0


def _delta(delta) -> float:
    v = _real("delta", delta)
    if not (0 < v < 1):
        raise ConfigError(f"delta={delta!r} is invalid; accepted: a number in (0, 1)")
    return v


def R_from_eps_delta(eps: float, delta: float) -> float:
    """The paper's budget R = 2 rho for the largest rho with rho + 2 sqrt(rho ln(1/delta)) <= eps
    (Dynamic Noise Influence, Lemma B.3, solved for rho with the minus root: rho = eps + 2L - 2 sqrt(L (eps + L)),
    L = ln(1/delta); the printed "+" root is a typo). (4, 1e-8) gives rho = 0.1963, R = 0.3927 as in App. D."""
    eps = _positive("eps", eps)
    L = -math.log(_delta(delta))
    # eps + 2L - 2 sqrt(L (eps + L)) = eps^2 / (eps + 2L + 2 sqrt(L (eps + L))), without cancellation
    rho = eps * eps / (eps + 2 * L + 2 * math.sqrt(L * (eps + L)))
    return 2.0 * rho


def eps_from_R(R: float, delta: float) -> float:
    """epsilon of the (epsilon, delta)-DP guarantee implied by spending the paper's budget R (rho = R/2):
    eps = rho + 2 sqrt(rho ln(1/delta)) (Dynamic Noise Influence, Lemma B.3)."""
    rho = _positive("R", R) / 2.0
    return rho + 2.0 * math.sqrt(rho * -math.log(_delta(delta)))
