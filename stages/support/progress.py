"""How a long stage shows it is moving: tqdm's bar on a terminal, short lines everywhere else.

    with Progress("reproduce cora", "seeds", total=100) as progress:
        progress.update(4)                      # four more seeds done
    with Progress("train cora", "epochs") as progress:
        progress.update(postfix={"val_acc": "0.812"})

On a terminal (stderr is a TTY) this is tqdm's bar, as before. Where stderr is a file or a pipe (CI, `nohup`,
a queued `dvc exp run`), a bar would print nothing (tqdm's `disable=None`) or one garbled line, so a line is
printed instead, each time the count passes another tenth of `total`, or `EVERY_S` seconds after the last line,
whichever comes first: `reproduce cora: 40/100 seeds (40 %), 1 min 52 s`. Without a total (training stops
early, at an epoch nobody knows in advance) only the clock counts: `train cora: 350 epochs, 30 s (val_acc
0.812)`. Both are checked when the count moves (a seed or an epoch ends), so a line never interrupts work.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Callable, Mapping, TextIO

from tqdm import tqdm

# At most this long between two lines when stderr is not a terminal (and the count moves).
EVERY_S = 30.0
# With a total, a line each time the count passes another 1/STEPS of it.
STEPS = 10


def elapsed(seconds: float) -> str:
    """`45 s`, `1 min 52 s`, `1 h 3 min`: a duration as a person reads it."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


def _say(line: str, stream: TextIO) -> None:
    """One line, on a stream that may be a pipe whose reader (a dead dvc) is gone: progress is never worth a crash."""
    try:
        print(line, file=stream, flush=True)
    except (OSError, ValueError):
        pass


class Progress:
    """A progress display for `desc` counting `unit`; see the module docstring. Use it as a context manager."""

    def __init__(self, desc: str, unit: str, total: int | None = None, *, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.desc, self.unit, self.total = desc, unit, total
        self._stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._bar: tqdm | None = None
        if _is_terminal(self._stream):
            # tqdm names a rate per unit: `seed/s`, not `seeds/s`.
            self._bar = tqdm(total=total, desc=desc, unit=unit.removesuffix("s"), file=self._stream)
        self.count = 0
        self._start = self._last_line = clock()
        self._next_step = 1

    def update(self, n: int = 1, postfix: Mapping[str, str] | None = None) -> None:
        """`n` more done; `postfix` (name -> shown value) follows the count."""
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix(postfix)
            return
        now = self._clock()
        step_passed = False
        if self.total:
            reached = self.count * STEPS // self.total
            if reached >= self._next_step:
                step_passed, self._next_step = True, reached + 1
        if step_passed or now - self._last_line >= EVERY_S:
            self._last_line = now
            _say(self._line(now, postfix), self._stream)

    def write(self, line: str) -> None:
        """A line of its own: above the bar on a terminal, else as it is."""
        if self._bar is not None:
            self._bar.write(line, file=self._stream)
        else:
            _say(line, self._stream)

    def _line(self, now: float, postfix: Mapping[str, str] | None) -> str:
        count = (f"{self.count}/{self.total} {self.unit} ({100 * self.count // self.total} %)" if self.total
                 else f"{self.count} {self.unit}")
        after = f" ({', '.join(f'{name} {value}' for name, value in postfix.items())})" if postfix else ""
        return f"{self.desc}: {count}, {elapsed(now - self._start)}{after}"

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: no bar
        return False
