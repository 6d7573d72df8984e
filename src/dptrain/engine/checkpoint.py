"""What a trainer's checkpoint holds, and the checks a run continued from one passes.

A checkpoint holds everything needed to continue exactly: the model, the optimizer, the random streams, the sampler
and the ledger. It is SECRET: whoever reads the generators' states can recompute the noise (run directories keep it
in ``private/``). Loading one checks that its ledger records the steps it claims, each at the noise multiplier this
run would have used (with adaptive noise: under this run's privacy filter, within its budget).
"""

from __future__ import annotations

import torch

from dptrain.accounting import Ledger
from dptrain.accounting.ledger import (
    TRAINING_MECHANISMS,
    event_noise_multiplier,
    training_steps,
)
from dptrain.errors import DataError, NonFiniteError


class Checkpointing:
    """The checkpoint methods of :class:`dptrain.engine.trainer.PrivateTrainer` (a mixin: the trainer holds the state)."""

    def state_dict(self) -> dict:
        """Everything needed to continue exactly: model, optimizer, random streams and the ledger. SECRET: it
        holds the generators' states (whoever has them can recompute the noise); keep it out of shared outputs."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "randomness": self.randomness.state_dict(),
            "sampler": self.sampler.get_state(),
            "torch_rng": torch.get_rng_state(),
            **({"cuda_rng": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {}),
            "steps": self.steps,
            "accountant": self.accountant,
            "ledger": self.ledger.to_dict(),
            # why the run is not private, whatever put it so (a label is never lifted by a resume)
            "not_private": {"buffers": list(self.not_private_buffers), "stopped": self.sentinel.stopped},
            **({"noise_controller": self.noise_controller.state_dict()} if self.noise_controller is not None else {}),
            **({"weight_average": self.weight_average.state_dict()} if self.weight_average is not None else {}),
            **({"bandmf": self.bandmf.state_dict()} if self.bandmf is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        if "bandmf" in state and self.bandmf is None:
            raise DataError("this checkpoint is of a BandMF run: make the trainer with noise='bandmf' and its bands")
        ledger = Ledger.from_dict(state["ledger"])
        steps = int(state["steps"])
        if not self.non_private and steps != training_steps(ledger):
            raise DataError(
                f"checkpoint is inconsistent: {steps} steps but its ledger records {training_steps(ledger)}"
            )
        if not self.non_private:
            self._check_ledger_releases(ledger)
        if self.weight_average is not None:
            self.weight_average.load_state_dict(state.get("weight_average"))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.randomness.load_state_dict(state["randomness"])
        self.sampler.set_state(state.get("sampler", {}))
        if self.noise_controller is not None:
            self.noise_controller.load_state_dict(state["noise_controller"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        saved = state.get("not_private", {})
        self.not_private_buffers[:] = sorted({*self.not_private_buffers, *saved.get("buffers", [])})
        self.sentinel.stopped = self.sentinel.stopped or saved.get("stopped")
        ledger.private = self.private and ledger.private  # (a ledger recorded not private stays so)
        self.ledger, self.steps = ledger, steps
        self._allowed_steps = None
        self.agreed = False  # (a data-parallel run's ranks compare the state they continue from)
        if self.bandmf is not None:  # its noise history (the groups came back with the sampler's state)
            self.bandmf.load_state_dict(state.get("bandmf"))
        part = self.non_finite_part()
        if part is not None:  # (written by a run that went on from a non-finite state: never continued from)
            raise NonFiniteError(
                f"the checkpoint's {part} hold NaN or inf (not finite): a run is never continued from a non-finite "
                "state; start a fresh run"
            )

    def _check_ledger_releases(self, ledger: Ledger) -> None:
        """Every training step of a checkpoint's ledger is the release this run records at that step: its noise
        multiplier, sampling and facts (with adaptive noise: made under this run's privacy filter, within its budget).
        A ledger edited to record more noise, a lower rate, another data set size or clip norm is refused."""
        controller = self.noise_controller
        if controller is not None:
            from dptrain.accounting.filters import ledger_filter

            if ledger.releases and ledger_filter(ledger) != controller.filter:
                raise DataError("checkpoint's ledger was recorded under another privacy filter than this run's")
            if controller.filter.spent(ledger) > controller.filter.budget:
                raise DataError("checkpoint's ledger spends more than its privacy filter allows")
            return
        # Every training step, as this run records it (the same cuts and merges as ledger_after): the event (its
        # noise multiplier, sampling rate) and the facts (data set size, clip norm, mechanism, ...), step for step.
        recorded = [e for e in ledger.entries if e.facts.get("mechanism") in TRAINING_MECHANISMS]
        steps = sum(e.count for e in recorded)
        if self.noise_schedule is not None and steps > len(self.noise_schedule):
            raise DataError(f"checkpoint's ledger records {steps} steps, beyond this run's noise schedule's "
                            f"{len(self.noise_schedule)}")
        expected = Ledger([], ledger.neighboring)
        for a, b in self._runs(0, steps):
            expected.record(*self.release_event(a), count=b - a)
        step, i, j, left_i, left_j = 0, 0, 0, 0, 0  # (walked in runs of steps alike on both sides)
        while step < steps:
            got, want = recorded[i], expected.entries[j]
            left_i, left_j = left_i or got.count, left_j or want.count
            if (got.event, got.facts) != (want.event, want.facts):
                have = event_noise_multiplier(got, ledger.neighboring)
                run = event_noise_multiplier(want, ledger.neighboring)
                keys = sorted(k for k in {*got.facts, *want.facts} if got.facts.get(k) != want.facts.get(k))
                what = (f"noise multiplier {have}, this run has {run}" if have != run else
                        ", ".join(f"{k} {got.facts.get(k)}, this run has {want.facts.get(k)}" for k in keys) or
                        "another batch sampling than this run's")
                raise DataError(f"checkpoint's ledger records at step {step + 1} {what} (edited, or from another run)")
            alike = min(left_i, left_j)
            step, left_i, left_j = step + alike, left_i - alike, left_j - alike
            i, j = i + (left_i == 0), j + (left_j == 0)
