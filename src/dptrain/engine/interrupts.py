"""Interrupts that never split a step: SIGINT (Ctrl-C) and SIGTERM (schedulers, containers) wait for the end
of the step or the checkpoint being written, then take effect.

A private step draws a batch, draws noise, records the release and updates the model. An interrupt in the
middle of it would leave a state that never existed in an uninterrupted run (a generator advanced past a
batch that was never used, a ledger entry without its update), and a checkpoint of that state would resume
into a different run. :func:`deferred_signals` holds the two signals for the duration of a block and delivers
them, in order, when it ends; :func:`terminate_as_exception` turns SIGTERM into a :class:`Terminated`
exception so that a run can checkpoint and stop cleanly instead of dying.

Signal handlers can only be installed from the main thread; elsewhere both helpers do nothing (there are no
signals to defer there).
"""

from __future__ import annotations

import contextlib
import signal
import threading

try:  # CPython's C module behind ``signal``: the same calls without the enum conversions (~1 us instead of ~6)
    import _signal as _raw
except ImportError:  # pragma: no cover - another Python
    _raw = signal

DEFERRED = (signal.SIGINT, signal.SIGTERM)
_DEFERRED_NUMBERS = tuple(int(s) for s in DEFERRED)


class Terminated(BaseException):  # noqa: N818  (like KeyboardInterrupt, not an Exception subclass)
    """SIGTERM arrived; raised at a step boundary by :func:`terminate_as_exception`."""

    exit_code = 143  # 128 + SIGTERM, what a shell reports for a process ended by SIGTERM


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deferred_signals():
    """Hold SIGINT and SIGTERM until the block ends, then deliver them (at most once each, in arrival order)."""
    if not _main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum, frame):
        if signum not in pending:
            pending.append(signum)

    previous = {s: _raw.signal(s, hold) for s in _DEFERRED_NUMBERS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            _raw.signal(s, handler)
        for s in pending:
            signal.raise_signal(s)  # runs the handler that was in place before the block


@contextlib.contextmanager
def terminate_as_exception():
    """Within the block, SIGTERM raises :class:`Terminated` (at the next step boundary, with deferral)."""
    if not _main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
