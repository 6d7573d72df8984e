"""A run directory: what a run writes, where, and that only one run writes it.

Shareable outputs (contain only privately released quantities and public facts):

- ``config.toml``: the resolved config (written first: from then on the directory holds this run);
- ``metrics.jsonl``: one line per evaluation (step, epoch, test accuracy, epsilon);
- ``ledger.json``: the privacy ledger (a copy of the checkpoint's, never ahead of it);
- ``summary.json``: the final privacy/utility report;
- ``model.pt``: the released model (the last iterate); ``model_ema.pt``: the weight average of the released iterates,
  with ``training.ema``;
- ``hf_model/``, ``hf_adapter/``: a Hugging Face model as ``save_pretrained`` directories (:mod:`dptrain.models.hf_save`);
- ``preprocessing.json`` / ``plan.json`` where the run has them.

Secret, in ``private/`` (mode 0700): ``checkpoint.pt``, the state needed to resume (model, optimizer, the states
of the random generators, ledger). Whoever reads the generator states can recompute the noise: never share
this directory. ``private/README`` says so.

A run holds an exclusive lock (``fcntl.flock`` on ``.lock``) for its whole life, so a second run started into
the same directory is refused at once instead of interleaving its files with the first. Every file is written
through a uniquely named temporary file and a rename: readers never see half a file, and two writers never
share a temporary name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dptrain.accounting.ledger import Ledger
from dptrain.errors import DataError, RunDirectoryError

CONFIG, METRICS, LEDGER, SUMMARY, MODEL = "config.toml", "metrics.jsonl", "ledger.json", "summary.json", "model.pt"
PREPROCESSING, PLAN, MODEL_EMA = "preprocessing.json", "plan.json", "model_ema.pt"
PRIVATE, CHECKPOINT, LOCK = "private", "checkpoint.pt", ".lock"
#: A hyperparameter search's secret state (``dptrain tune``): its presence makes the directory a search's, which only
#: ``dptrain tune --resume`` continues (a run trained into it would release a model the search's certificate does not
#: cover).
SEARCH_STATE = "search.pt"
#: Files whose presence means a run released something (its ledger says so for the rest).
RELEASE_FILES = (SUMMARY, MODEL, METRICS, PREPROCESSING, MODEL_EMA)

#: Permission bits of shareable files: what the user's umask allows (mkstemp alone would make them 0600).
_UMASK = os.umask(0)
os.umask(_UMASK)
SHAREABLE_MODE = 0o666 & ~_UMASK
SHAREABLE_DIR_MODE = 0o777 & ~_UMASK

PRIVATE_README = """\
SECRET: do not share this directory.

