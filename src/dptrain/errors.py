"""Errors a user can cause. The CLI prints them on one line and exits with code 2."""


def one_line(exc: BaseException, limit: int | None = None) -> str:
    """An exception's message on one line (whitespace collapsed; its type's name when it has none), at most ``limit``
    characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if limit is None else text[:limit]


class DPTrainError(Exception):
    """Base class for every error caused by user input (config, data, parameters, models)."""


class ConfigError(DPTrainError, ValueError):
    """A configuration key is unknown, has the wrong type, or holds an impossible value."""


class DataError(DPTrainError, ValueError):
    """A data file is missing, corrupt or truncated."""


class ModelError(DPTrainError, ValueError):
    """A model cannot be trained privately as it is (e.g. it mixes examples in a batch)."""


class AccountingError(DPTrainError, ValueError):
    """An accountant cannot certify what it was asked to (it refuses instead of guessing)."""


class NoFiniteEpsilon(AccountingError):
    """The noise is too small for any finite epsilon (calibration reads this as epsilon = infinity)."""


class BudgetExhausted(DPTrainError):
    """The privacy budget does not allow even one more release."""


class RunNotFinished(DPTrainError, RuntimeError):
    """The last iterate was asked for before all T steps ran (intermediate iterates are not private releases),
    or a step was asked for after all T steps ran."""


class NonFiniteError(DPTrainError, ArithmeticError):
    """Training produced NaN or infinite values (a learning rate or clip norm too large, a loss that overflows):
    the run stops instead of saving a NaN model."""


class RunDirectoryError(DPTrainError, OSError):
    """A run directory is in use by another run, already holds a run, or cannot be written."""


class RankLost(DPTrainError, RuntimeError):
    """Another rank of a data-parallel run stopped in the middle of a step (nothing of that step was released)."""
