"""The watchdog of a pipeline rank: a rank that stalls inside a schedule ends its process instead of hanging."""

from __future__ import annotations

import time


class Watchdog:
    """Ends this process when it makes no progress for ``limit_s`` while it is inside a schedule.

    Waits on other ranks are bounded by ``deepspeed.timeout_s`` (they raise), so a rank that passes no schedule
    step for ``2 x timeout_s`` is stalled itself (a stuck kernel, a deadlock): it prints one line and exits, so the run
    ends on every rank instead of leaving one process hanging. Idle time outside schedules is not watched.

    Args:
        limit_s: seconds without progress before the process exits.
        name: this rank's description, for the message.
    """

    def __init__(self, limit_s: float, name: str) -> None:
        import threading

        self.limit_s, self.name = float(limit_s), name
        self._last: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spd-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Progress was made now: the stall deadline restarts."""
        self._last = time.monotonic()

    def idle(self) -> None:
        """Waiting for work on purpose (between generations): no deadline until the next :meth:`beat`."""
        self._last = None

    def stop(self) -> None:
        """End the watchdog thread."""
        self._stop.set()

    def _run(self) -> None:
        import os
        import sys

        while not self._stop.wait(min(1.0, self.limit_s / 4)):
            last = self._last
            if last is not None and time.monotonic() - last > self.limit_s:
                sys.stderr.write(f"spd-ds watchdog: {self.name} made no progress for {self.limit_s:g}s "
                                 f"(2 x deepspeed.timeout_s); this rank is stalled, exiting\n")
                sys.stderr.flush()
                os._exit(70)
