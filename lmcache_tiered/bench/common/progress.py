"""The bench's progress bars (rich, on stderr), and the sinks a replay
reports its finished requests to: a bar here, or a counter shared with the
parent when the replay runs in a process of its own.

May touch: stderr.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import rich.progress
from rich.console import Console


def finished_note(wall_s: float) -> str:
    """What a finished variant's bar says."""
    return f"done in {wall_s:.0f}s"


class ProgressSink(Protocol):
    """What a replay reports its progress to."""

    def advance(self, count: int = 1) -> None: ...

    def close(self, note: str = "") -> None: ...


class SharedCount:
    """Progress counted in a value shared with the parent process (a
    ``multiprocessing`` manager's ``Value``), which draws the bar."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def advance(self, count: int = 1) -> None:
        self.value.value += count

    def close(self, note: str = "") -> None:
        """The parent closes the bar when the process is done."""


class Progress:
    """One variant's progress bar on stderr (rich: redrawn on a terminal;
    elsewhere, e.g. a log file, only its final state is written). The bars
    of variants replayed at once share one live display, as rich allows one
    only: the first bar starts it, the last one closed stops it."""

    _lock = threading.Lock()
    _board: rich.progress.Progress | None = None
    _open = 0

    def __init__(self, label: str, total: int, console: Console | None = None):
        with Progress._lock:
            if Progress._board is None:
                Progress._board = rich.progress.Progress(
                    rich.progress.TextColumn("{task.description:<28}"),
                    rich.progress.BarColumn(),
                    rich.progress.MofNCompleteColumn(),
                    rich.progress.TimeElapsedColumn(),
                    rich.progress.TextColumn("{task.fields[note]}"),
                    console=console or Console(stderr=True),
                )
                Progress._board.start()
            Progress._open += 1
            self._bar = Progress._board
            self._task = self._bar.add_task(label, total=max(total, 1), note="")

    def advance(self, count: int = 1) -> None:
        self._bar.advance(self._task, count)

    def close(self, note: str = "") -> None:
        self._bar.update(self._task, note=note)
        with Progress._lock:
            Progress._open -= 1
            if Progress._open == 0:
                self._bar.stop()
                Progress._board = None
