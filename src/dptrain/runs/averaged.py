"""The weight average of a run's released iterates (``training.ema``, :mod:`dptrain.engine.weight_averaging`) at the
run's edge: evaluated beside the last iterate at every evaluation, and saved as ``model_ema.pt`` beside ``model.pt``
by the job's own writer. Both are post-processing of released iterates: nothing is added to the ledger.
"""

from __future__ import annotations

from dptrain.runs.rundir import MODEL_EMA


def evaluate_averaged(job, row: dict, not_private: dict) -> float | None:
    """The test accuracy of the weight average (None without one), written where the last iterate's is: in the
    metrics ``row`` when the test set is public, under ``not_private`` when it is not and the config asks for it."""
    average = job.trainer.weight_average
    if average is None:
        return None
    if job.test_is_public:
        with average.applied():
            row["test_accuracy_ema"] = accuracy = job.evaluate()
        return accuracy
    if job.cfg.training.log_not_private:
        with average.applied():
            not_private["test_accuracy_ema"] = job.evaluate()
    return None


class _AverageDirectory:
    """The run directory as the job's model writer sees it while it writes the weight average: ``model_ema.pt``."""

    def __init__(self, rd):
        self._rd = rd

    def save_model(self, payload: dict) -> None:
        self._rd.save_model(payload, MODEL_EMA)

    def __getattr__(self, name):
        return getattr(self._rd, name)


def save_averaged(job, rd) -> dict:
    """Write the weight average as ``model_ema.pt`` with the job's own writer (the format of ``model.pt``); returns its
    summary entries (the writer's test metrics, suffixed ``_ema``, and the file's name). Nothing without one."""
    average = job.trainer.weight_average
    if average is None:
        return {}
    with average.applied():
        entries = job.save_model(_AverageDirectory(rd))
    out = {f"{k}_ema": v for k, v in entries.items() if k.startswith("test_accuracy")}
    out["model_ema"] = {"file": MODEL_EMA, "decay": average.decay}
    return out


__all__ = ["evaluate_averaged", "save_averaged"]
