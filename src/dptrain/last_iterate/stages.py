"""The engine stages of projected noisy SGD (Altschuler & Talwar, "Privacy of Noisy Stochastic Gradient Descent: More
Iterations without More Privacy Loss", Sec 1.2; docs/last_iterate.md): the projection onto the ball K, the GLM's
weights and closed-form per-example gradients, the Lipschitz bound that replaces clipping, and the projected update
rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.last_iterate.glm import ConvexGLM
from dptrain.stages.clipping import ClipStats
from dptrain.stages.per_example import PerExampleGrads


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
