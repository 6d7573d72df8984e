"""The trainer's privacy side: the event each step records, the ledger a run will have after more steps, the steps
its budget allows, and the epsilon it has spent (marked not certified for a run that is not private).

A mixin of :class:`dptrain.engine.trainer.PrivateTrainer`, which holds the state (sampler, clipping, ledger, schedule, ...).
Training code never computes epsilon itself: it records events and asks an accountant (:mod:`dptrain.accounting`).
"""

from __future__ import annotations

import dataclasses

from dptrain.accounting import Ledger, PrivacyReport, epsilon, max_releases
from dptrain.accounting.checks import check_delta_for_size
from dptrain.accounting.ledger import NOISE_SCALE_FACT, step_facts
from dptrain.errors import AccountingError


class PrivacySide:
    """The privacy methods of :class:`dptrain.engine.trainer.PrivateTrainer` (a mixin)."""

    def release_event(self, step: int | None = None, noise_multiplier: float | None = None):
        """(DpEvent, facts) of step number ``step`` (default: the next one), as recorded in the ledger.

        The noise's std is noise_multiplier x C (C: the per-example bound, ``clipping.sensitivity``); the event
        records std over the sensitivity of the released sum under the ledger's adjacency: C for add/remove, 2C
        for replace-one (replacing an example moves the sum by up to 2C)."""
        step = self.steps if step is None else step
        sigma = self.noise_multiplier_at(step, noise_multiplier)
        if self.bandmf is not None:  # one participation at the group rate, and the facts of BandMF
            return self.bandmf.release_event(sigma)
        factor = 2.0 if self.ledger.neighboring == "replace_one" else 1.0
        event = self.sampler.event(sigma / factor, step)
        if self.release_facts is not None:
            return event, dict(self.release_facts)
        rate = self.sampler.expected_batch_size_at(step) / self.sampler.dataset_size
        facts = step_facts(
            self.sampler.scheme, rate, dataset_size=self.sampler.dataset_size, clip_norm=self.clipping.sensitivity
        )
        facts.update(getattr(self.clipping, "facts", {}))  # e.g. the l-infinity bound of l2_linf clipping
        update_facts = getattr(self.optimizer, "release_facts", None)
        if update_facts is not None:  # an update stage (ModelMix): its facts and the divisor B it scales by
            facts.update(update_facts(step), batch_size=float(self.sampler.expected_batch_size_at(step)))
        if self.noise_schedule is not None:
            facts[NOISE_SCALE_FACT] = float(self._noise_multiplier if noise_multiplier is None else noise_multiplier)
        if self.noise_controller is not None:
            facts.update(self.noise_controller.facts)
        return event, facts

    def _runs(self, start: int, stop: int) -> list[tuple[int, int]]:
        """[start, stop) cut where the recorded facts may change: every step with a batch-size schedule, the
        update stage's boundaries (ModelMix's tau phases) otherwise."""
        if self.sampler.max_steps is not None:
            cuts = list(range(start + 1, stop))
        else:
            boundaries = getattr(self.optimizer, "fact_boundaries", None)
            cuts = [] if boundaries is None else boundaries(start, stop)
            shape = self.noise_schedule
            if shape is not None:  # where the noise schedule changes level
                cuts = sorted({*cuts, *(t for t in range(start + 1, min(stop, len(shape))) if shape[t] != shape[t - 1])})
        edges = [start, *cuts, stop]
        return [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]

    def ledger_after(self, more: int, noise_multiplier: float | None = None) -> Ledger:
        """The ledger as it will be after ``more`` further steps (at ``noise_multiplier``, default the run's)."""
        ledger = self.ledger.copy()
        for start, stop in self._runs(self.steps, self.steps + more):  # identical steps recorded at once
            ledger.record(*self.release_event(start, noise_multiplier), count=stop - start)
        return ledger

    def allowed_steps(self) -> int | None:
        """Total steps the budget allows (None without a budget). Computed once, by the run's accountant."""
        if self.budget is None:
            return None
        if self._allowed_steps is None:
            limit = 10**9 if self.max_steps is None else self.max_steps - self.steps
            # A calibrated noise schedule fits its budget over its whole length: try that first (one accountant
            # call instead of a search over ledgers of many distinct steps).
            more = max_releases(
                self.ledger_after,
                self.budget.epsilon,
                self.budget.delta,
                self.accountant,
                limit,
                limit_first=self.noise_schedule is not None,
            )
            self._allowed_steps = self.steps + more
        return self._allowed_steps

    @property
    def not_private_reasons(self) -> list[str]:
        """Why this run is not private whatever its epsilon (empty for a private run): seeded randomness (the noise can
        be recomputed), buffers written from private batches (released unnoised), a run the sentinel stopped."""
        reasons = []
        if self.randomness.seeded:
            reasons.append("seeded randomness: the noise and the batches can be recomputed from the seed")
        if self.not_private_buffers:
            reasons.append(
                "buffers written from private batches are released unnoised, or model state changed outside the "
                f"private steps ({', '.join(self.not_private_buffers)})"
            )
        stopped = getattr(getattr(self, "sentinel", None), "stopped", None)
        if stopped:  # (dptrain.preflight.sentinel: examples found mixed during training)
            reasons.append(stopped)
        return reasons

    @property
    def private(self) -> bool:
        return not self.not_private_reasons

    def epsilon(self, delta: float | None = None, accountant: str | None = None) -> PrivacyReport:
        """Privacy spent so far (epsilon at ``delta``), from the ledger. For a run that is not private (seeded, or with
        buffers written from private batches) the report is marked not certified: its epsilon is what the run would
        certify with secret randomness and nothing released outside the ledger."""
        if self.non_private:
            raise AccountingError("a non_private baseline released its gradients without noise: it has no epsilon")
        delta = self.delta if delta is None else check_delta_for_size(delta, len(self.data), "delta")
        report = epsilon(self.ledger, delta, accountant or self.accountant)
        reasons = self.not_private_reasons
        if not reasons:
            return report
        note = "NOT private: " + "; ".join(reasons)
        return dataclasses.replace(report, certified=False, details={**report.details, "private": False, "note": note})
