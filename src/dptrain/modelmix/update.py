"""The ModelMix update rule (Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix", Algorithm 1)
as an engine stage: a torch optimizer that takes plain SGD's place behind :class:`~dptrain.engine.trainer.PrivateTrainer`.

One step, per coordinate j (the trainer has already set ``p.grad`` to the noisy averaged gradient
``(G + N) / B`` at the un-mixed current iterate w_{k-1}, B the expected batch size):

1. lines 5-8, the tau gap: if ``|w_{k-1}(j) - w_{k-2}(j)| < tau_k``, push the two apart by tau_k/2 each, in
   the direction of their difference; equal coordinates (the sign is 0, which the paper's pseudo-code would leave
   at gap 0 < tau) get a random direction. The pushed values are stored back (the pseudo-code assigns in place):
   the next step mixes the new iterate with the pushed w_{k-1}.
2. alpha_k(j) ~ U[0, 1] from the run's secret ``mixing`` stream (:mod:`dptrain.randomness.generators`).
3. Eq. (9) with the averaged gradient: ``w_k = alpha w_{k-1} + (1 - alpha) w_{k-2} - lr (grad + wd w_{k-1})``.
   Weight decay (data-independent, at the released un-pushed w_{k-1}) is post-processing of released states.

tau_k = (tau / lr) x lr, with tau / lr in phases of the run (App. E): ``tau=[[0.05, 0.5], [0.025, 0.5]]`` is
0.05 lr for the first half of ``total_steps``, 0.025 lr after.

Initial states: w_{-1} = w_0 (the model's initialization). The first step finds every coordinate at gap 0 and
pushes each in a random direction, so its mix is uniform on a segment of width exactly tau_1 around w_0.

Plain SGD only: momentum and Adam keep a state built from past noisy gradients, which is not a function of the
released iterates (the alphas are secret), and the privacy analysis conditions each step on the released iterates
alone. The trainer records each step's ``tau_over_lr``, expected batch size and (with
:class:`~dptrain.stages.clipping.L2LinfClipping`) ``linf_p`` in the ledger, where the ``modelmix`` accountant reads them.
"""

from __future__ import annotations

import math

import torch

from dptrain.accounting.modelmix import phase_lengths, tau_at, tau_phases
from dptrain.errors import ConfigError


class ModelMixSGD(torch.optim.Optimizer):
    """ModelMix's update (Algorithm 1) for the parameters ``params``; see the module docstring.

    ``tau``: a multiple of the learning rate, or phases ``[[tau_over_lr, fraction of the run], ...]`` (then
    ``total_steps`` is needed). The trainer binds the run's secret mixing stream when it is made."""

    def __init__(self, params, lr: float, tau, total_steps: int | None = None, weight_decay: float = 0.0):
        if isinstance(lr, bool) or not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
            raise ConfigError(f"the learning rate must be a finite number > 0, got {lr!r}")
        if not (isinstance(weight_decay, int | float) and math.isfinite(weight_decay) and weight_decay >= 0):
            raise ConfigError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
        self.phases = tau_phases(tau)
        if len(self.phases) > 1 and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1
        ):
            raise ConfigError(f"tau in phases needs total_steps (an integer >= 1), got {total_steps!r}")
        self.total_steps = total_steps if total_steps is not None else 1
        super().__init__(params, {"lr": float(lr), "weight_decay": float(weight_decay)})
        self.randomness = None

    # -- the engine's stage interface -------------------------------------------------------------------------
    def bind_randomness(self, randomness) -> None:
        """The trainer gives the run's streams; the mixing weights and tie-breaks come from ``mixing`` (looked up at
        each step: loading a checkpoint replaces the stream objects)."""
        self.randomness = randomness

    def tau_over_lr(self, step: int) -> float:
        return tau_at(self.phases, self.total_steps, step)

    def release_facts(self, step: int) -> dict:
        """What step ``step`` (0-based) adds to the ledger's facts (the trainer adds the expected batch size)."""
        return {"update": "modelmix", "tau_over_lr": self.tau_over_lr(step)}

    def fact_boundaries(self, start: int, stop: int) -> list[int]:
        """Steps in (start, stop) where :meth:`release_facts` changes (the tau phases' starts)."""
        ends, acc = [], 0
        for n in phase_lengths(self.phases, self.total_steps)[:-1]:
            acc += n
            ends.append(acc)
        return [e for e in ends if start < e < stop]

    # -- the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("ModelMixSGD takes no closure (the trainer computes the noisy gradient)")
        if self.randomness is None:
            raise ConfigError(
                "ModelMixSGD draws its mixing weights from the run's secret streams: use it through make_private "
                "(which binds them), not on its own"
            )
        stream = self.randomness.stream("mixing")
        k = self.state.setdefault("_modelmix", {}).get("steps", 0)
        ratio = self.tau_over_lr(k)
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            tau = ratio * lr
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "previous" not in state:
                    state["previous"] = p.detach().clone()  # w_{-1} = w_0
                current, previous = p.detach().clone(), state["previous"]
                diff = current - previous
                small = diff.abs() < tau
                direction = torch.sign(diff)
                ties = small & (direction == 0)
                count = int(ties.sum())
                if count:
                    coin = stream.uniform((count,), dtype=torch.float64).to(device=p.device, dtype=p.dtype)
                    direction[ties] = torch.where(coin < 0.5, -1.0, 1.0).to(p.dtype)
                push = torch.where(small, direction * (tau / 2), p.new_zeros(()))
                current_pushed, previous_pushed = current + push, previous - push
                alpha = stream.uniform(tuple(p.shape), dtype=torch.float64).to(device=p.device, dtype=p.dtype)
                update = p.grad if wd == 0 else p.grad + wd * current
                p.copy_(previous_pushed + alpha * (current_pushed - previous_pushed) - lr * update)
                state["previous"] = current_pushed
        self.state["_modelmix"]["steps"] = k + 1
        return None


def stage(draft) -> None:
    """The ``[modelmix]`` section's stage of a DP-SGD job: with ``training.update = "modelmix"`` the job's update rule
    is :class:`ModelMixSGD` (tau phases over the planned steps) instead of the optimizer."""
    cfg = draft.cfg
    if cfg.training.update != "modelmix":
        return
    t, tau = cfg.training, cfg.modelmix.tau

    def make_optimizer(model, total_steps: int) -> ModelMixSGD:
        params = [p for p in model.parameters() if p.requires_grad]
        return ModelMixSGD(params, lr=t.learning_rate, tau=tau, total_steps=total_steps, weight_decay=t.weight_decay)

    draft.make_optimizer = make_optimizer
    draft.notices.append(uncredited_mixing)


#: What a ModelMix run certified by another accountant is told (once, on stderr, and in its summary's notes).
UNCREDITED = (
    'training.update = "modelmix", but the run is certified by the {accountant} accountant, not by modelmix: its '
    "epsilon is DP-SGD's at the same noise, so the mixing then costs utility without a privacy gain (train with "
    'training.update = "optimizer" at this noise, or see docs/modelmix.md for where the modelmix certificate wins)'
)


def uncredited_mixing(trainer) -> str | None:
    """The notice of a ModelMix run whose certificate comes from an accountant other than modelmix (pld, rdp: they
    certify the DP-SGD release the mixing post-processes, and give the mixing no credit)."""
    if trainer.accountant == "modelmix":
        return None
    return UNCREDITED.format(accountant=trainer.accountant)
