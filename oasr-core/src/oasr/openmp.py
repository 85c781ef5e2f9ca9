"""How torch's OpenMP threads wait, chosen for the machine before torch is imported.

``oasr``'s command line calls :func:`choose_openmp_wait_policy` first thing; a server or a
script can do the same before its first ``import torch``. ``OMP_WAIT_POLICY`` set by the user
(ACTIVE or PASSIVE) always wins. Imports nothing heavy (``oasr --help`` stays fast).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["choose_openmp_wait_policy", "other_cpu_load"]


def other_cpu_load() -> float:
    """Cores' worth of work other than the caller: the larger of the 1-minute load average and
    the tasks runnable right now besides this one (/proc/loadavg; 0 where unknown)."""
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        return max(float(fields[0]), float(fields[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except (OSError, AttributeError):
            return 0.0


def choose_openmp_wait_policy(
    environ: MutableMapping[str, str] | None = None, load: float | None = None
) -> str | None:
    """Pick how torch's OpenMP threads wait between parallel regions, before torch is imported
    (libgomp reads ``OMP_WAIT_POLICY`` once, when it loads); a policy the user set is kept.

    On a machine where other work holds at least one core's worth of CPU (:func:`other_cpu_load`)
    the policy is PASSIVE: a waiting thread sleeps at once. libgomp's default spins first, and
    a spinning thread takes the core that its partner, descheduled by the other work, needs to
    finish (a CPU hog on one of two cores: tiny.en long-form 14.5 s -> 11.5 s wall). On a quiet
    machine the default stays. Returns the policy set, or None when nothing was set."""
    env = os.environ if environ is None else environ
    if env.get("OMP_WAIT_POLICY"):
        return None
    load = other_cpu_load() if load is None else load
    if load < 1.0:
        return None
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return "PASSIVE"
