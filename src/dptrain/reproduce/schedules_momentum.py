"""App. D's network with momentum (Fig. 2 right of "On Dynamic Noise Influence in Differential Private Learning",
anonymous ICLR 2021 submission): a two-layer, 100-unit network trained by private gradient descent with momentum,
under a uniform schedule and the two influence shapes the paper grid-searches.

Setting: 1000 Fashion-MNIST training images (all 10 classes; the paper: subsampled MNIST) on 60 PCA components,
App. D's preprocessing and data scales, full-batch private GD with per-example clipping at G = 4, eta = 0.1, the
bias-corrected momentum of Thm 4.4 (v_{t+1} = beta v_t + (1 - beta) g_t, step eta v_{t+1} / (1 - beta^t); beta
= 0.9, which the paper does not give), cross-entropy, budget R = 0.3927 spent exactly under zCDP by every schedule.
Schedules (Lemma 4.1 on an assumed influence, its parameters chosen on a grid by mean final training loss, the
tuning's privacy cost ignored as in the paper):

- ``uni``: sigma_t^2 = T/R;
- ``expinfl``: q_t = e^(a t) ("an exponential function of t"), a on a grid;
- ``momexpinfl``: q_t = c1 g^(T + t) + c2 g^(T - t) ("a linear combination of two reverse exponential functions", the
  form of Thm 4.6), g and c1/c2 on a grid.

Per-example gradient norms of the two linear layers come from their factors (||delta_i||^2 ||h_i||^2: no
per-example gradient is materialised), runs are vectorised over repeats (torch, float32). Test accuracy on the
Fashion-MNIST test images (the same PCA), reported beside the training loss.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dptrain.schedules.calibration import calibrate_shape

HIDDEN, BETA = 100, 0.9
EXP_RATES = (0.0125, 0.025, 0.05, 0.1)
MOM_GAMMAS = (0.9, 0.95, 0.98)
MOM_RATIOS = (0.01, 0.1, 1.0)  # c1 / c2


def fmnist_pca10(n: int, n_test: int, components: int):
    """The first n training and n_test test images of Fashion-MNIST (10 classes) on the first principal components of
    the n training images (computed without privacy, as App. D does not account for it)."""
    from dptrain.reproduce import fashion_mnist

    split = fashion_mnist()
    x = split.train.x[:n].reshape(n, -1).numpy().astype(np.float64)
    xt = split.test.x[:n_test].reshape(n_test, -1).numpy().astype(np.float64)
    mean = x.mean(axis=0)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    basis = vt[:components].T
    return (x - mean) @ basis, split.train.y[:n].numpy(), (xt - mean) @ basis, split.test.y[:n_test].numpy()


def synthetic10(n: int, n_test: int, dim: int, classes: int = 3, seed: int = 0):
    """A small Gaussian mixture with a separate test set (quick mode)."""
    rng = np.random.default_rng(seed)
    centers = 3.0 * rng.standard_normal((classes, dim))
    y, yt = rng.integers(0, classes, n), rng.integers(0, classes, n_test)
    return centers[y] + rng.standard_normal((n, dim)), y, centers[yt] + rng.standard_normal((n_test, dim)), yt


def scaled(x: np.ndarray, x_test: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """App. D's preprocessing fitted on the training set and applied to both: centre, unit std per feature, then one
    factor so that the largest training norm is ``scale``."""
    mean, std = x.mean(axis=0), x.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    xs, xts = (x - mean) / std, (x_test - mean) / std
    f = scale / np.max(np.linalg.norm(xs, axis=1))
    return xs * f, xts * f


def shapes(T: int) -> dict[str, dict[str, Any]]:  # noqa: N803
    """name -> {"params": ..., "q": influence} of every schedule on the grid (uni: q = 1)."""
    t = np.arange(1, T + 1, dtype=float)
    out: dict[str, dict[str, Any]] = {"uni": {"family": "uni", "params": {}, "q": np.ones(T)}}
    for a in EXP_RATES:
        out[f"expinfl a={a:g}"] = {"family": "expinfl", "params": {"a": a}, "q": np.exp(a * (t - T))}
    for g in MOM_GAMMAS:
        for r in MOM_RATIOS:
            q = r * g ** (T + t - 2 * T) + g ** (T - t)  # c1 g^(T+t) + c2 g^(T-t), scaled by g^-T / c2
            out[f"momexpinfl g={g:g} c1/c2={r:g}"] = {"family": "momexpinfl", "params": {"g": g, "c1/c2": r}, "q": q}
    return out


def sigmas_for(q: np.ndarray, R: float) -> np.ndarray:  # noqa: N803
    """Lemma 4.1's allocation for influence q, calibrated to spend R exactly under zCDP."""
    return calibrate_shape(np.asarray(q, dtype=float) ** -0.25, R=R).sigmas


