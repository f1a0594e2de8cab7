"""What ov_runner.py and pagoda_runner.py report alike (standard library only: it is
imported from OpenVINO's venv too)."""

from __future__ import annotations

import resource
import statistics


def peak_rss_mb() -> float:
    """Peak resident memory of this process: VmHWM, which starts afresh at exec;
    ru_maxrss does not on Linux (it keeps the forking parent's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def summary(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"mean": statistics.fmean(v), "median": statistics.median(v),
            "p99": v[min(len(v) - 1, round(0.99 * (len(v) - 1)))], "min": v[0], "max": v[-1]}
