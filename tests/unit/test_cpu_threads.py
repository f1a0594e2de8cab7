"""The engine's thread governor: every core while the machine is otherwise idle, one
less while other processes want a core (pagoda/engine/cpu_threads.py)."""

import os
import subprocess
import sys
import time

import pytest

from pagoda.engine.cpu_threads import governed_threads
from pagoda.engine import cpu_threads
from pagoda.engine.cpu_threads import CpuSample, ThreadGovernor

MS = 1_000_000  # ns


class FakeMachine:
    """A clock and cumulative counters the test moves by hand."""

    def __init__(self):
        self.now = 100.0
        self.own_cpu = self.own_delay = self.busy = 0
        self.calls: list[int] = []

    def sample(self):
        return CpuSample(self.own_cpu, self.own_delay, self.busy)

    def window(self, seconds=0.25, own_cores=2.0, delay_share=0.0, others_cores=0.0, threads=2):
        """``seconds`` pass in which the engine used ``own_cores``, its threads waited
        ``delay_share`` of each thread-second, and other processes used ``others_cores``."""
        self.now += seconds
        own = int(seconds * own_cores * 1000 * MS)
        self.own_cpu += own
        self.own_delay += int(seconds * threads * delay_share * 1000 * MS)
        self.busy += own + int(seconds * others_cores * 1000 * MS)


def governor(m: FakeMachine, low=1, high=2) -> ThreadGovernor:
    return ThreadGovernor(low, high, set_threads=m.calls.append, sample=m.sample, clock=lambda: m.now)


def test_starts_with_every_core_and_keeps_them_while_idle():
    m = FakeMachine()
    g = governor(m)
    assert g.threads == 2 and m.calls == [2]
    for _ in range(10):
        m.window(others_cores=0.05)
        g.step_done()
    assert g.threads == 2 and g.switches == 0


def test_gives_a_core_back_when_its_threads_wait_and_takes_it_back_when_the_machine_is_idle():
    m = FakeMachine()
    g = governor(m)
    m.window(delay_share=0.3, others_cores=0.1)   # descheduled threads: contention
    g.step_done()
    assert g.threads == 1 and m.calls == [2, 1]
    m.window(own_cores=1.0, others_cores=0.9, threads=1)   # the other process still runs
    g.step_done()
    assert g.threads == 1
    m.window(own_cores=1.0, others_cores=0.1, threads=1)   # it went quiet
    g.step_done()
    assert g.threads == 2 and m.calls == [2, 1, 2]


def test_other_processes_busy_counts_as_contention_even_without_run_delay():
    m = FakeMachine()
    g = governor(m)
    m.window(others_cores=0.6)
    g.step_done()
    assert g.threads == 1


def test_no_decision_within_a_window():
    m = FakeMachine()
    g = governor(m)
    m.window(seconds=cpu_threads.WINDOW_S / 4, delay_share=0.9, others_cores=1.0)
    g.step_done()
    assert g.threads == 2 and g.switches == 0


def test_flapping_doubles_the_hold_before_the_next_try():
    m = FakeMachine()
    g = governor(m)
    holds = []
    for _ in range(5):
        m.window(delay_share=0.5)                  # raised, and contended again at once
        g.step_done()
        assert g.threads == 1
        holds.append(g._held_until - m.now)
        while g.threads == 1:                      # wait out the hold on a quiet machine
            m.window(own_cores=1.0, threads=1)
            g.step_done()
    assert holds == sorted(holds) and holds[-1] >= 8 * holds[0]
    # Staying up for a while resets it.
    for _ in range(int(cpu_threads.STABLE_S / 0.25) + 2):
        m.window()
        g.step_done()
    m.window(delay_share=0.5)
    g.step_done()
    assert g._held_until - m.now == pytest.approx(cpu_threads.HOLD_S)


def test_many_core_range():
    m = FakeMachine()
    g = governor(m, low=7, high=8)
    m.window(delay_share=0.4, threads=8)
    g.step_done()
    assert m.calls == [8, 7]
    with pytest.raises(ValueError):
        governor(m, low=3, high=2)


def test_policy_range(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert governed_threads(2) is None                     # --num-threads: fixed
    if cores >= 2:
        assert governed_threads(None) == (max(1, cores - 1), cores)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert governed_threads(None) is None


def test_procfs_sample_counts_this_process_and_the_machine():
    a = cpu_threads.read_sample()
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    b = cpu_threads.read_sample()
    assert b.own_cpu_ns - a.own_cpu_ns >= 150 * MS
    assert b.busy_ns - a.busy_ns >= 100 * MS   # /proc/stat counts in ticks of 10 ms
    assert b.own_delay_ns >= a.own_delay_ns


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_real_counters_see_a_busy_process():
    """The real procfs counters, another process busy on every core: the governor gives
    a core back within a few windows."""
    cores = len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 20: pass"])
            for _ in range(cores)]
    try:
        calls: list[int] = []
        g = ThreadGovernor(cores - 1, cores, set_threads=calls.append)
        deadline = time.monotonic() + 10
        while g.threads == cores and time.monotonic() < deadline:
            t = time.process_time()
            while time.process_time() - t < 0.02:   # a step's work
                pass
            g.step_done()
        assert g.threads == cores - 1 and calls[-1] == cores - 1
    finally:
        for h in hogs:
            h.kill()
            h.wait()
