"""What a search shows while it runs: its elapsed time only, never a count of trials.

The number of trials K is secret (Papernot & Steinke's theorems assume it is not released), and so is where the best
trial stands among them. A progress bar counting trials, or one warning line per trial on stderr (a seed's warning,
a stage's notice, a resumed trial's message), would count them for whoever reads the terminal or its log. So a
search shows a clock that ticks on its own, independent of the trials (:class:`Elapsed`), and runs each trial with
its standard streams and Python warnings captured (:func:`captured`): what a trial says is kept in the search's
secret state, shown only on request (``--keep-trials``, labelled not private).

What cannot be captured this way: output that bypasses Python's ``sys.stdout``/``sys.stderr`` (C code writing to the
file descriptors, a ``logging`` handler made before the search that holds the original stream).
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import time
import warnings


class Elapsed:
    """A line on stderr, rewritten every ``interval`` seconds by a thread of its own: ``label`` and the time since it
    started. It reads nothing of the search, so what it shows depends on the clock alone."""

    def __init__(self, label: str, enabled: bool = True, interval: float = 1.0):
        self.label, self.enabled, self.interval = label, enabled, interval
        self.stream = sys.stderr  # (the terminal's stream, kept: a trial's own output is captured meanwhile)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()

    def _show(self) -> None:
        seconds = int(time.monotonic() - self._start)
        text = f"\r{self.label} {seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(text)
            self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self._show()

    def __enter__(self) -> Elapsed:
        if self.enabled:
            self._show()
            self._thread = threading.Thread(target=self._tick, name="dptrain-elapsed", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._show()
            with contextlib.suppress(OSError, ValueError):
                self.stream.write("\n")
                self.stream.flush()


@contextlib.contextmanager
def captured(into: list[str]):
    """Run the block with ``sys.stdout``, ``sys.stderr`` and Python warnings captured; what they received is appended
    to ``into`` (one string per message), also when the block raises."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            into.extend(line for line in out.getvalue().splitlines() if line.strip())
            into.extend(f"{m.category.__name__}: {m.message}" for m in w)


__all__ = ["Elapsed", "captured"]
