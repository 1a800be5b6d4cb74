"""What a long solve shows while it runs: elapsed time, the incumbent plan's time, the bound and the gap.

Nothing for the first QUIET_S seconds (most plans are solved by then); after that one line that
updates in place on a terminal, or a log line every LOG_EVERY_S seconds where stderr is no terminal
(a job's log file). Planning runs on rank 0 alone, so only rank 0 shows it.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("autojigsaw")

QUIET_S = 5.0  # a solve shorter than this shows nothing
LOG_EVERY_S = 10.0  # seconds between log lines where stderr is not a terminal
REDRAW_S = 0.5  # seconds between redraws of the terminal line


class SolveProgress:
    """Told the incumbent and the bound (seconds per step) as a solve runs; shows them past QUIET_S.

        progress = SolveProgress()
        progress.update(incumbent=8.5e-3, bound=8.3e-3)
        progress.close()
    """

    def __init__(self, stream: TextIO | None = None, clock=time.perf_counter):
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.start = clock()
        self.incumbent = float("inf")
        self.bound = float("-inf")
        self._shown_at = None  # when the last line was shown
        self._on_terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn = False  # a terminal line is up, to be ended by close()

    def update(self, incumbent: float | None = None, bound: float | None = None) -> None:
        """Record a better incumbent or bound (either may be None) and show them when it is time."""
        if incumbent is not None and incumbent < self.incumbent:
            self.incumbent = incumbent
        if bound is not None and bound > self.bound:
            self.bound = min(bound, self.incumbent)
        now = self.clock()
        if now - self.start < QUIET_S:
            return
        every = REDRAW_S if self._on_terminal else LOG_EVERY_S
        if self._shown_at is not None and now - self._shown_at < every:
            return
        self._shown_at = now
        if self._on_terminal:
            self.stream.write("\r" + self.line(now) + "\033[K")
            self.stream.flush()
            self._drawn = True
        else:
            log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        """"planning: 12 s, best plan 8.481 ms/step, bound 8.311 ms, within 2.0 % of optimal"."""
        elapsed = (self.clock() if now is None else now) - self.start
        text = f"planning: {elapsed:.0f} s"
        if self.incumbent < float("inf"):
            text += f", best plan {_ms(self.incumbent)}/step"
        if self.bound > float("-inf"):
            text += f", bound {_ms(self.bound)}"
        if self.incumbent < float("inf") and self.bound > float("-inf") and self.incumbent > 0:
            text += f", within {max(self.incumbent - self.bound, 0.0) / self.incumbent:.1%} of optimal"
        return text

    def close(self) -> None:
        """End the terminal line, if one was drawn."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
