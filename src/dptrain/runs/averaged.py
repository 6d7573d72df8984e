"""The weight average of a run's released iterates (``training.ema``, :mod:`dptrain.engine.weight_averaging`) at the
run's edge: evaluated beside the last iterate at every evaluation, and saved beside the last iterate's files by the
job's own writer, under the average's names (``model_ema.pt`` beside ``model.pt``; for a Hugging Face model also
``hf_model_ema/`` and ``hf_adapter_ema/`` beside ``hf_model/`` and ``hf_adapter/``). Both are post-processing of
released iterates: nothing is added to the ledger.
"""

from __future__ import annotations

from pathlib import PurePath

from dptrain.runs.rundir import MODEL, MODEL_EMA

#: What the average's names end with: ``model.pt`` -> ``model_ema.pt``, ``hf_model`` -> ``hf_model_ema``.
AVERAGE_SUFFIX = "_ema"


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


def averaged_name(name: str) -> str:
    """The name the average's copy of the last iterate's file or directory ``name`` has (``model.pt`` ->
    ``model_ema.pt``, ``hf_model`` -> ``hf_model_ema``): never a name the last iterate's writer uses."""
    path = PurePath(name)
    if len(path.parts) != 1:
        raise ValueError(f"a run's released files are named in the run directory itself, got {name!r}")
    return path.stem + AVERAGE_SUFFIX + path.suffix


assert averaged_name(MODEL) == MODEL_EMA


class _AverageDirectory:
    """The run directory as the job's model writer sees it while it writes the weight average. Every name the writer
    writes or joins is mapped by :func:`averaged_name`, and nothing else of the directory is reachable: whatever a job's
    writer writes (``model.pt``, a ``save_pretrained`` directory, a file it names by joining the directory), the average
    lands beside the last iterate's file, never over it."""

    def __init__(self, rd):
        self._rd = rd
        #: the paths the writer reached (as str): the entries of its summary that name one are the average's files
        self.named: set[str] = set()

    def _name(self, name: str) -> str:
        mapped = averaged_name(name)
        self.named.add(str(self._rd / mapped))
        return mapped

    def save_model(self, payload: dict, name: str = MODEL) -> None:
        self._rd.save_model(payload, self._name(name))

    def save_directory(self, name: str, write):
        return self._rd.save_directory(self._name(name), write)

    def write_json(self, name: str, data) -> None:
        self._rd.write_json(self._name(name), data)

    def write_text(self, name: str, text: str) -> None:
        self._rd.write_text(self._name(name), text)

    def write_bytes(self, name: str, data: bytes) -> None:
        self._rd.write_bytes(self._name(name), data)

    def __truediv__(self, name: str):
        return self._rd / self._name(name)

    def __getattr__(self, name):
        raise AttributeError(
            f"a model writer reaches the run directory through save_model, save_directory, write_json, write_text, "
            f"write_bytes and '/', which name the weight average's files apart from the last iterate's; not {name!r}"
        )


def save_averaged(job, rd) -> dict:
    """Write the weight average with the job's own writer (the formats of the last iterate's files, under the
    average's names: :class:`_AverageDirectory`); returns its summary entries: those of the writer's entries that
    measure or name the model it wrote, suffixed ``_ema`` (its test metrics, the paths of a Hugging Face model's
    directories; not what is the same for both models, e.g. DPSGD-F's preprocessing), and ``model_ema`` = {file,
    decay}. Nothing without an average."""
    average = job.trainer.weight_average
    if average is None:
        return {}
    directory = _AverageDirectory(rd)
    with average.applied():
        entries = job.save_model(directory)
    out = {
        f"{k}{AVERAGE_SUFFIX}": v
        for k, v in entries.items()
        if k.startswith("test_accuracy") or (isinstance(v, str) and v in directory.named)
    }
    out["model_ema"] = {"file": MODEL_EMA, "decay": average.decay}
    return out


__all__ = ["averaged_name", "evaluate_averaged", "save_averaged"]