def clipped_sums(X, onehot, params, clip: float):  # noqa: N803
    """Sum over examples of the per-example cross-entropy gradients, each clipped to L2 norm ``clip`` (all four
    tensors together), for every repeat: [dW1, db1, dW2, db2] with a leading repeat axis. The norms come from the
    layers' factors: ||dW_i||^2 = ||delta_i||^2 ||input_i||^2, ||db_i||^2 = ||delta_i||^2."""
    import torch

    w1, b1, w2, b2 = params
    pre = torch.einsum("nd,rhd->rnh", X, w1) + b1[:, None, :]
    h = torch.relu(pre)
    logits = torch.einsum("rnh,rkh->rnk", h, w2) + b2[:, None, :]
    d2 = torch.softmax(logits, -1) - onehot  # dloss/dlogits (R, N, k)
    d1 = torch.einsum("rnk,rkh->rnh", d2, w2) * (pre > 0)
    norm2 = (d2 * d2).sum(-1) * ((h * h).sum(-1) + 1) + (d1 * d1).sum(-1) * ((X * X).sum(1) + 1)
    c = torch.clamp(clip / torch.sqrt(norm2).clamp_min(1e-12), max=1.0)  # (R, N)
    d2c, d1c = d2 * c[..., None], d1 * c[..., None]
    return [torch.einsum("rnh,nd->rhd", d1c, X), d1c.sum(1), torch.einsum("rnk,rnh->rkh", d2c, h), d2c.sum(1)]


def train(x, y, x_test, y_test, sigmas, seeds, *, lr: float, clip: float, classes: int) -> dict[str, np.ndarray]:
    """Final training loss and test accuracy, one per seed, of the private two-layer network with momentum."""
    import torch

    torch.set_num_threads(1)
    X = torch.tensor(x, dtype=torch.float32)  # noqa: N806
    Y = torch.tensor(y, dtype=torch.long)  # noqa: N806
    n, d = X.shape
    r = len(seeds)
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    w1 = torch.stack([torch.randn(HIDDEN, d, generator=g) / math.sqrt(d) for g in gens])  # (R, h, d)
    w2 = torch.stack([torch.randn(classes, HIDDEN, generator=g) / math.sqrt(HIDDEN) for g in gens])
    b1, b2 = torch.zeros(r, HIDDEN), torch.zeros(r, classes)
    params = [w1, b1, w2, b2]
    velocity = [torch.zeros_like(p) for p in params]
    onehot = torch.nn.functional.one_hot(Y, classes).float()
    for step, sigma in enumerate(np.asarray(sigmas, dtype=float), start=1):
        grads = clipped_sums(X, onehot, params, clip)
        for i, (g, p) in enumerate(zip(grads, params, strict=True)):
            noise = torch.stack([torch.randn(p.shape[1:], generator=gen) for gen in gens])
            noisy = (g + clip * float(sigma) * noise) / n
            velocity[i] = BETA * velocity[i] + (1 - BETA) * noisy
            p -= lr * velocity[i] / (1 - BETA**step)
    with torch.no_grad():
        h = torch.relu(torch.einsum("nd,rhd->rnh", X, w1) + b1[:, None, :])
        logits = torch.einsum("rnh,rkh->rnk", h, w2) + b2[:, None, :]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, classes), Y.repeat(r), reduction="none")
        Xt = torch.tensor(x_test, dtype=torch.float32)  # noqa: N806
        ht = torch.relu(torch.einsum("nd,rhd->rnh", Xt, w1) + b1[:, None, :])
        pred = (torch.einsum("rnh,rkh->rnk", ht, w2) + b2[:, None, :]).argmax(-1)
        acc = (pred == torch.tensor(y_test)[None, :]).float().mean(1)
    return {"train_loss": loss.reshape(r, n).mean(1).numpy(), "test_accuracy": acc.numpy()}


def compare(x, y, x_test, y_test, *, T: int, R: float, lr: float, clip: float, tune_seeds, eval_seeds) -> dict:  # noqa: N803
    """Tune each family's parameters on ``tune_seeds`` (mean final training loss), then evaluate the chosen schedules
    on ``eval_seeds`` (disjoint), paired with uni."""
    classes = int(max(y.max(), y_test.max())) + 1
    grid = shapes(T)
    tuned: dict[str, float] = {}
    for name, s in grid.items():
        run = train(x, y, x_test, y_test, sigmas_for(s["q"], R), tune_seeds, lr=lr, clip=clip, classes=classes)
        tuned[name] = float(run["train_loss"].mean())
    chosen = {}
    for family in ("uni", "expinfl", "momexpinfl"):
        names = [k for k, s in grid.items() if s["family"] == family]
        chosen[family] = min(names, key=tuned.get)
    results = {}
    for family, name in chosen.items():
        run = train(x, y, x_test, y_test, sigmas_for(grid[name]["q"], R), eval_seeds, lr=lr, clip=clip, classes=classes)
        results[family] = {"schedule": name, "params": grid[name]["params"], **{k: v.tolist() for k, v in run.items()}}
    base = np.asarray(results["uni"]["train_loss"])
    for r in results.values():
        diff = (np.asarray(r["train_loss"]) - base) / base.mean()
        r["relative"] = float(diff.mean())
        r["relative_se"] = float(diff.std(ddof=1) / math.sqrt(diff.size)) if diff.size > 1 else 0.0
        r["train_loss_mean"] = float(np.mean(r["train_loss"]))
        r["test_accuracy_mean"] = float(np.mean(r["test_accuracy"]))
    return {"T": T, "tuning_loss": tuned, "results": results}
