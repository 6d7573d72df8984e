"""Projected noisy SGD for convex generalized linear models, releasing only the LAST iterate.

Paper: Altschuler & Talwar, "Privacy of Noisy Stochastic Gradient Descent: More Iterations without More Privacy
Loss"; docs/last_iterate.md). The paper's guarantee (Thm 3.1; App. B) is for the
algorithm of its Sec 1.2 / Sec 3.2 Step 1::

    w_0 in K;  for t = 0..T-1:  w_{t+1} = Proj_K[ w_t - eta_t (G_t + Z_t) ],   Z_t ~ N(0, sigma^2 I)
    G_t = (1/b) sum_{i in B_t} grad F_i(w_t);     release w_T only

for convex losses F_i that are M-smooth with eta_t <= 2/M (Lemma 2.1; eta_t < 2/M for m-strongly convex F_i,
Lemma 5.5), whose unregularized part f_i is L-Lipschitz on K (Sec 5.4), and a convex K of diameter D. There is
no gradient clipping: Lipschitzness bounds the gradient sensitivity sup_w ||grad f_i(w) - grad f_i'(w)|| by 2L
(replace adjacency, Sec 1.2 "Lipschitzness") or L (remove adjacency, Remark B.2).

This module supplies the losses for which L, M and m are known in closed form (:class:`ConvexGLM`), the
algorithm (:class:`ProjectedNoisySGD`), and records each step in a :class:`~dptrain.accounting.ledger.Ledger`
through the contract of :mod:`dptrain.accounting.last_iterate`; the last-iterate accountant turns that ledger
into epsilon. Nothing here computes epsilon.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from dptrain.accounting import AUTO, RunNumbers, all_reports, calibrate, epsilon, tightest
from dptrain.accounting.last_iterate import (
    ADJACENCIES,
    BATCHINGS,
    MECHANISM,
    NOT_CERTIFIED,
    certifiable,
    last_iterate_report,
    neighboring_for,
    setting_from_ledger,
    step_event,
    step_facts,
)
from dptrain.accounting.ledger import Ledger
from dptrain.clipping import ClipStats
from dptrain.data import as_tensors
from dptrain.engine import PrivateTrainer
from dptrain.errors import AccountingError, ConfigError, RunNotFinished
from dptrain.last_iterate.config import LOSSES
from dptrain.per_example import PerExampleGrads
from dptrain.randomness import Randomness
from dptrain.run import Job, load_data

#: The engine's batch selection for each batching of the paper.
_SAMPLERS = {"random": "fixed_size", "cyclic": "cyclic", "full": "full"}
STATE_FORMAT = "dptrain-last-iterate-state/1"


# ----------------------------------------------------------------------------------------------------------
# The models: convex GLMs with closed-form L, M, m
# ----------------------------------------------------------------------------------------------------------


def _finite_positive(name: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ConvexGLM:
    """A linear model w in R^{d(+1)} (bias optional, as an appended constant feature 1) with a convex loss.

    Features are rescaled per example to norm <= ``feature_norm`` = R by x -> x / max(1, ||x||/R). This is a
    fixed, data-independent map applied to each example on its own, so neighbouring data sets stay
    neighbouring and it costs no privacy; it is what makes the Lipschitz constant L of the paper (Sec 1.2,
    Sec 5.4) hold without gradient clipping. For ``squared`` the labels are clipped to [-label_bound,
    label_bound] the same way. Binary labels y in {0, 1} are mapped to y' = 2y - 1 in {-1, +1} for
    ``logistic`` and ``smoothed_hinge``.

    Losses of z = y' w.x~ (classification) or of the residual w.x~ - y (regression), x~ = [x, 1] with a bias:

    * ``logistic``: f(w) = log(1 + exp(-z));
    * ``smoothed_hinge`` (the quadratically smoothed hinge of Rennie & Srebro, "Loss functions for preference
      levels", 2005 [external], smoothing parameter 1): l(z) = 0 if z >= 1, (1 - z)^2/2 if 0 < z < 1,
      1/2 - z if z <= 0;
    * ``squared``: f(w) = (w.x~ - y)^2 / 2.

    The regularized per-example loss is F_i = f_i + (l2/2)||w||^2 (the bias coordinate is regularized too, so
    F_i is l2-strongly convex in all coordinates). Per Sec 5.4 of the paper, L is the Lipschitz constant of
    the UNREGULARIZED f_i (only the gradient sensitivity, in which the regularizer cancels, enters), while M and
    m are the smoothness and strong convexity of F_i. See :meth:`constants`.
    """

    loss: str
    feature_norm: float
    fit_bias: bool = True
    l2: float = 0.0
    label_bound: float = 1.0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ConfigError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        _finite_positive("feature_norm", self.feature_norm)
        _finite_positive("label_bound", self.label_bound)
        if (
            isinstance(self.l2, bool)
            or not isinstance(self.l2, numbers.Real)
            or not (math.isfinite(self.l2) and self.l2 >= 0)
        ):
            raise ConfigError(f"l2 must be a finite number >= 0, got {self.l2!r}")
        if not isinstance(self.fit_bias, bool):
            raise ConfigError(f"fit_bias must be true or false, got {self.fit_bias!r}")

    # -- constants ----------------------------------------------------------------------------------------
    @property
    def augmented_feature_norm(self) -> float:
        """R~ = sqrt(R^2 + 1) with a bias (the appended constant feature 1), else R: ||x~|| <= R~."""
        r = float(self.feature_norm)
        return math.sqrt(r * r + 1.0) if self.fit_bias else r

    def lipschitz(self, diameter: float, center_norm: float = 0.0) -> float:
        """L: a bound on ||grad f_i(w)|| over w in K for the UNREGULARIZED loss (paper Sec 5.4, Sec 1.2).

        K is the ball of radius D/2 around a center of norm ``center_norm``. See :meth:`constants`."""
        return self.constants(diameter, center_norm)["L"]

    def constants(self, diameter: float, center_norm: float = 0.0) -> dict[str, Any]:
        """L, M, m of the paper (Sec 1.2 definitions; Sec 5.4: L of f_i, M and m of F_i = f_i + (l2/2)||w||^2).

        Every loss is f_i(w) = l(w.x~_i) with a scalar convex l, so grad f_i = l'(.) x~_i and
        Hess f_i = l''(.) x~_i x~_i^T; with ||x~_i|| <= R~ this gives ||grad f_i|| <= sup|l'| R~ and
        Hess f_i <= sup l'' R~^2 I. Adding (l2/2)||w||^2 adds l2 I to the Hessian: M = sup l'' R~^2 + l2 and
        m = l2 (the losses themselves are convex but not strongly convex, inf l'' = 0).

        * logistic, l(z) = log(1 + e^{-z}): |l'(z)| = sigmoid(-z) < 1 and l''(z) = sigmoid(z) sigmoid(-z) <= 1/4,
          so L = R~, M = R~^2/4 + l2.
        * smoothed hinge: l'(z) = -clamp(1 - z, 0, 1), so |l'| <= 1, and l'' is 1 on (0, 1) and 0 elsewhere, so
          L = R~, M = R~^2 + l2.
        * squared, l(r) = r^2/2 with r = w.x~ - y: grad = r x~ is bounded only on the domain. For w in K,
          ||w|| <= center_norm + D/2, so |w.x~| <= (center_norm + D/2) R~ and |y| <= label_bound, giving
          L = ((center_norm + D/2) R~ + label_bound) R~; l'' = 1 so M = R~^2 + l2.
        """
        diameter = _finite_positive("diameter", diameter)
        if not (math.isfinite(center_norm) and center_norm >= 0):
            raise ConfigError(f"center_norm must be a finite number >= 0, got {center_norm!r}")
        rt = self.augmented_feature_norm
        rt2 = float(self.feature_norm) ** 2 + (1.0 if self.fit_bias else 0.0)  # R~^2 without sqrt round-off
        l2 = float(self.l2)
        if self.loss == "logistic":
            lip, smooth = rt, rt2 / 4.0 + l2
            how = "|l'| <= 1, l'' <= 1/4: L = R~, M = R~^2/4 + l2, m = l2"
        elif self.loss == "smoothed_hinge":
            lip, smooth = rt, rt2 + l2
            how = "|l'| <= 1, l'' <= 1: L = R~, M = R~^2 + l2, m = l2"
        else:
            lip = ((center_norm + diameter / 2.0) * rt + float(self.label_bound)) * rt
            smooth = rt2 + l2
            how = "|w.x~ - y| <= (||c|| + D/2) R~ + label_bound on K: L = that * R~, M = R~^2 + l2, m = l2"
        return {
            "L": lip,
            "M": smooth,
            "m": l2,
            "R_tilde": rt,
            "derivation": f"{self.loss}: ||x~|| <= R~ = {rt:.6g}; {how} (Altschuler & Talwar Sec 5.4)",
        }

    # -- features, labels, losses, gradients --------------------------------------------------------------
    def prepare_features(self, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Flatten to (N, d), rescale each row to norm <= R (x / max(1, ||x||/R)) and append 1 with a bias.

        A 1-D ``x`` is one example."""
        x = torch.as_tensor(x).to(dtype)
        x = x.reshape(x.shape[0], -1) if x.ndim != 1 else x.reshape(1, -1)
        if not bool(torch.isfinite(x).all()):
            raise ConfigError("features must be finite (found NaN or infinite values)")
        norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        x = x / torch.clamp(norms / float(self.feature_norm), min=1.0)
        if self.fit_bias:
            x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=dtype)], dim=1)
        return x

    def prepare_labels(self, y: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """{0, 1} -> {-1, +1} for the classification losses (anything else refused); clipped for squared."""
        y = torch.as_tensor(y).reshape(-1)
        if self.loss == "squared":
            y = y.to(dtype)
            if not bool(torch.isfinite(y).all()):
                raise ConfigError("labels must be finite for loss 'squared'")
            return y.clamp(-float(self.label_bound), float(self.label_bound))
        if y.dtype.is_floating_point and not bool(torch.isfinite(y).all()):
            raise ConfigError(f"labels must be 0 or 1 for loss {self.loss!r} (found NaN or infinite values)")
        if bool(((y != 0) & (y != 1)).any()):  # (the message names the rule, never the labels' values)
            raise ConfigError(f"labels must be 0 or 1 for loss {self.loss!r}")
        return 2.0 * y.to(dtype) - 1.0

    def dimension(self, num_features: int) -> int:
        return int(num_features) + (1 if self.fit_bias else 0)

    def derivative(self, w: torch.Tensor, xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
        """The scalar factor c_i with grad f_i(w) = c_i x~_i (closed form, one per row; see :meth:`constants`)."""
        if self.loss == "squared":
            return xt @ w - yt
        z = yt * (xt @ w)
        if self.loss == "logistic":
            return -yt * torch.sigmoid(-z)
        return -yt * torch.clamp(1.0 - z, 0.0, 1.0)

    def per_example_gradients(self, w: torch.Tensor, xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
        """(N, d~) gradients of the UNREGULARIZED losses f_i at w, in closed form (no autograd)."""
        return self.derivative(w, xt, yt)[:, None] * xt

    def batch_gradient(self, w: torch.Tensor, xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
        """G = (1/b) sum_i grad F_i(w) = (1/b) sum_i l'(.) x~_i + l2 w (Sec 1.2; the regularized loss)."""
        c = self.derivative(w, xt, yt)
        return (c @ xt) / xt.shape[0] + float(self.l2) * w

    def per_example_losses(self, w: torch.Tensor, xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
        """f_i(w) (unregularized), differentiable; for evaluation and checks, never used by the training step."""
        if self.loss == "squared":
            return 0.5 * (xt @ w - yt) ** 2
        z = yt * (xt @ w)
        if self.loss == "logistic":
            return torch.nn.functional.softplus(-z)
        return torch.where(z >= 1, torch.zeros_like(z), torch.where(z > 0, 0.5 * (1 - z) ** 2, 0.5 - z))

    def scores(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """w . x~ for raw features x (the same per-example feature map as in training)."""
        w = torch.as_tensor(w)
        return self.prepare_features(x, w.dtype) @ w

    def predict(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Labels in {0, 1} (sign of w.x~) for the classification losses; w.x~ itself for squared."""
        s = self.scores(w, x)
        return s if self.loss == "squared" else (s > 0).to(torch.int64)


def accuracy(w: torch.Tensor, glm: ConvexGLM, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of examples whose predicted {0, 1} label equals y (classification losses only).

    Evaluate on held-out data: accuracy on the training set is a function of the private data and is not
    covered by the privacy guarantee."""
    if glm.loss == "squared":
        raise ConfigError("accuracy needs a classification loss (logistic or smoothed_hinge), got 'squared'")
    y = torch.as_tensor(y).reshape(-1)
    if len(y) == 0:
        raise ConfigError("accuracy needs at least one example")
    return float((glm.predict(w, x) == y.to(torch.int64)).double().mean())


# ----------------------------------------------------------------------------------------------------------
# The algorithm
# ----------------------------------------------------------------------------------------------------------


def _int_at_least(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def project_to_ball(w: torch.Tensor, center: torch.Tensor, radius: float) -> torch.Tensor:
    """Exact Euclidean projection onto {v : ||v - center|| <= radius}: center + (w - center) min(1, r/||w - c||).

    The paper's Pi_K (Sec 1.2; Def 2.13); the ball of radius D/2 has diameter D as Thm 3.1 requires."""
    diff = w - center
    norm = float(torch.linalg.vector_norm(diff))
    if norm <= radius:
        return w
    return center + diff * (radius / norm)


class GLMWeights(nn.Module):
    """The GLM's parameter w in R^{d~} (float64) as a module: scores x~ w for prepared features x~."""

    def __init__(self, start: torch.Tensor):
        super().__init__()
        self.w = nn.Parameter(start.clone())

    def forward(self, xt: torch.Tensor) -> torch.Tensor:
        return xt @ self.w


class GLMGradients:
    """The per-example gradient stage for a GLM: grad f_i(w) = l'(.) x~_i in closed form (no autograd), for the
    UNREGULARIZED losses (the l2 term is data-independent: the update rule adds it, as weight decay)."""

    name = "closed form"

    def __init__(self, glm: ConvexGLM, weights: GLMWeights):
        self.glm, self.weights = glm, weights

    def __call__(self, xt: torch.Tensor, yt: torch.Tensor):
        """(per-example gradients, None): the losses are not computed (finite features give finite gradients,
        and the clipping stage checks every gradient's norm)."""
        w = self.weights.w.detach()
        return PerExampleGrads({"w": self.glm.per_example_gradients(w, xt, yt)}), None

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class LipschitzBound:
    """The clipping stage of projected noisy SGD: nothing is clipped, because the losses are L-Lipschitz on K
    (features rescaled to norm <= R; Sec 1.2, Sec 5.4), so every per-example gradient already has norm <= L. The
    per-example bound is checked anyway (a violation would break the sensitivity silently)."""

    lipschitz: float

    @property
    def sensitivity(self) -> float:
        return self.lipschitz

    def clip_and_sum(self, grads: PerExampleGrads):
        norms = torch.sqrt(sum(grads.sq_norms().values()))
        if bool((norms > self.lipschitz * (1 + 1e-9)).any()):
            raise ConfigError(  # (the norm itself, a statistic of the private data, is not printed)
                f"a per-example gradient has a norm above the Lipschitz bound {self.lipschitz:.6g}: the GLM's feature "
                "rescaling or constants are wrong"
            )
        stats = ClipStats(len(norms), 0, float(norms.sum()))
        return grads.weighted_sum(torch.ones_like(norms)), stats


class ProjectedSGD(torch.optim.Optimizer):
    """The update rule of projected noisy SGD: w <- Proj_K[w - eta_t (g + l2 w)] with eta_t = eta_0 (t+1)^(-p),
    g the privatized averaged gradient the engine hands over and K the ball of radius ``radius`` around
    ``center`` (Altschuler & Talwar Sec 1.2; Sec 5.3 for decaying steps). The l2 term is the regularizer's
    gradient: data-independent, so adding it after privatization is post-processing."""

    def __init__(self, params, lr: float, l2: float, lr_power: float, center: torch.Tensor, radius: float):
        super().__init__(params, {"lr": lr, "l2": l2, "lr_power": lr_power})
        self.center, self.radius = center, radius

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                t = state.get("t", 0)
                eta = group["lr"] * float(t + 1) ** (-group["lr_power"])
                w = p - eta * (p.grad + group["l2"] * p)
                p.copy_(project_to_ball(w, self.center, self.radius))
                state["t"] = t + 1


class ProjectedNoisySGD:
    """Projected noisy SGD on a convex GLM (Altschuler & Talwar Sec 1.2, Sec 3.2 Step 1), run by the DP-SGD
    engine with its stages chosen for the paper's algorithm:

    - batch selection: ``random`` (a uniformly random size-b subset drawn without replacement at every step,
      eq 3.1: the engine's ``fixed_size`` sampler), ``cyclic`` (Noisy-CGD, Sec 5.2: blocks of one secret
      permutation drawn before training; needs b | n: ``cyclic``), ``full`` (all n examples, App. B.1);
    - per-example gradients: closed form (:class:`GLMGradients`);
    - clipping: none, the Lipschitz bound L instead (:class:`LipschitzBound`);
    - noise: N(0, (b sigma)^2) on the sum, i.e. sigma on the averaged gradient (the paper's convention, footnote
      4), from the run's secret noise stream;
    - update rule: :class:`ProjectedSGD`, ``w_0 = center`` (default 0), K the ball of radius D/2 around it,
      eta_t = learning_rate (t + 1)^(-lr_power) (Sec 5.3, Example 5.9);
    - release policy: the LAST iterate only.

    Step t computes w_{t+1} = Proj_K[w_t - eta_t (G_t + Z_t)] with G_t = (1/b) sum_{i in B_t} grad F_i(w_t) and
    Z_t ~ N(0, sigma^2 I). Privacy: each step records one ledger event (see :mod:`dptrain.accounting.last_iterate`)
    with the facts the last-iterate accountant needs (L, D, M, m, eta, ...). The guarantee covers ONLY the final
    iterate w_T:

    * covered: convex losses (the GLMs here), exact projection onto K, eta_t <= 2/M (< 2/M if m > 0), the
      release of w_T alone, and anything computed from w_T (post-processing);
    * NOT covered: releasing or logging any intermediate iterate, the average iterate (provably less private
      for Noisy-CGD, Sec 6), per-step losses, a resumable :meth:`state_dict` (it holds an intermediate
      iterate), non-convex models, gradient clipping (Sec 6), or stopping early and publishing w_t for t < T.
      If intermediate iterates of this class do get released, a composition accountant (rdp, pld) on the same
      ledger still applies: every step is a (sub-sampled) Gaussian mechanism whose averaged gradient has
      sensitivity Delta/b, because the iterates stay in K where f_i is L-Lipschitz.

    Accordingly :meth:`train` returns only w_T, :meth:`final_model` refuses before the last step, and the
    callback of :meth:`train` receives only the number of steps taken.
    """

    def __init__(
        self,
        glm: ConvexGLM,
        data: Any,
        *,
        noise_std: float,
        learning_rate: float,
        steps: int,
        batch_size: int | None = None,
        batching: str = "random",
        diameter: float,
        center: Any = None,
        lr_power: float = 0.0,
        adjacency: str = "replace",
        seed: int | None = None,
        secure_noise: bool = False,
        randomness: Randomness | None = None,
        dtype: torch.dtype = torch.float64,
    ):
        if not isinstance(glm, ConvexGLM):
            raise ConfigError(f"glm must be a ConvexGLM, got {type(glm).__name__}")
        self.glm, self.dtype = glm, dtype
        x, y = as_tensors(data)
        self.n = _int_at_least("number of training examples", int(x.shape[0]), 1)
        xt, yt = glm.prepare_features(x, dtype), glm.prepare_labels(y, dtype)
        self.dim = int(xt.shape[1])

        if batching not in BATCHINGS:
            raise ConfigError(f"batching must be one of {', '.join(BATCHINGS)}, got {batching!r}")
        if adjacency not in ADJACENCIES:
            raise ConfigError(f"adjacency must be one of {', '.join(ADJACENCIES)}, got {adjacency!r}")
        if batch_size is None and batching == "full":
            batch_size = self.n
        if batch_size is None:
            raise ConfigError(
                f"batch_size is required for batching {batching!r} (an integer in [1, n={self.n}])"
            )
        b = _int_at_least("batch_size", batch_size, 1)
        if b > self.n:
            raise ConfigError(f"batch_size must be in [1, n={self.n}], got {b}")
        if batching == "full" and b != self.n:
            raise ConfigError(f"batch_size must equal n={self.n} for batching 'full', got {b}")
        if batching == "cyclic" and self.n % b:
            raise ConfigError(f"batch_size must divide n={self.n} for batching 'cyclic' (Sec 5.2), got {b}")
        self.batch_size, self.batching, self.adjacency = b, batching, adjacency
        self.steps = _int_at_least("steps", steps, 1)
        self.noise_std = _finite_positive("noise_std", noise_std)
        self.diameter = _finite_positive("diameter", diameter)
        self.learning_rate = _finite_positive("learning_rate", learning_rate)
        if isinstance(lr_power, bool) or not isinstance(lr_power, numbers.Real) or not 0 <= lr_power < 1:
            raise ConfigError(f"lr_power must be in [0, 1) (Sec 5.3, Example 5.9), got {lr_power!r}")
        self.lr_power = float(lr_power)

        if center is None:
            self.center = torch.zeros(self.dim, dtype=dtype)
        else:
            self.center = torch.as_tensor(center).to(dtype).reshape(-1).clone()
            if self.center.shape[0] != self.dim:
                raise ConfigError(
                    f"center must have {self.dim} coordinates (features + bias), got {self.center.shape[0]}"
                )
            if not bool(torch.isfinite(self.center).all()):
                raise ConfigError("center must be finite")
        consts = glm.constants(self.diameter, float(torch.linalg.vector_norm(self.center)))
        self.constants = consts
        self.lipschitz, self.smoothness, self.strong_convexity = consts["L"], consts["M"], consts["m"]
        self._check_learning_rate()

        self.sensitivity = ADJACENCIES[adjacency] * self.lipschitz  # Delta: 2L replace, L remove (Remark B.2)
        facts = step_facts(
            batching=batching,
            n=self.n,
            b=b,
            noise_std=self.noise_std,
            lipschitz=self.lipschitz,
            adjacency=adjacency,
            diameter=self.diameter,
            smoothness=self.smoothness,
            learning_rate=self.learning_rate,
            lr_power=self.lr_power,
            strong_convexity=self.strong_convexity,
            convex=True,
            projected=True,
        )
        weights = GLMWeights(self.center)
        optimizer = ProjectedSGD(
            weights.parameters(),
            self.learning_rate,
            float(glm.l2),
            self.lr_power,
            self.center,
            self.diameter / 2,
        )
        self.trainer = PrivateTrainer(
            weights,
            optimizer,
            (xt, yt),
            # std b sigma on the sum of per-example gradients bounded by L: the engine's multiplier is b sigma / L
            noise_multiplier=b * self.noise_std / self.lipschitz,
            batch_size=b,
            sampling=_SAMPLERS[batching],
            clipping=LipschitzBound(self.lipschitz),
            grad_sampler=GLMGradients(glm, weights),
            seed=seed,
            secure_noise=secure_noise,
            randomness=randomness,
            ledger=Ledger(neighboring=neighboring_for(adjacency)),
            release_facts=facts,
            release="last_iterate",
            accountant="rdp",
        )
        self.randomness = self.trainer.randomness
        # The trainer's event must be the one the last-iterate accounting defines (Delta = factor * L).
        assert self.trainer.release_event()[0] == step_event(
            batching, self.n, b, self.noise_std, self.sensitivity
        )

    def _check_learning_rate(self) -> None:
        """eta_t <= eta_0 <= 2/M (Lemma 2.1: the gradient step is a contraction); strictly < 2/M when m > 0
        (Lemma 5.5, the c-contraction of the strongly convex analysis). lr_power >= 0 keeps eta_t <= eta_0."""
        bound = 2.0 / self.smoothness
        strict = self.strong_convexity > 0
        if self.learning_rate > bound or (strict and self.learning_rate >= bound):
            interval = f"(0, 2/M) = (0, {bound:.6g})" if strict else f"(0, 2/M] = (0, {bound:.6g}]"
            raise ConfigError(
                f"learning_rate must be in {interval} with M = {self.smoothness:.6g} the smoothness of the "
                f"regularized {self.glm.loss} loss (Lemma {'5.5' if strict else '2.1'}), got {self.learning_rate}"
            )

    # -- the algorithm ------------------------------------------------------------------------------------
    def learning_rate_at(self, t: int) -> float:
        """eta_t = eta_0 (t + 1)^(-lr_power), t = 0..T-1 (Sec 5.3, Example 5.9)."""
        return self.learning_rate * float(t + 1) ** (-self.lr_power)

    def batch_indices(self, t: int) -> torch.Tensor:
        """B_t. Random batches consume the sampling stream; cyclic ones draw their permutation once."""
        return self.trainer.sampler.sample(self.randomness.stream("sampling"), t)

    @property
    def steps_taken(self) -> int:
        return self.trainer.steps

    def step(self) -> None:
        """One step: w_{t+1} = Proj_K[w_t - eta_t (G_t + Z_t)]; records one ledger event."""
        if self.steps_taken >= self.steps:
            raise RunNotFinished(f"all {self.steps} steps have run; the last iterate is final_model()")
        self.trainer.step()

    def train(self, callback: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run all remaining steps and return ONLY the final iterate w_T (a copy).

        ``callback(steps_taken)`` is called after each step with the step count only: no iterate, no loss."""
        while self.steps_taken < self.steps:
            self.step()
            if callback is not None:
                callback(self.steps_taken)
        return self.final_model()

    @property
    def finished(self) -> bool:
        return self.steps_taken >= self.steps

    def planned_ledger(self) -> Ledger:
        """The ledger this run will have after all its steps (for calibrating sigma before training)."""
        return self.trainer.ledger_after(self.steps - self.steps_taken)

    @property
    def ledger(self) -> Ledger:
        """The releases recorded so far: one event per step (merged into one entry)."""
        return self.trainer.ledger

    @property
    def _w(self) -> torch.Tensor:
        return self.trainer.model.w.detach()

    def final_model(self) -> torch.Tensor:
        """The last iterate w_T (a copy). Refuses before all T steps ran: w_t, t < T, is not a private release."""
        if not self.finished:
            raise RunNotFinished(
                f"final_model is available after all {self.steps} steps; {self.steps - self.steps_taken} remain "
                "(only the last iterate is covered by the privacy guarantee)"
            )
        return self._w.clone()

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Predictions of the final iterate w_T (see :meth:`ConvexGLM.predict`)."""
        return self.glm.predict(self.final_model(), x)

    # -- resume state -------------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {
            "glm": [
                self.glm.loss,
                float(self.glm.feature_norm),
                self.glm.fit_bias,
                float(self.glm.l2),
                float(self.glm.label_bound),
            ],
            "n": self.n,
            "dim": self.dim,
            "batch_size": self.batch_size,
            "batching": self.batching,
            "adjacency": self.adjacency,
            "steps": self.steps,
            "noise_std": self.noise_std,
            "learning_rate": self.learning_rate,
            "lr_power": self.lr_power,
            "diameter": self.diameter,
        }

    def state_dict(self) -> dict[str, Any]:
        """INTERNAL resume state: the engine's (the current iterate, the random streams, the cyclic order, the
        ledger) and this run's settings.

        The iterate inside is an intermediate w_t: it is NOT a private release and must not be published,
        logged or shared (only w_T is covered by the last-iterate guarantee). Store it like the private training
        data itself, and delete it once the run has finished."""
        return {
            "format": STATE_FORMAT,
            "config": self._config(),
            "center": self.center.clone(),
            "iterate": self._w.clone(),
            "trainer": self.trainer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a run from :meth:`state_dict`; refuses state from a run with other settings."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ConfigError(f"not a {STATE_FORMAT} state")
        if state["config"] != self._config():
            diff = sorted(k for k in self._config() if state["config"].get(k) != self._config()[k])
            raise ConfigError(f"resume state is from a run with different settings: {', '.join(diff)}")
        center = torch.as_tensor(state["center"]).to(self.dtype)
        if not torch.equal(center, self.center):
            raise ConfigError("resume state is from a run with a different center")
        taken = _int_at_least("steps", state["trainer"]["steps"], 0)
        if taken > self.steps:
            raise ConfigError(f"resume state has {taken} steps taken, more than steps={self.steps}")
        self.trainer.load_state_dict(state["trainer"])


# --- the job of training.algorithm = "projected_noisy_sgd" ----------------------------------------------------


def build_projected(cfg, randomness: Randomness, data=None, ledger: Ledger | None = None):
    """(ProjectedNoisySGD, data, accountant) for ``cfg``: the GLM, the steps, sigma (read from a resumed run's
    ledger, given by convex.noise_std, or calibrated by ``privacy.accountant``) and the accountant that certifies
    the run (``auto`` resolved to the tightest certified one for the planned ledger)."""
    p, t, cv = cfg.privacy, cfg.training, cfg.convex
    data = load_data(cfg) if data is None else data
    glm = ConvexGLM(cv.loss, cv.feature_norm, fit_bias=cv.fit_bias, l2=cv.l2)
    n = len(data.train)
    b = n if cv.batching == "full" else t.batch_size
    steps = RunNumbers.planned(
        _SAMPLERS[cv.batching], dataset_size=n, batch_size=b, **cfg.steps_or_epochs
    ).steps

    def make(sigma: float) -> ProjectedNoisySGD:
        return ProjectedNoisySGD(
            glm,
            (data.train.x, data.train.y),
            noise_std=sigma,
            learning_rate=t.learning_rate,
            steps=steps,
            batch_size=b,
            batching=cv.batching,
            diameter=cv.diameter,
            lr_power=cv.lr_power,
            adjacency=cv.adjacency,
            randomness=randomness,
        )

    sigma, accountant = cv.noise_std, p.accountant
    steps_done = [
        e for e in (ledger.entries if ledger is not None else []) if e.facts.get("mechanism") == MECHANISM
    ]
    if steps_done:
        sigma = float(steps_done[-1].facts["noise_std"])  # sigma lives in the ledger
    elif sigma is None:
        cal = calibrate(p.target_epsilon, p.delta, lambda s: make(s).planned_ledger(), p.accountant)
        sigma, accountant = cal.noise_multiplier, cal.accountant
    run = make(sigma)
    if accountant == AUTO:
        best = tightest(all_reports(run.planned_ledger(), p.delta)[0])
        if best is None:
            raise AccountingError("no accountant certifies this projected run")
        accountant = best.accountant
    run.trainer.accountant = accountant
    return run, data, accountant


def build_job(cfg, randomness: Randomness, *, ledger=None, accountant=None, resumed=None, data=None):
    """The :class:`dptrain.run.Job` of projected noisy SGD: the engine's trainer inside :class:`ProjectedNoisySGD`,
    evaluated and saved only at the end (the last iterate is the release), with the last-iterate bound and the
    composition bound side by side in the summary."""
    run, data, chosen = build_projected(cfg, randomness, data, ledger)
    if accountant is not None:
        run.trainer.accountant = accountant
    glm = run.glm

    def save_model(rd) -> dict:
        rd.save_model({"weights": run.final_model(), "glm": asdict(glm)})
        return {}

    def extras() -> dict:
        setting = setting_from_ledger(run.ledger)
        li = last_iterate_report(setting, cfg.privacy.delta)
        return {
            "epsilon_last_iterate": li["epsilon"],
            "epsilon_composition": epsilon(run.ledger, cfg.privacy.delta, "rdp").epsilon,
            "last_iterate_certified": certifiable(setting),
            **({} if certifiable(setting) else {"last_iterate_note": NOT_CERTIFIED}),
            "burn_in_steps": li["burn_in_steps"],
            "noise_std": run.noise_std,
            "sampling": run.batching,
            "batch_size": run.batch_size,
            "max_grad_norm": None,
            "lipschitz": run.lipschitz,
            "smoothness": run.smoothness,
            "diameter": run.diameter,
        }

    return Job(
        cfg,
        data,
        run.trainer,
        run.steps,
        randomness,
        evaluate=lambda: accuracy(run.final_model(), glm, data.test.x, data.test.y),
        save_model=save_model,
        example_losses=lambda x, y: glm.per_example_losses(
            run.final_model(), glm.prepare_features(x, run.dtype), glm.prepare_labels(y, run.dtype)
        ),
        extras=[extras],
        description=f"{glm.loss} GLM (projected noisy SGD, last iterate; per-example gradients: closed form)",
    )
