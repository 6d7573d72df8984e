"""The losses of projected noisy SGD: convex generalized linear models whose Lipschitz constant L, smoothness M and
strong convexity m are known in closed form (:class:`ConvexGLM`), as the guarantee of Altschuler & Talwar, "Privacy
of Noisy Stochastic Gradient Descent: More Iterations without More Privacy Loss" (docs/last_iterate.md) requires
(Thm 3.1: M-smooth losses, an L-Lipschitz unregularized part on K, Sec 5.4); and their test accuracy."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from dptrain.errors import ConfigError
from dptrain.last_iterate.config import LOSSES


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
