"""What a search shows while it runs: its elapsed time only, never a count of trials.

The number of trials K is secret (Papernot & Steinke's theorems assume it is not released), and so is where the best
trial stands among them. A progress bar counting trials, or one warning line per trial on stderr (a seed's warning,
a stage's notice, a resumed trial's message), would count them for whoever reads the terminal or its log. So a
search shows a clock that ticks on its own, independent of the trials, on a terminal only (:class:`Elapsed`), and runs each trial with
its standard streams, Python warnings and the ``logging`` handlers that write to the terminal captured
(:func:`captured`): what a trial says is kept in the search's secret state, shown only on request (``--keep-trials``,
labelled not private). A library's logging handler made before the search (transformers makes one when first used)
holds the terminal's stream itself, and a Hugging Face model logs its load report each time a trial builds it: such a
handler writes into the capture too while a trial runs. A handler that writes elsewhere (a log file, a queue) handles
nothing while a trial runs: its records are kept with the trial's messages (a file's length would count the trials).

What cannot be captured this way: output that bypasses Python (C code writing to the file descriptors).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
import time
import warnings


class Elapsed:
    """A line on stderr, rewritten every ``interval`` seconds by a thread of its own: ``label`` and the time since it
    started. It reads nothing of the search, so what it shows depends on the clock alone, but its last reading is the
    search's duration, which grows with K: it is shown only on a terminal, to whoever watches (and sees the time
    anyway), and erased when the search ends, leaving ``label``. A stderr that is not a terminal (a log, a pipe) gets
    ``label`` once: every redraw would stay in it, one a second."""

    def __init__(self, label: str, enabled: bool = True, interval: float = 1.0):
        self.label, self.enabled, self.interval = label, enabled, interval
        self.stream = sys.stderr  # (the terminal's stream, kept: a trial's own output is captured meanwhile)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()
        try:
            self.live = bool(self.stream.isatty())
        except (AttributeError, OSError, ValueError):
            self.live = False

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(text)
            self.stream.flush()

    def _show(self) -> None:
        seconds = int(time.monotonic() - self._start)
        self._write(f"\r{self.label} {seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}")

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self._show()

    def __enter__(self) -> Elapsed:
        if self.enabled and not self.live:
            self._write(f"{self.label}\n")
        elif self.enabled:
            self._show()
            self._thread = threading.Thread(target=self._tick, name="dptrain-elapsed", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._write(f"\r\033[K{self.label}\n")  # (the clock erased: the line ends without a time)


def _all_handlers() -> list[logging.Handler]:
    """Every ``logging`` handler of every logger made so far (the root's included), each once."""
    loggers = [logging.getLogger(), *(x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger))]
    return list({id(h): h for logger in loggers for h in logger.handlers}.values())


def _terminal_handlers(streams) -> list[logging.StreamHandler]:
    """Every ``logging`` handler, of every logger made so far, that writes to one of ``streams``."""
    return [h for h in _all_handlers()
            if isinstance(h, logging.StreamHandler) and any(h.stream is s for s in streams)]


class _Kept(logging.Filter):
    """On a handler that does not write to the terminal (a log file, a queue) while a trial runs: its records are kept
    with the trial's messages (once, whichever handlers see them) and not handled: a file's length would count the
    trials."""

    def __init__(self, into: list[str]):
        super().__init__()
        self.into, self.seen = into, {}  # (id -> the record, held: an id is not reused while it is kept)

    def filter(self, record: logging.LogRecord) -> bool:
        if id(record) not in self.seen:
            self.seen[id(record)] = record
            self.into.append(f"{record.levelname}: {record.getMessage()}")
        return False


@contextlib.contextmanager
def captured(into: list[str]):
    """Run the block with ``sys.stdout``, ``sys.stderr``, Python warnings and the logging handlers that write to the
    terminal captured; what they received is appended to ``into`` (one string per message), also when the block
    raises. A handler made during the block (it took the capture for the terminal) is given the terminal back."""
    out = io.StringIO()
    terminal = [s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None]
    handlers = [(h, h.stream) for h in _terminal_handlers(terminal)]
    for handler, _ in handlers:
        handler.setStream(out)
    elsewhere, kept = [h for h in _all_handlers() if all(h is not t for t, _ in handlers)], []
    keep = _Kept(kept)
    for handler in elsewhere:
        handler.addFilter(keep)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                yield
            finally:
                into.extend(line for line in out.getvalue().splitlines() if line.strip())
                into.extend(f"{m.category.__name__}: {m.message}" for m in w)
    finally:
        for handler in elsewhere:
            handler.removeFilter(keep)
        into.extend(kept)
        for handler, stream in handlers:
            handler.setStream(stream)
        for handler in _terminal_handlers([out]):  # (made by the block, with the capture as its stream)
            handler.setStream(sys.stderr)


__all__ = ["Elapsed", "captured"]
