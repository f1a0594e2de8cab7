"""How many cores the engine's steps use, decided again every fraction of a second.

torch's threads (and pagoda's kernels, which run on the same pool) meet at a barrier
after every parallel op. When another process takes one of the cores the engine
runs on, every op waits for the descheduled thread: on a 2-core machine a batch-1
decode step went from 53 ms with one thread to 724 ms with two (docs/benchmarks.md).
So a fixed thread count must choose between leaving a core unused when the machine
is otherwise idle (offline runs, a server between bursts) and stalling whenever the
API process, a client or anything else runs.

``ThreadGovernor`` chooses per window instead, from what the kernel already counts:

- with more than ``low`` threads, it gives one back as soon as the engine's threads
  spent more than ``DELAY_SHARE`` of the window waiting for a core (the run delay in
  ``/proc/self/task/*/schedstat``) or other processes used more than ``OTHERS_BUSY``
  of a core (``/proc/stat`` less the engine's own CPU time);
- with ``low`` threads, it takes a core back once the other processes left the cores
  the engine does not use idle for a whole window (others below ``OTHERS_BUSY``).

A drop followed soon by another doubles the wait before the next try (up to
``MAX_HOLD_S``), so a steadily busy machine is probed rarely. The governor only
reads two procfs files once per window (about 0.1 ms); steps are never delayed.
Linux only: elsewhere ``available()`` is False and the thread count stays fixed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

WINDOW_S = 0.2        # one decision per window of steps
DELAY_SHARE = 0.25    # run delay of the engine's threads per thread-second that counts as contention
OTHERS_BUSY = 0.5     # cores' worth of other processes' CPU time that counts as busy
HOLD_S = 0.5          # after a drop, stay at `low` at least this long ...
MAX_HOLD_S = 30.0     # ... doubled after each drop that follows a raise within STABLE_S, up to this
STABLE_S = 5.0        # a raise that lasts this long resets the hold

_TICK_NS = 1e9 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative counters at one instant (nanoseconds)."""
    own_cpu_ns: int      # CPU time of this process's threads
    own_delay_ns: int    # time this process's threads were runnable but waiting for a core
    busy_ns: int         # CPU time of the whole machine, every process, every core


def read_sample() -> CpuSample:
    """The counters from procfs (raises OSError where they cannot be read)."""
    own_cpu = own_delay = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, delay, _ = f.read().split()
        except (FileNotFoundError, ValueError):  # a thread that ended meanwhile
            continue
        own_cpu += int(run)
        own_delay += int(delay)
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: inside user/nice]
    busy_ticks = sum(fields[:8]) - fields[3] - fields[4] - fields[7]
    return CpuSample(own_cpu, own_delay, int(busy_ticks * _TICK_NS))


def available() -> bool:
    try:
        read_sample()
        return True
    except OSError:
        return False


def governed_threads(requested: int | None) -> tuple[int, int] | None:
    """(low, high): the range the engine's ``ThreadGovernor`` moves its torch threads in
    (below), or None for a fixed count (``cpu_threads_policy``):
    when ``--num-threads`` or ``OMP_NUM_THREADS`` says how many, on one core and off
    Linux. Else every core while the machine is otherwise idle, and one less (at least
    one) while other processes want a core."""
    if requested is not None or os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    if cores < 2 or not available():
        return None
    return max(1, cores - 1), cores


class ThreadGovernor:
    """Sets the engine's thread count between ``low`` and ``high`` after each step
    (``step_done``), from the machine's contention over the last window."""

    def __init__(self, low: int, high: int, set_threads: Callable[[int], None],
                 sample: Callable[[], CpuSample] = read_sample, clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= low <= high:
            raise ValueError(f"need 1 <= low <= high, got {low}, {high}")
        self.low, self.high = low, high
        self._set = set_threads
        self._sample = sample
        self._clock = clock
        self.threads = high
        self.switches = 0
        self._hold = HOLD_S
        self._held_until = 0.0
        self._raised_at: float | None = None
        self._set(self.threads)
        self._t0 = clock()
        self._s0 = sample()

    def step_done(self) -> None:
        now = self._clock()
        elapsed = now - self._t0
        if elapsed < WINDOW_S:
            return
        s = self._sample()
        wall_ns = elapsed * 1e9
        others = max(0.0, (s.busy_ns - self._s0.busy_ns) - (s.own_cpu_ns - self._s0.own_cpu_ns)) / wall_ns
        delay = (s.own_delay_ns - self._s0.own_delay_ns) / (wall_ns * self.threads)
        self._t0, self._s0 = now, s
        if self.threads > self.low and (delay > DELAY_SHARE or others > OTHERS_BUSY):
            if self._raised_at is not None and now - self._raised_at < STABLE_S:
                self._hold = min(self._hold * 2, MAX_HOLD_S)
            self._held_until = now + self._hold
            self._switch(self.low, f"run delay {delay:.0%}, other processes {others:.2f} cores")
        elif self.threads < self.high and now >= self._held_until and others <= OTHERS_BUSY:
            self._raised_at = now
            self._switch(self.high, f"other processes {others:.2f} cores")
        elif self._raised_at is not None and now - self._raised_at >= STABLE_S:
            self._hold = HOLD_S
            self._raised_at = None

    def _switch(self, threads: int, why: str) -> None:
        logger.debug("engine threads %d -> %d (%s)", self.threads, threads, why)
        self.threads = threads
        self.switches += 1
        self._set(threads)
