"""Sections (c) and (d) of the reproduction of "Proactive DP: A Multiple Target Optimization Framework for DP-SGD"
(van Dijk et al.; docs/proactive.md): the logistic-regression experiment (Table 3 / Fig. 1 in spirit: accuracy
against the batch size s at a fixed budget K = kN, step size eta_t = eta0/(1 + beta sqrt(t)) of Sec. 4.1) and the
utility graph of Sec. 3.3 on the same task."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from dptrain.accounting import epsilon
from dptrain.accounting.proactive import dp_calculator_simple
from dptrain.engine.api import make_private
from dptrain.errors import AccountingError
from dptrain.proactive.planner import plan_from_sigma
from dptrain.reproduce import fashion_mnist
from dptrain.reproduce.proactive_setup import (
    EXPERIMENT,
    NEGATIVE_CLASS,
    POSITIVE_CLASS,
    Scale,
)


def _binary_subset(split, n: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The examples of the two classes, label 1 for POSITIVE_CLASS; with ``n``, the first n/2 of each class in
    file order (deterministic, balanced)."""
    parts = []
    for c in (NEGATIVE_CLASS, POSITIVE_CLASS):
        idx = (split.y == c).nonzero().squeeze(1)
        parts.append(idx if n is None else idx[: n // 2])
    idx = torch.cat(parts).sort().values
    return split.x[idx], (split.y[idx] == POSITIVE_CLASS).long()


def _step_size_factor(s: float, beta: float):
    """LambdaLR factor of round i: eta_t/eta0 = 1/(1 + beta sqrt(t)) with t = i s samples processed (Sec. 4.1,
    Tables 1-2: round i uses the schedule at t = sum_{j<i} s_j)."""
    return lambda i: 1.0 / (1.0 + beta * math.sqrt(i * s))


def _logistic(seed: int) -> torch.nn.Module:
    from dptrain.models.builders import build_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model("logistic", (1, 28, 28), 2)


def _train_dpsgd(train, test, s: int, steps: int, seed: int, convention: str, sigma: float, clip: float):
    """One Poisson-sampled DP-SGD run with expected batch s, T = ``steps`` rounds and the paper's step size
    (Sec. 4.1). The engine divides the noisy sum U (Algorithm 1) by s; ``convention="mean"`` uses lr = eta_t on
    that average (w <- w - eta_t U/s, "scaling the step size inversely with s_i", Sec. 2.2), ``"sum"`` uses
    lr = s eta_t (w <- w - eta_t U, the update of Algorithm 1 read literally)."""
    model = _logistic(seed)
    base = EXPERIMENT["eta0"] * (s if convention == "sum" else 1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=base)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _step_size_factor(s, EXPERIMENT["beta"]))
    trainer = make_private(  # sigma = 0: the noise-free reference (non_private: nothing recorded, no epsilon)
        model,
        optimizer,
        train,
        noise_multiplier=sigma,
        non_private=sigma == 0,
        max_grad_norm=clip,
        batch_size=s,
        seed=seed,
    )
    try:
        for _ in range(steps):
            trainer.step()
            scheduler.step()
        return trainer.evaluate(*test), trainer
    finally:
        trainer.close()


def _train_nonprivate(train, test, batch: int, epochs: int, eta0: float, seed: int) -> float:
    """Non-private reference: plain SGD on the mean cross-entropy of shuffled mini-batches, no clipping, no
    noise, the same step-size schedule eta0/(1 + beta sqrt(t)) (Sec. 4.1)."""
    x, y = train
    model = _logistic(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=eta0)
    gen = torch.Generator().manual_seed(seed)
    t = 0
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(batch):
            for group in optimizer.param_groups:
                group["lr"] = eta0 / (1 + EXPERIMENT["beta"] * math.sqrt(t))
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            t += len(idx)
    with torch.no_grad():
        return float((model(test[0]).argmax(1) == test[1]).float().mean())


def _epsilons(trainer, n: int) -> dict[str, Any]:
    """The run's ledger priced at the paper's delta = 1/N. (A training run refuses delta >= 1/n: releasing one random
    example whole is (0, 1/n)-DP. The reproduction prices the ledger at the paper's delta to compare with its
    numbers.)"""
    out: dict[str, Any] = {}
    for name in ("proactive", "pld"):
        try:
            out[name] = epsilon(trainer.ledger, 1 / n, name).epsilon
        except AccountingError as e:
            out[name] = None
            out[f"{name}_refusal"] = str(e)
    return out


def logistic_experiment(scale: Scale) -> dict[str, Any]:
    """Section (c): Table 3's LIBSVM parameters (sigma = 19.29962, C = 0.1, k = 5, delta = 1/N, eta0 = 0.1,
    beta = 0.01) on Fashion-MNIST T-shirt/top vs Shirt with N = 10,000 (``scale`` sets N, k, the seeds and the
    batch sizes); for each s, T = ceil(kN/s) rounds."""
    n, k = scale.n, scale.k
    seeds = list(scale.seeds)
    sigma, clip = EXPERIMENT["sigma"], EXPERIMENT["clip"]
    # certified: gamma at its fixed point, Thm B.4 checked after rounding
    calc_fp = plan_from_sigma(sigma, n, k)
    calc_paper = dp_calculator_simple(sigma, n, k, gamma_mode="paper")
    sizes = sorted({*scale.sizes, calc_fp["s_max"]} | ({calc_paper["s_max"]} if scale.paper_s_max else set()))
    data = fashion_mnist()
    train, test = _binary_subset(data.train, n), _binary_subset(data.test, None)

    runs: list[dict[str, Any]] = []
    eps_cache: dict[int, dict[str, Any]] = {}
    for convention in ("mean", "sum"):
        for s in sizes:
            steps = math.ceil(k * n / s)
            for seed in seeds:
                t0 = time.perf_counter()
                acc, trainer = _train_dpsgd(train, test, s, steps, seed, convention, sigma, clip)
                seconds = time.perf_counter() - t0
                if s not in eps_cache:  # identical ledger for every seed and convention at this s
                    eps_cache[s] = _epsilons(trainer, n)
                runs.append(
                    {
                        "convention": convention,
                        "s": s,
                        "T": steps,
                        "seed": seed,
                        "accuracy": acc,
                        "seconds": seconds,
                        "ms_per_step": 1e3 * seconds / steps,
                        **eps_cache[s],
                    }
                )

    s_ref = calc_fp["s_max"]
    references = {"nonprivate": {}, "clip_only": {}}
    for eta0 in (0.1, 0.01):
        references["nonprivate"][f"eta0={eta0:g}"] = [
            _train_nonprivate(train, test, s_ref, k, eta0, seed) for seed in seeds
        ]
    references["clip_only"] = [
        _train_dpsgd(train, test, s_ref, math.ceil(k * n / s_ref), seed, "mean", 0.0, clip)[0]
        for seed in seeds
    ]
    return {
        "n": n,
        "k": k,
        "delta": 1 / n,
        "seeds": seeds,
        "sizes": sizes,
        "sigma": sigma,
        "clip": clip,
        "eta0": EXPERIMENT["eta0"],
        "beta": EXPERIMENT["beta"],
        "test_size": len(test[1]),
        "calculator_fixed_point": calc_fp,
        "calculator_paper": calc_paper,
        "runs": runs,
        "references": references,
        "summary": _summarize(runs, sizes),
    }


def _summarize(runs: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for convention in ("mean", "sum"):
        rows = []
        for s in sizes:
            accs = [r["accuracy"] for r in runs if r["convention"] == convention and r["s"] == s]
            rs = [r for r in runs if r["convention"] == convention and r["s"] == s]
            rows.append(
                {
                    "s": s,
                    "T": rs[0]["T"],
                    "mean": float(np.mean(accs)),
                    "std": float(np.std(accs)),
                    "accuracies": accs,
                    "eps_proactive": rs[0]["proactive"],
                    "eps_pld": rs[0]["pld"],
                    "ms_per_step": float(np.mean([r["ms_per_step"] for r in rs])),
                }
            )
        best = max(rows, key=lambda r: r["mean"])
        largest = rows[-1]
        out[convention] = {
            "rows": rows,
            "best_s": best["s"],
            "largest_s": largest["s"],
            "largest_is_best": best["s"] == largest["s"],
            "largest_within_one_std_of_best": largest["mean"] >= best["mean"] - best["std"],
        }
    return out


# --- (d) utility graph ------------------------------------------------------------------------------------


def utility_graph_data(scale: Scale) -> dict[str, Any]:
    """Section (d): the utility graph (Sec. 3.3) of the section (c) task, w* trained by the engine with clipping
    C, no noise, Poisson batches of the certified s_max, the same schedule and K = kN. Returns
    ``UtilityGraph.to_dict()`` with the batch size ``s`` and the largest sigma of the 10% rule per C."""
    from dptrain.proactive.utility_graph import accuracy_evaluator, noise_free_trainer, utility_graph

    n, k = scale.n, scale.k
    s = plan_from_sigma(EXPERIMENT["sigma"], n, k)["s_max"]
    data = fashion_mnist()
    train, test = _binary_subset(data.train, n), _binary_subset(data.test, None)
    clips, sigmas = list(scale.clips), list(scale.sigmas)
    trainer = noise_free_trainer(
        lambda: _logistic(0),
        train,
        math.ceil(k * n / s),
        s,
        EXPERIMENT["eta0"],
        seed=0,
        schedule=_step_size_factor(s, EXPERIMENT["beta"]),
    )
    graph = utility_graph(trainer, accuracy_evaluator(*test), clips, sigmas, draws=scale.draws, seed=0)
    return {**graph.to_dict(), "s": s, "largest_sigma": {f"{c:g}": graph.largest_sigma(c) for c in clips}}
