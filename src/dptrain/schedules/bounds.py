"""Utility bounds of "On Dynamic Noise Influence in Differential Private Learning" (anonymous ICLR 2021
submission; cited below as "Dynamic Noise Influence"): the expected-risk upper bound (ERUB) of private gradient
descent (PGD) under a per-step noise schedule sigma_t, the step count T that minimises it, and the optimal
allocation of a privacy budget over the steps, and the influences q_t those rest on. numpy only (no torch, no scipy).
This module is the one place where the paper's formulas live: :mod:`dptrain.schedules.kinds` builds its schedule
shapes from the influences and the allocation here.

The formulas live in one module an idea, and this module gathers their public names:
:mod:`dptrain.schedules.bounds_constants` (constants and budget conversions), :mod:`dptrain.schedules.bounds_gd`
(gradient descent: Thm 4.1, the uniform schedule of Thm 4.2, Lemma 4.1's allocation, the GD-optimal schedule of
Thm 4.3), :mod:`dptrain.schedules.bounds_momentum` (momentum: Thms 4.4-4.6, Lemma B.7), and
:mod:`dptrain.schedules.bounds_inputs` (the input checks they share).

Setting (Dynamic Noise Influence, Sec. 3 and Eq. 1). Per-sample losses are G-Lipschitz, the empirical loss f is
M-smooth and satisfies the Polyak-Lojasiewicz condition with constant mu. Step t releases
``g_t = grad_t + sigma_t * G * nu_t / N`` with ``nu_t ~ N(0, I_D)``, so ``sigma_t`` multiplies the sensitivity G/N of
the mean gradient. The quantities used throughout are (Dynamic Noise Influence, Eq. 2)::

    kappa = M / mu >= 1,    gamma = 1 - 1/kappa in [0, 1),
    alpha = D G^2 / (2 R M N^2 (f(theta_1) - f(theta*)))          (dimensionless, > 0)

ERUB is the bound on E f(theta_{T+1}) - f(theta*) divided by the initial gap f(theta_1) - f(theta*): 1 means
"no better than not training". Everything "optimal" here minimises this *upper bound*, not the true loss.

The ERUB functions take kappa and use the paper's step size eta = 1/M (gamma = 1 - 1/kappa). The influences take
gamma itself, so they serve any step size: :func:`gamma_from_kappa` gives gamma for the step eta/M, and
:func:`momentum_gamma` gives the momentum contraction of Thm 4.4. Each influence has a log-space form
(``log_gd_influence``, ``log_momentum_influence``, ``log_momentum_influence_two_exp``, and :func:`optimal_log_shares`
for Lemma 4.1) for long runs, where gamma^(T - t) leaves the floating-point range. The linear forms are their
exponentials.

Budget convention (Dynamic Noise Influence, Thm 3.1 and Lemma B.2). The paper's budget ``R`` charges step t
``1/sigma_t^2`` and requires ``sum_t 1/sigma_t^2 <= R``. A Gaussian release with multiplier sigma is
``1/(2 sigma^2)``-zCDP, so a run that spends R is ``rho``-zCDP with **R = 2 rho**. Every function here takes the
paper's ``R``; use :func:`R_from_rho` / :func:`rho_from_R` or :func:`R_from_eps_delta` to convert.
:func:`R_from_eps_delta` inverts the paper's Lemma B.3 with the minus root. The paper prints "+", which is the
wrong root: only "-" reproduces its own numbers, (epsilon, delta) = (4, 1e-8) -> rho = 0.1963 and R = 0.3927 (App. D).

Readings and choices where the paper's print is garbled or uncertain (each is a keyword parameter or is
documented where it is used):

- Thm 4.6 constant c1 defaults to ``2 / (gamma (gamma - beta^2))``. This is rebuilt from a garbled print of
  the proof in App. C.2.
- Thm 4.6 constant c2 is printed only as "some positive constant" plus a garbled formula. It defaults to
  ``gamma^T_hat / (gamma - beta^2)``. This is our derived reading: the smallest constant for which the main-text form
  ``gamma^(T_hat - 1) c2 gamma^(T - t)`` bounds the proof's term
  ``gamma^(2(T_hat - 1)) (gamma^(T + 1 - t) - beta^(2(T + 1 - t))) / (gamma - beta^2)`` for all t > T_hat.
- Thm 4.4 prints "beta = gamma" as an assumption. It is read as beta != gamma (Thm 4.6 assumes beta < gamma).
  The momentum step size is read as eta_t = eta0 / (2M) with contraction gamma = 1 - eta0/kappa. Both are
  rebuilt from a garbled print.
- Lemma 4.1 / Eq. 25: the gap between the uniform and the optimal noise term is ``T^2 Var_t[sqrt(q_t)]``. This
  uses the population variance of sqrt(q_t), as the lemma's wording and the algebra require. The printed
  "Var[q_t]" is a typo.
- Eq. 7 also prints T in a garbled "2 kappa ln(1 + ...)" form. That form is only an upper bound on T. The exact
  continuous minimiser of Eq. 26 is used instead.

Known inconsistencies in the paper, not reproduced: Eq. 23's T tends to 1/alpha (not to 0) as kappa -> infinity.
Eq. 23 is a rate device, not the minimiser of Eq. 21 (kappa=10, alpha=1e-3: T = 44.29, ERUB 0.448, while the
integer argmin is T = 21 with ERUB 0.296). Both are returned. The example "beta = 0.9, gamma = 0.99 gives eta0 <=
0.98/M" under Thm 4.4 contradicts the printed condition, which gives eta0 <= 0.003014 (:func:`momentum_eta0_max`).
"""

from __future__ import annotations

from dptrain.schedules.bounds_constants import (
    R_from_eps_delta,
    R_from_rho,
    alpha_constant,
    eps_from_R,
    gamma_from_kappa,
    kappa_from_gamma,
    momentum_gamma,
    rho_from_R,
)
from dptrain.schedules.bounds_gd import (
    Allocation,
    bound_summary,
    dynamic_T_argmin,
    dynamic_T_continuous,
    erub_dynamic,
    erub_gd,
    erub_gd_from_shares,
    erub_uniform,
    gd_influence,
    gd_optimal_sigma,
    log_gd_influence,
    noise_term,
    optimal_allocation,
    optimal_log_shares,
    uniform_T_argmin,
    uniform_T_paper,
)
from dptrain.schedules.bounds_momentum import (
    erub_momentum,
    log_momentum_influence,
    log_momentum_influence_two_exp,
    momentum_eta0_max,
    momentum_influence,
    momentum_influence_two_exp,
    momentum_T_hat,
    momentum_U3,
)

__all__ = [
    "Allocation",
    "R_from_eps_delta",
    "R_from_rho",
    "alpha_constant",
    "bound_summary",
    "dynamic_T_argmin",
    "dynamic_T_continuous",
    "eps_from_R",
    "erub_dynamic",
    "erub_gd",
    "erub_gd_from_shares",
    "erub_momentum",
    "erub_uniform",
    "gamma_from_kappa",
    "gd_influence",
    "gd_optimal_sigma",
    "kappa_from_gamma",
    "log_gd_influence",
    "log_momentum_influence",
    "log_momentum_influence_two_exp",
    "momentum_T_hat",
    "momentum_U3",
    "momentum_eta0_max",
    "momentum_gamma",
    "momentum_influence",
    "momentum_influence_two_exp",
    "noise_term",
    "optimal_allocation",
    "optimal_log_shares",
    "rho_from_R",
    "uniform_T_argmin",
    "uniform_T_paper",
]