checkpoint.pt holds the state needed to resume the run, including the states of the random generators that
drew the batches and the noise. Whoever has them can recompute the noise and remove it from the released
model. Share only the files one level up (config.toml, summary.json, metrics.jsonl, ledger.json, model.pt).
Delete this directory once the run has finished and will not be resumed.
"""


def _os_error(path: Path, e: OSError, what: str) -> RunDirectoryError:
    reason = os.strerror(e.errno) if e.errno else type(e).__name__
    return RunDirectoryError(f"cannot {what} {path}: {reason}")


class RunDirectory:
    """The files of one run (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock_file = None

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def checkpoint(self) -> Path:
        return self.path / PRIVATE / CHECKPOINT

    def holds_run(self) -> bool:
        """True once a run or a search has claimed the directory (its checkpoint at step 0, or a search's state, and
        its config are written first)."""
        return (
            any((self.path / name).exists() for name in (CONFIG, LEDGER, SUMMARY))
            or self.checkpoint.exists()
            or self.holds_search()
        )

    def holds_search(self) -> bool:
        """True for a hyperparameter search's directory (its secret state, :data:`SEARCH_STATE`)."""
        return (self.path / PRIVATE / SEARCH_STATE).exists()

    def refuse_search(self) -> None:
        """A search's directory is continued by ``dptrain tune --resume`` only: refused to every run."""
        if self.holds_search():
            raise RunDirectoryError(
                f"{self.path} holds a hyperparameter search, not a run: continue it with dptrain tune --resume "
                f"{self.path}, or choose another --out"
            )

    def released_anything(self) -> bool:
        """Whether a run in this directory released anything: a released file (summary, model, metrics, a stage's
        statistics) or a ledger (the checkpoint's or its copy) that records a release. An unreadable ledger or
        checkpoint counts as a release, and so does a search (it drew its secret number of trials): only a directory
        known to hold nothing released may be started afresh."""
        if self.holds_search():
            return True
        if any((self.path / name).exists() for name in RELEASE_FILES):
            return True
        if (self.path / LEDGER).exists():
            try:
                if Ledger.load(self.path / LEDGER).releases:
                    return True
            except DataError:
                return True
        if self.checkpoint.exists():
            try:
                return Ledger.from_dict(self.load_checkpoint()["ledger"]).releases > 0
            except (DataError, KeyError, ValueError):
                return True
        return False

    def refuse_foreign(self) -> None:
        """Refuse to start a run or a search in a directory that holds files dptrain did not make there. A run or a
        search claims a directory that is new, empty, or already dptrain's (its ``.lock``, made before any other file):
        in another, what it writes (``config.toml``, ``summary.json``, ...) would replace the user's own files, a run
        that released nothing would be discarded with the user's ``config.toml``, and a search's end (its shareable
        files written again and given one time) would alter them."""
        if not self.path.is_dir() or (self.path / LOCK).exists():
            return
        try:
            names = sorted(p.name for p in self.path.iterdir())
        except OSError as e:
            raise _os_error(self.path, e, "read") from None
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise RunDirectoryError(
                f"output directory {self.path} holds files that are not a dptrain run's ({', '.join(names[:3])}{more}): "
                "a run writes config.toml, summary.json, model.pt, ... there and would replace them; choose a new or "
                "empty directory"
            )

    def refuse_if_holding(self) -> None:
        """Refuse a directory that holds a run which released something, or files that are not a run's
        (:meth:`refuse_foreign`). A run that released nothing (stopped before
        its first step: an error at step 1, a signal or kill -9 in its first moments) does not count: a new run may
        start there afresh (:meth:`discard_unreleased`, under the lock). A search's directory is always refused."""
        self.refuse_search()
        if self.holds_run() and self.released_anything():
            way = f"continue it with --resume {self.path} or " if self.checkpoint.exists() else ""  # (not a copy: best/)
            raise RunDirectoryError(f"output directory {self.path} already holds a run; {way}choose another --out")
        self.refuse_foreign()

    def discard_unreleased(self) -> bool:
        """Remove the files of a run that released nothing (call it holding the lock, after :meth:`refuse_if_holding`);
        True if there was one."""
        if not self.holds_run():
            return False
        for path in (self.path / CONFIG, self.path / PLAN, self.path / LEDGER, self.checkpoint):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return True

    # -- the lock -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self, create: bool = False):
        """Hold the directory's exclusive lock (creating the directory first if ``create``: a new run's or search's,
        which may not be a directory holding files dptrain did not make, :meth:`refuse_foreign`)."""
        if self.path.exists() and not self.path.is_dir():
            raise RunDirectoryError(f"output directory {self.path} exists and is not a directory")
        made = create and not self.path.exists()
        if create:
            self.refuse_foreign()  # (a directory dptrain did not make: the user's own files)
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise _os_error(self.path, e, "create the output directory") from None
        elif not self.path.is_dir():
            raise RunDirectoryError(f"{self.path} is not a run directory (it does not exist)")
        try:
            f = open(self.path / LOCK, "a+")  # noqa: SIM115  (held open for the lock's lifetime)
        except OSError as e:
            raise _os_error(self.path, e, "write into the output directory") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirectoryError(
                    f"output directory {self.path} is in use by another dptrain run; wait for it to finish or choose "
                    "another --out"
                ) from None
            raise _os_error(self.path, e, "lock") from None
        self._lock_file = f
        try:
            yield self
        except BaseException:
            if create:  # refused before it wrote anything: no directory (or lock) left behind for the user to remove
                self._unclaim(made)
            raise
        finally:
            self._lock_file = None
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()

    def _unclaim(self, made: bool) -> None:
        """Undo :meth:`locked`'s claim of a directory in which nothing but its lock was written (a run or search
        refused before its first file): the lock goes, and the directory too if the claim made it."""
        with contextlib.suppress(OSError):
            if [p.name for p in self.path.iterdir()] == [LOCK]:
                (self.path / LOCK).unlink()
                if made:
                    self.path.rmdir()

    # -- writing ------------------------------------------------------------------------------------------
    def _atomic(self, name: str, write, directory: Path | None = None, mode: int = SHAREABLE_MODE) -> None:
        directory = directory or self.path
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.chmod(tmp, mode)
            os.replace(tmp, directory / name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def write_text(self, name: str, text: str) -> None:
        self._atomic(name, lambda f: f.write(text.encode()))

    def write_bytes(self, name: str, data: bytes) -> None:
        self._atomic(name, lambda f: f.write(data))

    def write_json(self, name: str, data: Any) -> None:
        self.write_text(name, json.dumps(data, indent=2, allow_nan=False) + "\n")

    def save_model(self, payload: dict, name: str = MODEL) -> None:
        self._atomic(name, lambda f: torch.save(payload, f))

    def save_directory(self, name: str, write) -> Path:
        """A shareable directory ``name``, written by ``write(path)`` into a temporary directory and renamed into place
        (a reader never sees half of it; one written before is replaced). Returns its path."""
        tmp = Path(tempfile.mkdtemp(dir=self.path, prefix=f".{name}.", suffix=".tmp"))
        target = self.path / name
        try:
            write(tmp)
            for p in tmp.rglob("*"):
                os.chmod(p, SHAREABLE_DIR_MODE if p.is_dir() else SHAREABLE_MODE)
            os.chmod(tmp, SHAREABLE_DIR_MODE)
            if target.exists():
                old = Path(tempfile.mkdtemp(dir=self.path, prefix=f".{name}.", suffix=".old"))
                os.replace(target, old / name)
                shutil.rmtree(old)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    def save_checkpoint(self, state: dict, ledger: Ledger) -> None:
        """The secret checkpoint, then the shareable ledger copy (so ledger.json is never ahead of it)."""
        private = self.path / PRIVATE
        private.mkdir(mode=0o700, exist_ok=True)
        os.chmod(private, 0o700)
        if not (private / "README").exists():
            (private / "README").write_text(PRIVATE_README)
        self._atomic(CHECKPOINT, lambda f: torch.save(state, f), private, mode=0o600)
        self.write_json(LEDGER, ledger.to_dict())

    def save_private(self, name: str, state: Any) -> None:
        """A secret file in ``private/`` (mode 0600): e.g. a tuning search's state (its number of trials)."""
        private = self.path / PRIVATE
        private.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(private, 0o700)
        if not (private / "README").exists():
            (private / "README").write_text(PRIVATE_README)
        self._atomic(name, lambda f: torch.save(state, f), private, mode=0o600)

    def load_private(self, name: str) -> Any:
        path = self.path / PRIVATE / name
        try:
            return torch.load(path, weights_only=True)
        except FileNotFoundError:
            raise DataError(f"{path} does not exist: is this a dptrain directory?") from None
        except Exception as e:  # a truncated or foreign file
            raise DataError(f"{path} is corrupt or not dptrain's ({type(e).__name__})") from None

    # -- reading ------------------------------------------------------------------------------------------
    def load_checkpoint(self) -> dict:
        path = self.checkpoint
        try:
            state = torch.load(path, weights_only=True)
            Ledger.from_dict(state["ledger"])
            return state
        except FileNotFoundError:
            raise DataError(f"checkpoint {path} does not exist: is this a dptrain run directory?") from None
        except Exception as e:  # a truncated or foreign file can fail in many ways inside torch.load
            raise DataError(
                f"checkpoint {path} is corrupt or not a dptrain checkpoint ({type(e).__name__})"
            ) from None

    def check_ledger_copy(self, authoritative: Ledger) -> None:
        """ledger.json must be the checkpoint's ledger or a prefix of it (a crash between writing the checkpoint and
        its copy leaves the copy behind, never ahead); anything else was edited or comes from another run."""
        path = self.path / LEDGER
        if not path.exists():
            return
        try:
            copy = Ledger.load(path)
        except DataError:
            copy = None
        if copy is not None and copy.releases > authoritative.releases and authoritative.is_prefix_of(copy):
            raise DataError(
                f"{path} records {copy.releases} releases, the run's checkpoint {authoritative.releases}: the checkpoint "
                "is older than the run (restored, or edited), and resuming it would release those steps again "
                "unaccounted; restore the run's last checkpoint"
            )
        if copy is None or not copy.is_prefix_of(authoritative):
            raise DataError(
                f"{path} does not match the run's checkpoint (edited, or from another run); the checkpoint's ledger "
                f"is authoritative: restore {LEDGER} to resume"
            )

    def metrics_hash(self) -> dict:
        """What a checkpoint keeps of the metrics the run has released so far: how many complete rows
        ``metrics.jsonl`` holds and the SHA-256 of their text (:meth:`check_metrics_copy`)."""
        rows = self._metrics_rows()
        return {"rows": len(rows), "sha256": _rows_sha256(rows)}

    def check_metrics_copy(self, kept: dict | None) -> None:
        """``metrics.jsonl`` must begin with the rows the checkpoint's run had released when it was written
        (``kept``: :meth:`metrics_hash`; rows after them are the ones a kill left between a row and its checkpoint,
        dropped or kept by the resume as their steps say). Rows that differ mean an edited file or another run's
        checkpoint put in this directory (a run of the same config: its ledger is this run's, step for step), whose
        resume would release a second trajectory after the first one's evaluations, accounted once. Refused in one
        line. A checkpoint without the hash (an older dptrain) is not checked, nor a deleted file (the resume writes
        the rows that follow; the deleted ones are not released again)."""
        if not isinstance(kept, dict) or not (self.path / METRICS).exists():
            return
        rows = self._metrics_rows()
        n = int(kept.get("rows", -1))
        if not 0 <= n <= len(rows) or _rows_sha256(rows[:n]) != kept.get("sha256"):
            raise DataError(
                f"{self.path / METRICS} does not hold the evaluations the run's checkpoint released (edited, or the "
                "checkpoint is another run's): a resume continues only the run whose releases the directory holds; "
                "restore the run's checkpoint and metrics"
            )

    def read_json(self, name: str) -> dict | None:
        try:
            return json.loads((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def _metrics_rows(self) -> list[str]:
        """The complete rows of ``metrics.jsonl`` (a last line without its newline is a write cut short by a kill: it
        is not a row); a row that is not JSON was edited, and is refused in one line."""
        path = self.path / METRICS
        try:
            text = path.read_text()
        except FileNotFoundError:
            return []
        lines = text.split("\n")[:-1]  # (what follows the last newline was never completed)
        for line in lines:
            try:
                json.loads(line)
            except ValueError:
                raise DataError(f"{path} holds a line that is not a metrics row (edited?): restore or delete it") from None
        return lines

    def metrics_rows(self) -> list[dict]:
        """The complete rows of ``metrics.jsonl``, parsed (none if there is no such file)."""
        return [json.loads(line) for line in self._metrics_rows()]

    def append_metrics(self, row: dict) -> None:
        """One row per step: a row for the step of the last one is not written again (a run killed after its final
        evaluation and resumed evaluates the same model at the same step; its row is already there)."""
        rows = self._metrics_rows()
        if rows and json.loads(rows[-1]).get("step") == row.get("step"):
            return
        text = "".join(line + "\n" for line in rows)
        if (self.path / METRICS).exists() and (self.path / METRICS).read_text() != text:
            self.write_text(METRICS, text)  # (a line cut short by a kill goes before a row follows it)
        with open(self.path / METRICS, "a") as f:
            f.write(json.dumps(row) + "\n")

    def truncate_metrics(self, last_step: int) -> None:
        """Drop metric rows after ``last_step`` (written after the checkpoint a resumed run restarts from), and a last
        line cut short by a kill."""
        path = self.path / METRICS
        if not path.exists():
            return
        rows = self._metrics_rows()
        keep = [line for line in rows if json.loads(line).get("step", 0) <= last_step]
        text = "".join(line + "\n" for line in keep)
        if path.read_text() != text:
            self.write_text(METRICS, text)


def _rows_sha256(rows: list[str]) -> str:
    """The SHA-256 of metrics rows as the file holds them (one per line)."""
    return hashlib.sha256("".join(r + "\n" for r in rows).encode()).hexdigest()


def fresh_directory(base: str | os.PathLike) -> Path:
    """``base`` if it holds no run, else the first of ``base-2``, ``base-3``, ... that does not: a default output
    directory never collides with an earlier run."""
    base = Path(base)
    candidate, k = base, 1
    while RunDirectory(candidate).holds_run():
        k += 1
        candidate = base.with_name(f"{base.name}-{k}")
    return candidate
