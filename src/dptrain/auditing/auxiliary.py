"""Gradient canaries on auxiliary coordinates, scored on every released update: the DP-SGD audit.

Setting: Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023), Algorithm 1
(m canaries, each included with probability 1/2), in its white-box form with gradient canaries in which every
iterate is observed. DP-SGD's accounting assumes an adversary who sees every privatized gradient, so the audit may
score each canary from all of them.

Where the canaries live. A canary placed on a coordinate of the model's own parameters shares it with the real
data's gradients, which move it every step: the canary's signal is then drowned in the data's drift (a 5-epoch
logistic run certified at epsilon 1 with 10x too little noise, true epsilon about 190, gave lower bounds of
0.45-0.97 over seeds 0-3, configs/audit.toml). Here the canaries get coordinates of their own: an auxiliary tensor of m b entries appended to the
trainer's parameter dict for the audit only (:data:`AUX`). The model never reads it and the optimizer does not
hold it, so every real example's per-example gradient there is exactly 0, and what the run releases there is
exactly the canaries' clipped sum plus the engine's noise. Canary r's gradient is GAIN C / sqrt(b) on its block of
b coordinates (norm GAIN C, GAIN = 4 > 1) and 0 elsewhere, so the run's clipping rule must bring it down to C: a
clipping bug shows as a canary GAIN times stronger. b = 1 except under l2 + l-infinity clipping with p > 1
(Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix", Algorithm 2), where b = p (memory
permitting): the clipped canary then has both the l2 norm C and the l-infinity norm C / sqrt(p) the rule allows,
the worst case its accounting covers, where a single coordinate would reach only C / sqrt(p).

The engine's stages are untouched: batch selection samples the canaries' rows like any example, the noise stage
noises every entry of the sums (the auxiliary ones included) with the std the ledger records, and the released
sum is scaled by 1 / (expected batch size) as always. The clipping stage is the run's own rule applied to each
physical chunk (:class:`SplitClipping`): a chunk holds either real examples (the model's tensors only, clipped
exactly as in a run without canaries: per-layer clipping still splits C over the model's K tensors) or canaries
(the auxiliary tensor only, clipped by the same rule, to C). Each example is nonzero in one part only, so its
contribution has norm <= C, the sensitivity the noise is scaled to.

The score (:class:`ReleasedScores`): at step t the released update's block of canary r, summed over the block,
divided by sqrt(b) and multiplied by B_t / C (B_t the expected batch size), is x_t = 1[r sampled] + N(0, sigma_t^2)
on the correct engine, sigma_t the noise multiplier the ledger records. Two statistics, neither reading the secrets:

- ``llr``: sum_t log(1 - q_t + q_t exp((x_t - 1/2) / sigma_t^2)), the log-likelihood ratio of "included"
  (x_t ~ (1 - q_t) N(0, sigma_t^2) + q_t N(1, sigma_t^2), the sampled Gaussian mechanism of Mironov, Talwar &
  Zhang, "Renyi Differential Privacy of the Sampled Gaussian Mechanism", 2019, Sec. 3) against "excluded"
  (x_t ~ N(0, sigma_t^2)), q_t = B_t / N the sampling rate: by the Neyman-Pearson lemma the most powerful
  per-canary test of the correct engine's observations.
- ``sum``: sum_t x_t, the plain sum.

Any fixed score gives a valid lower bound (Steinke, Nasr & Jagielski, Theorems 3.1 and 5.2 hold for any guesses
computed from the run's output); which one has more power is measured by ``dptrain reproduce audit --power``.
"""

from __future__ import annotations

import math

import torch

from dptrain.stages.clipping import WrappedRule
from dptrain.stages.noise import add_gaussian_noise
from dptrain.stages.per_example import PerExampleGrads

#: The name of the auxiliary canary tensor in ``trainer.params`` (never a module's parameter name).
AUX = "<audit canaries>"
#: A canary's gradient norm before clipping, in units of C: > 1, so that a rule which does not clip shows.
GAIN = 4.0
#: Most auxiliary entries m b (b shrinks first) and most entries of one chunk of canary gradients.
MAX_AUX_ENTRIES = 2**22
MAX_CHUNK_ENTRIES = 2**24
#: The statistics :class:`ReleasedScores` computes.
STATISTICS = ("llr", "sum")


class SplitClipping(WrappedRule):
    """The run's clipping ``rule`` applied to each chunk as it comes (real examples: the model's tensors; canaries:
    the auxiliary tensor only), its result completed with exact zeros for the tensors the chunk does not hold.

    The sensitivity and the facts recorded in the ledger are the rule's: the run is accounted as without canaries."""

    def __init__(self, rule, params: dict[str, torch.Tensor]):
        super().__init__(rule)
        self.params = params

    def clip_and_sum(self, grads):
        summed, stats = self.rule.clip_and_sum(grads)
        return {n: summed[n] if n in summed else torch.zeros_like(p) for n, p in self.params.items()}, stats


