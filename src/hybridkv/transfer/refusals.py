"""What refused input costs a receiver: a capped ring of recent reasons, a count, a rate-limited log.

A peer that needs no key to reach a port (any local process, anyone on the network) can send
refused frames as fast as it likes; each must cost bounded memory and bounded log output.

Invariants:
- ``count`` counts every refusal; ``recent`` keeps the last ``keep`` reasons (older ones drop).
- At most ``burst`` refusals are logged one by one per ``period_s``; the rest are counted and
  said in one line ("N refusals by WHO not logged ...") when the next period's first refusal
  is logged or at ``flush`` (the owner calls it when it closes). ``logged + dropped == count``
  where ``dropped`` is every refusal said only in such a line.
"""

from __future__ import annotations

import logging
import time
from collections import deque


class Refusals:
    def __init__(
        self, log: logging.Logger, who: str, *, keep: int = 1000, burst: int = 10, period_s: float = 10.0
    ) -> None:
        self.log, self.who = log, who
        self.recent: deque[str] = deque(maxlen=keep)
        self.count = 0
        self._burst, self._period_s = burst, period_s
        self._window_start = time.monotonic()
        self._in_window = 0  # refusals logged one by one in the current window
        self._unlogged = 0  # refusals not logged since the last summary line

    def add(self, reason: str) -> None:
        self.count += 1
        self.recent.append(reason)
        now = time.monotonic()
        if now - self._window_start >= self._period_s:
            self.flush()
            self._window_start, self._in_window = now, 0
        if self._in_window < self._burst:
            self._in_window += 1
            self.log.warning("%s refused a message: %s", self.who, reason)
        else:
            self._unlogged += 1

    def flush(self) -> None:
        """Log how many refusals were left out of the log since the last such line (if any)."""
        if self._unlogged:
            self.log.warning(
                "%d refusals by %s not logged one by one (more than %d in %.0f s); %d refused in all, last: %s",
                self._unlogged,
                self.who,
                self._burst,
                self._period_s,
                self.count,
                self.recent[-1],
            )
            self._unlogged = 0
