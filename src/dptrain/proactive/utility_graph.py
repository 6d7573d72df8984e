"""The utility graph of Proactive DP (van Dijk, Nguyen, Nguyen, Nguyen, Nguyen, "Proactive DP: A
Multiple Target Optimization Framework for DP-SGD", Sec. 3.3, Sec. 4.1 and App. D.2).

Step 0 of the paper's pro-active flow chooses the clipping constant C and the largest noise multiplier sigma
*before* any private training, from a noise-free model:

1. train w* with clipping at C and NO noise (the same step-size schedule and number of gradient computations
   as the private run would use);
2. for each sigma on a grid, draw n ~ N(0, C^2 sigma^2 I) -- the noise one DP-SGD round adds to a sum of
   clipped gradients (Sec. 2.2, Algorithm 1) -- and measure the paper's **accuracy fraction**
   F(w* + n) / F(w*), the test accuracy with the noise over the test accuracy without it (Sec. 3.3);
3. keep the largest sigma whose accuracy drop is at most 10%, i.e. whose fraction is >= 0.9 (the paper's
   "10% rule", Sec. 3.3).

The "best-case" reasoning (Sec. 3.3): the last round's noise enters the final model directly and the noise
of earlier rounds is ignored, so the graph rules out bad (C, sigma) pairs but does not predict the accuracy
of DP-SGD.

**Privacy warning.** Training w* on the private data without noise is NOT differentially private, and
neither is anything read off the graph (the chosen sigma is a function of the private data). The paper
suggests public data or a transferred model for this step (Sec. 3.3); use such data whenever the choice
of (C, sigma) is itself to be covered by the privacy guarantee.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dptrain.engine.api import make_private
from dptrain.errors import ConfigError
from dptrain.randomness.generators import NotPrivateWarning

__all__ = ["NOT_PRIVATE_BECAUSE", "UtilityGraph", "accuracy_evaluator", "noise_free_trainer", "utility_graph"]


#: Why a utility graph is not private, in every output it makes (its JSON, its plot): shared alone, a file must say so.
NOT_PRIVATE_BECAUSE = (
    "w* is trained on the data without noise (Proactive DP, Sec. 3.3): the graph, and a sigma read off it, are "
    "functions of the data; use public or held-out data"
)


@dataclass
class UtilityGraph:
    """Accuracy fractions acc(w* + n)/acc(w*) (Proactive DP, Sec. 3.3) on a (C, sigma) grid.

    ``fractions[i, j, d]`` is the fraction for ``clips[i]``, ``sigmas[j]`` and noise draw ``d``;
    ``base_accuracy[C]`` is acc(w*) of the noise-free model trained with clipping C.
    """

    clips: list[float]
    sigmas: list[float]
    base_accuracy: dict[float, float]
    fractions: np.ndarray  # (len(clips), len(sigmas), draws)

    def mean_fraction(self) -> np.ndarray:
        """Mean accuracy fraction over the noise draws, shape (len(clips), len(sigmas))."""
        return self.fractions.mean(axis=2)

    def largest_sigma(self, clip: float, threshold: float = 0.9) -> float | None:
        """The paper's 10% rule (Sec. 3.3, threshold 0.9): the largest sigma on the grid whose MEAN accuracy
        fraction for ``clip`` is >= ``threshold``; None when no sigma qualifies."""
        i = self._clip_index(clip)
        mean = self.mean_fraction()[i]
        ok = [s for s, f in zip(self.sigmas, mean, strict=True) if f >= threshold]
        return max(ok) if ok else None

    def _clip_index(self, clip: float) -> int:
        for i, c in enumerate(self.clips):
            if math.isclose(c, clip, rel_tol=1e-12, abs_tol=0.0):
                return i
        raise ConfigError(
            f"clip {clip} is not on the graph (clips: {', '.join(f'{c:g}' for c in self.clips)})"
        )

    def table(self, threshold: float = 0.9) -> str:
        """Markdown table: one row per C with acc(w*), the mean fraction per sigma and the largest sigma
        with mean fraction >= ``threshold``."""
        mean = self.mean_fraction()
        head = ["C", "acc(w*)", *[f"sigma={s:g}" for s in self.sigmas], f"largest sigma (>= {threshold:g})"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for i, c in enumerate(self.clips):
            best = self.largest_sigma(c, threshold)
            cells = [
                f"{c:g}",
                f"{self.base_accuracy[c]:.4f}",
                *[f"{f:.3f}" for f in mean[i]],
                "none" if best is None else f"{best:g}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def plot(self, path: str | Path, threshold: float = 0.9) -> Path:
        """PNG: accuracy fraction vs sigma, one line (mean) per C with a min..max band over the draws and a
        horizontal line at ``threshold``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(6, 4))
        try:
            sig = np.asarray(self.sigmas, dtype=float)
            order = np.argsort(sig)
            for i, c in enumerate(self.clips):
                fr = self.fractions[i][order]
                ax.plot(sig[order], fr.mean(axis=1), marker="o", label=f"C={c:g}")
                ax.fill_between(sig[order], fr.min(axis=1), fr.max(axis=1), alpha=0.2)
            ax.axhline(threshold, color="k", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
            ax.set_xlabel("sigma (noise N(0, C^2 sigma^2 I) added to w*)")
            ax.set_ylabel("accuracy fraction acc(w*+n)/acc(w*)")
            ax.set_title("Utility graph (Proactive DP, Sec. 3.3): NOT private")
            ax.legend()
            fig.tight_layout()
            fig.savefig(path, dpi=100, metadata={"Title": "Utility graph: NOT private", "Description": NOT_PRIVATE_BECAUSE})
        finally:
            plt.close(fig)
        return path

    def to_dict(self) -> dict:
        return {
            "private": False,
            "not_private_because": [NOT_PRIVATE_BECAUSE],
            "clips": list(self.clips),
            "sigmas": list(self.sigmas),
            "base_accuracy": {f"{c:g}": a for c, a in self.base_accuracy.items()},
            "mean_fraction": self.mean_fraction().tolist(),
            "fractions": self.fractions.tolist(),
        }


def _check_grid(name: str, values: Sequence[float], minimum_exclusive: bool) -> list[float]:
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a list of numbers, got {values!r}") from None
    if not out:
        raise ConfigError(f"{name} must not be empty")
    bad = [v for v in out if not math.isfinite(v) or (v <= 0 if minimum_exclusive else v < 0)]
    if bad:
        bound = "> 0" if minimum_exclusive else ">= 0"
        raise ConfigError(f"every value of {name} must be a finite number {bound}, got {bad[0]}")
    if len(set(out)) != len(out):
        raise ConfigError(f"{name} must not repeat a value, got {out}")
    return out


def _cell_generator(seed: int, clip_index: int, sigma_index: int, draw: int) -> torch.Generator:
    """A generator per (C, sigma, draw) cell, so each cell's noise does not depend on the rest of the grid."""
    state = np.random.SeedSequence([seed, clip_index, sigma_index, draw]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


@torch.no_grad()
def _add_noise(model: nn.Module, std: float, generator: torch.Generator) -> None:
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
        p.add_(noise.to(p.device), alpha=std)


def utility_graph(
    train_noise_free: Callable[[float], nn.Module],
    evaluate: Callable[[nn.Module], float],
    clips: Sequence[float],
    sigmas: Sequence[float],
    draws: int = 5,
    seed: int = 0,
) -> UtilityGraph:
    """The utility graph of Proactive DP, Sec. 3.3 / App. D.2.

    For each clipping constant C, ``train_noise_free(C)`` returns w* trained with clipping C and NO noise
    (see :func:`noise_free_trainer`). For each sigma and each of ``draws`` draws, a copy of w* receives
    i.i.d. N(0, C^2 sigma^2) noise on every parameter (the noise of one DP-SGD round, Sec. 2.2, Algorithm 1)
    and the **accuracy fraction** F(w* + n)/F(w*) (Sec. 3.3) is ``evaluate(noisy) / evaluate(w*)``.
    Sigma = 0 gives fraction exactly 1. The noise of each (C, sigma, draw) cell comes from a torch.Generator
    seeded from (seed, C index, sigma index, draw), so results are deterministic given ``seed``.

    Use :meth:`UtilityGraph.largest_sigma` for the paper's 10% rule (largest sigma with fraction >= 0.9).

    NOT private: w* is trained on the data without noise (the paper suggests public or transferred data
    for this step); see the module docstring.
    """
    clips = _check_grid("clips", clips, minimum_exclusive=True)
    sigmas = _check_grid("sigmas", sigmas, minimum_exclusive=False)
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ConfigError(f"draws must be an integer >= 1, got {draws!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
    fractions = np.empty((len(clips), len(sigmas), draws))
    base: dict[float, float] = {}
    for ci, clip in enumerate(clips):
        w_star = train_noise_free(clip)
        acc0 = float(evaluate(w_star))
        if not acc0 > 0:
            raise ConfigError(
                f"w* trained with C={clip:g} has accuracy {acc0}; the accuracy fraction is undefined (the paper, "
                "Sec. 3.3 footnote 9, stops training w* at a sufficiently good accuracy instead)"
            )
        base[clip] = acc0
        for si, sigma in enumerate(sigmas):
            for d in range(draws):
                if sigma == 0:
                    fractions[ci, si, d] = 1.0  # w* + 0 is w*: the fraction is exactly 1
                    continue
                noisy = copy.deepcopy(w_star)
                _add_noise(noisy, clip * sigma, _cell_generator(seed, ci, si, d))
                fractions[ci, si, d] = float(evaluate(noisy)) / acc0
    return UtilityGraph(clips, sigmas, base, fractions)


def accuracy_evaluator(
    x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> Callable[[nn.Module], float]:
    """``evaluate(model)`` for :func:`utility_graph`: accuracy (argmax of the outputs) on held-out (x, y)."""
    if len(x) != len(y) or len(y) == 0:
        raise ConfigError(
            f"evaluation data must be non-empty with as many labels as inputs, got {len(x)} and {len(y)}"
        )

    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        was_training = model.training
        model.eval()
        try:
            correct = sum(
                int((model(xb).argmax(1) == yb).sum())
                for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True)
            )
        finally:
            model.train(was_training)
        return correct / len(y)

    return evaluate


def noise_free_trainer(
    model_fn: Callable[[], nn.Module],
    data_split,
    steps: int,
    batch_size: float,
    lr: float,
    seed: int = 0,
    schedule: Callable[[int], float] | None = None,
) -> Callable[[float], nn.Module]:
    """A ``train_noise_free(C)`` for :func:`utility_graph`: builds ``model_fn()`` (initialised under
    ``torch.manual_seed(seed)`` without touching the global RNG) and runs ``steps`` steps of the engine without its
    noise stage (``make_private(..., noise_multiplier=0.0, non_private=True, max_grad_norm=C)``: Poisson batches of
    expected size ``batch_size``, flat clipping at C, nothing recorded) and plain SGD with step size ``lr`` times
    ``schedule(step)`` (a LambdaLR factor, e.g. the paper's 1/(1 + beta sqrt(t)), Sec. 4.1). ``data_split`` is a
    DataSplit (its ``train`` part is used) or a training ArrayDataset.

    NOT private (no noise; the batches come from a stream seeded by ``seed``): see the module docstring."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be an integer >= 1, got {steps!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ConfigError(f"lr must be a finite number > 0, got {lr}")
    train = getattr(data_split, "train", data_split)

    def train_noise_free(clip: float) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_fn()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        scheduler = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        with warnings.catch_warnings():  # (seeded, and without noise: not private, as the graph says it is)
            warnings.simplefilter("ignore", NotPrivateWarning)
            trainer = make_private(
                model,
                optimizer,
                train,
                noise_multiplier=0.0,
                non_private=True,
                max_grad_norm=clip,
                batch_size=batch_size,
                seed=seed,
            )
        try:
            for _ in range(steps):
                trainer.step()
                if scheduler is not None:
                    scheduler.step()
        finally:
            trainer.close()
        return model

    return train_noise_free
