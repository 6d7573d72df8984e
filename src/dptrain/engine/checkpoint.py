"""What a trainer's checkpoint holds, and the checks a run continued from one passes.

A checkpoint holds everything needed to continue exactly: the model, the optimizer, the random streams, the sampler
and the ledger. It is SECRET: whoever reads the generators' states can recompute the noise (run directories keep it
in ``private/``). Loading one checks that its ledger records the steps it claims, each at the noise multiplier this
run would have used (with adaptive noise: under this run's privacy filter, within its budget).
"""

from __future__ import annotations

import math

import torch

from dptrain.accounting import Ledger
from dptrain.accounting.ledger import (
    NOISE_SCALE_FACT,
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
            self._check_ledger_noise(ledger)
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
        if self.bandmf is not None:  # its noise history (the groups came back with the sampler's state)
            self.bandmf.load_state_dict(state.get("bandmf"))
        part = self.non_finite_part()
        if part is not None:  # (written by a run that went on from a non-finite state: never continued from)
            raise NonFiniteError(
                f"the checkpoint's {part} hold NaN or inf (not finite): a run is never continued from a non-finite "
                "state; start a fresh run"
            )

    def _check_ledger_noise(self, ledger: Ledger) -> None:
        """Every training step of a checkpoint's ledger used the noise multiplier this run would use at that step (with
        adaptive noise: was made under this run's privacy filter, within its budget)."""
        controller = self.noise_controller
        if controller is not None:
            from dptrain.accounting.filters import ledger_filter

            if ledger.releases and ledger_filter(ledger) != controller.filter:
                raise DataError("checkpoint's ledger was recorded under another privacy filter than this run's")
            if controller.filter.spent(ledger) > controller.filter.budget:
                raise DataError("checkpoint's ledger spends more than its privacy filter allows")
            return
        step = 0
        for entry in ledger.entries:
            if entry.facts.get("mechanism") not in TRAINING_MECHANISMS:
                continue
            recorded = event_noise_multiplier(entry, ledger.neighboring)
            scale = entry.facts.get(NOISE_SCALE_FACT)
            if scale is not None and scale != self._noise_multiplier:
                raise DataError(
                    f"checkpoint's ledger records a noise schedule of scale {scale}, this run has {self._noise_multiplier}"
                )
            for t in (range(step, step + entry.count) if self.noise_schedule is not None else (step,)):
                beyond = self.noise_schedule is not None and t >= len(self.noise_schedule)
                expected = math.nan if beyond else self.noise_multiplier_at(t)
                if recorded != expected:
                    what = "noise multiplier" if self.noise_schedule is None else f"noise multiplier at step {t + 1}"
                    raise DataError(f"checkpoint's ledger records {what} {recorded}, this run has {expected}")
            step += entry.count
