"""A process's anonymous resident memory (RssAnon: a checkpoint's mmapped pages are page cache,
not the process's), and its peak sampled every 2 ms on a thread: what the benchmarks that
measure a load run in the fresh process they load in."""

from __future__ import annotations

import threading
import time


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("no RssAnon in /proc/self/status")


class PeakRss:
    """Samples from construction until `stop()`, which returns the peak."""

    def __init__(self) -> None:
        self.peak, self._done = rss_anon(), threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.002)

    def stop(self) -> int:
        self._done.set()
        return max(self.peak, rss_anon())
