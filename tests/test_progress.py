"""stages.support.progress: a bar on a terminal, a line every tenth or EVERY_S seconds elsewhere (a fake clock)."""

from __future__ import annotations

import io

import pytest

from stages.support.progress import EVERY_S, Progress, elapsed


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_with_a_total_a_line_at_every_tenth() -> None:
    stream, clock = io.StringIO(), FakeClock()
    with Progress("reproduce cora", "seeds", total=100, stream=stream, clock=clock) as progress:
        for _ in range(25):
            clock.now += 4.0  # 4 s a batch of 4 seeds: the tenths come before the 30 s
            progress.update(4)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "reproduce cora: 12/100 seeds (12 %), 12 s"
    assert [line.split("(")[1].split(")")[0] for line in lines] == [f"{p} %" for p in
                                                                    (12, 20, 32, 40, 52, 60, 72, 80, 92, 100)]
    assert lines[-1] == "reproduce cora: 100/100 seeds (100 %), 1 min 40 s"


def test_with_a_total_the_clock_prints_between_tenths() -> None:
    stream, clock = io.StringIO(), FakeClock()
    with Progress("reproduce cora", "seeds", total=1000, stream=stream, clock=clock) as progress:
        for _ in range(9):
            clock.now += 12.0
            progress.update()
    # no tenth passed (9 of 1000): only the clock, at 36 s and 72 s, each 30 s or more after the line before
    assert stream.getvalue().splitlines() == ["reproduce cora: 3/1000 seeds (0 %), 36 s",
                                              "reproduce cora: 6/1000 seeds (0 %), 1 min 12 s",
                                              "reproduce cora: 9/1000 seeds (0 %), 1 min 48 s"]


def test_without_a_total_only_the_clock_with_the_postfix() -> None:
    stream, clock = io.StringIO(), FakeClock()
    with Progress("train cora", "epochs", stream=stream, clock=clock) as progress:
        for epoch in range(1, 301):
            clock.now += 0.25
            progress.update(postfix={"val_acc": f"{epoch / 1000:.3f}"})
    lines = stream.getvalue().splitlines()
    assert lines == ["train cora: 120 epochs, 30 s (val_acc 0.120)",
                     "train cora: 240 epochs, 1 min 0 s (val_acc 0.240)"]


def test_nothing_before_the_first_step_or_interval() -> None:
    stream, clock = io.StringIO(), FakeClock()
    with Progress("train cora", "epochs", stream=stream, clock=clock) as progress:
        clock.now += EVERY_S - 0.5
        progress.update()
    assert stream.getvalue() == ""


def test_a_terminal_gets_the_bar_and_no_lines() -> None:
    stream = Terminal()
    with Progress("reproduce cora", "seeds", total=10, stream=stream) as progress:
        progress.write("reproduce cora: on a cluster")
        progress.update(10)
    shown = stream.getvalue()
    assert "reproduce cora: on a cluster\n" in shown
    assert "10/10" in shown and "seed/s" in shown and "(100 %)" not in shown  # tqdm's bar, not a line


def test_write_without_a_terminal_is_a_plain_line() -> None:
    stream = io.StringIO()
    with Progress("reproduce cora", "seeds", total=10, stream=stream) as progress:
        progress.write("reproduce cora: on a cluster")
    assert stream.getvalue() == "reproduce cora: on a cluster\n"


def test_a_closed_stream_does_not_stop_the_work() -> None:
    stream = io.StringIO()
    stream.close()
    with Progress("reproduce cora", "seeds", total=2, stream=stream) as progress:
        progress.update(2)
    assert progress.count == 2


@pytest.mark.parametrize(("seconds", "shown"), [(0.4, "0 s"), (59.9, "59 s"), (60, "1 min 0 s"), (112, "1 min 52 s"),
                                                (3780, "1 h 3 min")])
def test_elapsed(seconds: float, shown: str) -> None:
    assert elapsed(seconds) == shown