def block_size(rule, m: int) -> int:
    """b, the auxiliary coordinates per canary: the l-infinity rule's p (``facts["linf_p"]``, 1 for other rules),
    capped so that m b <= :data:`MAX_AUX_ENTRIES` (a smaller b gives a weaker, still valid canary)."""
    p = int(dict(getattr(rule, "facts", {})).get("linf_p", 1))
    return max(1, min(p, MAX_AUX_ENTRIES // m))


class AuxiliaryCanaries:
    """m gradient canaries on an auxiliary tensor of ``trainer`` (see the module docstring).

    :meth:`install` appends the tensor to ``trainer.params``, wraps ``trainer.clipping`` in :class:`SplitClipping`
    and starts the scoring (:class:`ReleasedScores`); :meth:`gradients` gives the per-example stage the canaries'
    gradients; :meth:`remove` undoes the hooks. Install after any injected bug, so that the bug applies to the
    canaries as to everything else."""

    def __init__(self, trainer, m: int, gain: float = GAIN):
        self.trainer, self.m, self.gain = trainer, m, float(gain)
        self.norm = float(trainer.clipping.sensitivity)
        self.block = block_size(trainer.clipping, m)
        ref = next(iter(trainer.params.values()))
        self.tensor = torch.zeros(m * self.block, device=ref.device, dtype=ref.dtype)
        self.chunk = max(1, min(trainer.max_physical_batch_size, MAX_CHUNK_ENTRIES // (m * self.block)))
        self.scores: ReleasedScores | None = None

    def install(self) -> None:
        t = self.trainer
        t.params[AUX] = self.tensor
        t.clipping = SplitClipping(t.clipping, t.params)
        self.scores = ReleasedScores(t, self.tensor, self.m, self.block, self.norm)

    def gradients(self, canaries: torch.Tensor) -> PerExampleGrads:
        """Per-example gradients of the canaries ``canaries`` (indices in 0..m-1): GAIN C / sqrt(b) on each one's
        block of the auxiliary tensor, and nothing else (the chunk holds the auxiliary tensor only)."""
        k, b = len(canaries), self.block
        grads = torch.zeros((k, self.m, b), device=self.tensor.device, dtype=self.tensor.dtype)
        grads[torch.arange(k), canaries.to(self.tensor.device)] = self.gain * self.norm / math.sqrt(b)
        return PerExampleGrads({AUX: grads.reshape(k, self.m * b)})

    def remove(self) -> None:
        if self.scores is not None:
            self.scores.remove()


class ReleasedScores:
    """Scores the m canaries on every released update (the statistics of :data:`STATISTICS`, summed over steps).

    The noise stage is wrapped to learn each step's std = sigma_t C (what the ledger records: an injected bug sits
    inside the wrapper) and the expected batch size B_t; an optimizer step pre-hook reads the released update
    ``p.grad`` of the auxiliary tensor at the moment the optimizer is handed it, i.e. exactly what the step
    releases."""

    def __init__(self, trainer, tensor: torch.Tensor, m: int, block: int, norm: float):
        self.trainer, self.tensor, self.m, self.block, self.norm = trainer, tensor, m, block, norm
        self.totals = {s: torch.zeros(m, dtype=torch.float64) for s in STATISTICS}
        self.steps = 0
        self._pending: tuple[float, float, float] | None = None  # (sigma_t, q_t, B_t) of the step in progress
        self._stage = trainer.noise_stage
        trainer.noise_stage = self._noise
        self._handle = trainer.optimizer.register_step_pre_hook(self._capture)

    def _noise(self, sums, std, stream):
        t = self.trainer
        batch = float(t.sampler.expected_batch_size_at(t.steps))
        self._pending = (std / self.norm, batch / t.sampler.dataset_size, batch)
        return (self._stage or add_gaussian_noise)(sums, std, stream)

    def _capture(self, optimizer, args, kwargs) -> None:
        sigma, q, batch = self._pending
        self._pending = None
        released = self.tensor.grad.detach().to(torch.float64).reshape(self.m, self.block).cpu()
        x = released.sum(1) / math.sqrt(self.block) * batch / self.norm
        self.totals["sum"] += x
        quiet = math.log1p(-q) if q < 1 else -math.inf
        self.totals["llr"] += torch.logaddexp(torch.full_like(x, quiet), math.log(q) + (x - 0.5) / sigma**2)
        self.steps += 1

    def remove(self) -> None:
        self._handle.remove()
        self.trainer.noise_stage = self._stage


__all__ = ["AUX", "GAIN", "STATISTICS", "AuxiliaryCanaries", "ReleasedScores", "SplitClipping", "block_size"]
