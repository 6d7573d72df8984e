"""Deliberately broken engines: the audit's check of its own power (``dptrain audit --inject-bug BUG``).

An audit that cannot fail is not a check. To measure what it can detect, ``dptrain audit --inject-bug`` trains the
configuration with one stage of the built trainer replaced by a broken one while everything the accounting sees
stays as in the correct run: the sensitivity the noise is scaled to, the noise multiplier and the facts recorded
in the ledger, hence the certified epsilon. Only an audit uses this; ``dptrain train`` never does.

- ``noise/F`` (F = 2, 10, 100): the noise stage (``trainer.noise_stage``) adds N(0, (std / F)^2) instead of
  N(0, std^2), std = sigma_t C the ledger records. The true epsilon of the run is that of sigma_t / F.
- ``clipping-off``: the clipping stage (``trainer.clipping``) sums the per-example gradients as they are, every
  part of them (a model's parameters and an audit's auxiliary canary coordinates alike); its ``sensitivity`` and
  ``facts`` stay those of the replaced rule, so the noise and the ledger are the correct run's.
"""

from __future__ import annotations

import torch

from dptrain.auditing import BUGS
from dptrain.errors import ConfigError
from dptrain.stages.clipping import ClipStats, WrappedRule, read_counts, screen_non_finite
from dptrain.stages.noise import add_gaussian_noise


def check_bug(bug) -> str | None:
    """``bug`` validated: None (the correct engine) or one of :data:`BUGS`."""
    if bug is None or bug in BUGS:
        return bug
    raise ConfigError(f"the injected bug (--inject-bug) must be one of {', '.join(BUGS)}, got {bug!r}")


class NoiseDivided:
    """A noise stage adding 1/``factor`` of the noise it is asked for (the ledger records the full std)."""

    def __init__(self, factor: float, stage=None):
        self.factor = float(factor)
        self.stage = stage or add_gaussian_noise

    def __call__(self, sums: dict[str, torch.Tensor], std: float, stream) -> dict[str, torch.Tensor]:
        return self.stage(sums, std / self.factor, stream)


class Unclipped(WrappedRule):
    """A clipping rule that sums the per-example gradients unclipped, reporting the replaced rule's sensitivity and
    facts (so the noise std and the ledger do not change). Examples whose gradient is not finite still contribute
    zero, as with every rule (otherwise one NaN would end the run rather than show the bug)."""

    def clip_and_sum(self, grads):
        bad, total = screen_non_finite(grads.sq_norms())
        norms = total.sqrt()
        dropped, clipped, norm_sum = read_counts(bad.sum(), (norms > self.sensitivity).sum(), norms.sum())
        if dropped:
            grads = grads.zero_examples(bad)
        stats = ClipStats(len(norms), int(clipped), norm_sum, int(dropped))
        return grads.weighted_sum(torch.ones_like(norms)), stats


def broken(bug: str) -> str:
    """Why an audit trained with ``bug`` is not private: what it prints was computed from a model trained on the data
    by a mechanism its certificate does not cover (less noise, no clipping)."""
    return f"trained with a deliberately broken stage (--inject-bug {bug}): the certificate does not cover it"


def inject(trainer, bug: str | None) -> None:
    """Replace a stage of the built ``trainer`` by ``bug`` (one of :data:`BUGS`; None leaves it correct)."""
    bug = check_bug(bug)
    if bug is None:
        return
    if bug == "clipping-off":
        trainer.clipping = Unclipped(trainer.clipping)
        return
    trainer.noise_stage = NoiseDivided(float(bug.split("/")[1]), trainer.noise_stage)


__all__ = ["BUGS", "NoiseDivided", "Unclipped", "broken", "check_bug", "inject"]
