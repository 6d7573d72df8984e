"""Planning before training: choose sigma, batch size and rounds from a budget (the pro-active workflow of
van Dijk, Nguyen, Nguyen, Nguyen, Nguyen, "Proactive DP: A Multiple Target Optimization Framework for DP-SGD",
Sec. 3.2), side by side for every accountant that applies. Every plan offered is one its accountant certifies.

- ``proactive``: sigma from eq. (6) at equality, gamma at the fixed point of (B.3), T = ceil(T_min) with
  T_min = gamma theta^2 k^2 / eps (eq. (8)), s = floor(kN/T), then s stepped down (T = ceil(kN/s) up) until
  the conditions of Thm B.4 hold for that run (:func:`dptrain.accounting.proactive.certified_batch`).
- ``rdp`` / ``pld`` (and ``gdp``, approximate): with the same sigma, the largest constant expected batch s
  (fewest rounds, T = steps_for_epochs(k, s/N)) whose Poisson-sampled run the accountant certifies within the
  budget.
The tightest valid plan is the one with the largest batch (fewest rounds), which the paper argues gives the
best accuracy for a fixed number of gradient computations K = kN.
"""

from __future__ import annotations

import math
from typing import Any

from dptrain.accounting import RunNumbers, accountant_names, epsilon
from dptrain.accounting.base import check_delta, check_epsilon
from dptrain.accounting.ledger import Ledger
from dptrain.accounting.proactive import certified_batch, dp_calculator_simple, plan_proactive, sigma_from_eps
from dptrain.errors import AccountingError, ConfigError

PLAN_ACCOUNTANTS = ("proactive", "rdp", "pld", "gdp")


def _check(n: int, epochs: float) -> None:
    if not (isinstance(n, int) and n >= 1):
        raise ConfigError(f"--dataset-size must be an integer >= 1, got {n}")
    if not (epochs > 0 and math.isfinite(epochs)):
        raise ConfigError(f"--epochs must be a number > 0, got {epochs}")


def plan_with_accountant(
    eps: float, delta: float, n: int, epochs: float, sigma: float, accountant: str
) -> dict:
    """Largest constant expected batch s (fewest rounds) that ``accountant`` certifies within (eps, delta) at
    noise ``sigma`` for ``epochs`` expected passes over the data; epsilon grows with s here, so binary search
    (every s kept is one whose own ledger was checked)."""

    def spent(s: int) -> float:
        return epsilon(plan_ledger(sigma, n, epochs, s), delta, accountant).epsilon

    if spent(1) > eps:
        raise AccountingError(
            f"even batch size 1 exceeds epsilon={eps:g} with sigma={sigma:.6g} ({accountant})"
        )
    good, bad = 1, n + 1
    while bad - good > 1:
        mid = (good + bad) // 2
        if spent(mid) <= eps:
            good = mid
        else:
            bad = mid
    ledger = plan_ledger(sigma, n, epochs, good)
    report = epsilon(ledger, delta, accountant)
    steps = ledger.releases
    return {
        "accountant": accountant,
        "epsilon": report.epsilon,
        "delta": delta,
        "noise_multiplier": sigma,
        "gamma": None,
        "T_min": steps,
        "s_max": good,
        "sampling_rate": good / n,
        "valid": True,
        "certified": report.certified,
    }


def plan_ledger(sigma: float, n: int, epochs: float, batch: int) -> Ledger:
    """The ledger of a plan: Poisson-sampled steps of expected batch ``batch`` for ``epochs`` expected passes."""
    return RunNumbers.planned("poisson", dataset_size=n, batch_size=batch, epochs=epochs).ledger(sigma)


def plan_budget(
    eps: float,
    delta: float,
    n: int,
    epochs: float,
    theta: float = 1.0,
    accountants: tuple[str, ...] = ("proactive",),
    noise_multiplier: float | None = None,
) -> dict:
    """Plans for a budget with each accountant; ``tightest`` names the certified valid plan with the fewest
    rounds. ``noise_multiplier`` defaults to eq. (6) at equality (the proactive choice)."""
    eps, delta = check_epsilon(eps), check_delta(delta)
    _check(n, epochs)
    if not theta >= 1:
        raise ConfigError(f"--theta must be >= 1 (theta = s_max/s_bar), got {theta}")
    sigma = sigma_from_eps(eps, delta) if noise_multiplier is None else noise_multiplier
    plans, refused = [], {}
    for name in accountants:
        if name not in accountant_names():
            raise ConfigError(f"unknown accountant {name!r}; accepted: {', '.join(PLAN_ACCOUNTANTS)}")
        try:
            if name == "proactive":
                if noise_multiplier is not None and not math.isclose(
                    noise_multiplier, sigma_from_eps(eps, delta)
                ):
                    raise AccountingError("the proactive plan sets sigma by eq. (6); omit --noise-multiplier")
                p = plan_proactive(eps, delta, n, epochs, theta)
                p.update(accountant="proactive", certified=True)
                plans.append(p)
            else:
                plans.append(plan_with_accountant(eps, delta, n, epochs, sigma, name))
        except AccountingError as e:
            refused[name] = str(e)
    for p in plans:
        p.update(dataset_size=n, epochs=epochs, theta=theta if p["accountant"] == "proactive" else 1.0)
    usable = [p for p in plans if p["valid"] and p["certified"]]
    tightest = max(usable, key=lambda p: (p["s_max"], -p["T_min"]))["accountant"] if usable else None
    return {"plans": plans, "refused": refused, "tightest": tightest}


def plan_from_sigma(
    sigma: float, n: int, epochs: float, theta: float = 1.0, gamma: str = "fixed_point"
) -> dict:
    """The D.4 calculator (delta = 1/N): eps, gamma, T_min, s_max, T_min_asym, s_max_asym for a chosen sigma,
    where the plan offered, (s_max, T_min), is the one Thm B.4 certifies: the calculator's s_max = floor(kN/T_min)
    stepped down until the conditions hold for T_min = ceil(kN/s_max) whole rounds. ``T_min_theorem`` keeps
    gamma theta^2 k^2/eps itself."""
    _check(n, epochs)
    calc = dp_calculator_simple(sigma, n, epochs, theta, gamma)
    if calc["s_max"] < 1:
        return calc  # no plan: more rounds than gradient computations
    s, steps, report = certified_batch(
        calc["epsilon"], calc["delta"], sigma, n, epochs, calc["s_max"], theta, gamma
    )
    return {
        **calc,
        "T_min_theorem": calc["T_min"],
        "T_min": steps,
        "s_max": s,
        "theorem_b4": report.to_dict(),
        "certified": True,
    }


def plan_to_overrides(plan: dict[str, Any]) -> list[str]:
    """``--set`` assignments that make ``dptrain train`` run exactly a plan (noise, batch, rounds, delta)."""
    try:
        return [
            f"privacy.noise_multiplier={float(plan['noise_multiplier'])!r}",
            f"privacy.delta={float(plan['delta'])!r}",
            f'privacy.accountant="{plan["accountant"]}"',
            'privacy.sampling="poisson"',
            f"training.batch_size={int(plan['s_max'])}",
            f"training.steps={int(plan['T_min'])}",
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"not a dptrain plan (missing or bad key {e}); make one with dptrain plan --json"
        ) from None
