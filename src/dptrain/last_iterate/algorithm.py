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

This module holds the algorithm (:class:`ProjectedNoisySGD`): it runs the engine with the stages of
:mod:`dptrain.last_iterate.stages` on the losses of :mod:`dptrain.last_iterate.glm` (:class:`ConvexGLM`), and records
each step in a :class:`~dptrain.accounting.ledger.Ledger` through the contract of
:mod:`dptrain.accounting.last_iterate`; the last-iterate accountant turns that ledger into epsilon. Nothing here
computes epsilon. :mod:`dptrain.last_iterate.job` builds the job of ``training.algorithm = "projected_noisy_sgd"``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from dptrain.accounting.last_iterate import (
    ADJACENCIES,
    BATCHINGS,
    neighboring_for,
    step_event,
    step_facts,
)
from dptrain.accounting.ledger import Ledger
from dptrain.data.loaders import as_tensors
from dptrain.engine.trainer import PrivateTrainer
from dptrain.errors import ConfigError, RunNotFinished

# (LOSSES, accuracy and project_to_ball are read through the package, dptrain.last_iterate, whose names come from
# this module)
from dptrain.last_iterate.config import LOSSES as LOSSES
from dptrain.last_iterate.glm import ConvexGLM, _finite_positive
from dptrain.last_iterate.glm import accuracy as accuracy
from dptrain.last_iterate.stages import GLMGradients, GLMWeights, LipschitzBound, ProjectedSGD
from dptrain.last_iterate.stages import project_to_ball as project_to_ball
from dptrain.randomness.generators import Randomness

#: The engine's batch selection for each batching of the paper.
_SAMPLERS = {"random": "fixed_size", "cyclic": "cyclic", "full": "full"}
STATE_FORMAT = "dptrain-last-iterate-state/1"


def _int_at_least(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


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
