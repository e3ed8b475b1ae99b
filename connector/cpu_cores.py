"""The cores this process may run on: its affinity, lowered by its cgroup's CPU quota (a
container limited to 2 CPUs on a 64-core host sees all 64 in its affinity). The connections
default (``config.default_connections``) and the movers' threads are sized by it."""

from __future__ import annotations

import os
from pathlib import Path


def usable_cores() -> int:
    """The cores this process may run on (its affinity), fewer when its cgroup's CPU quota
    allows less: a container limited to 2 CPUs on a 64-core host sees all 64 in its affinity."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; macOS and Windows lack it
    cores = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    quota = cpu_quota_cores()
    return cores if quota is None else max(1, min(cores, int(quota)))


# Where cgroups are read (Linux): the hierarchy's mount, and this process's place in it.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def cpu_quota_cores() -> float | None:
    """The CPU time this process's cgroup, or the tightest of its ancestors, may use, in cores
    (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None when there is
    no quota or it cannot be read."""
    try:  # a cgroup's name is bytes: one the locale cannot decode must not fail the config
        lines = PROC_CGROUP.read_text(errors="surrogateescape").splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        fields = line.split(":", 2)  # hierarchy-ID:controllers:path
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            base = CGROUP_ROOT  # v2: one hierarchy
        elif "cpu" in controllers.split(","):
            base = _v1_mount(controllers)
        else:
            continue
        # inside a container the cgroup's path may not exist under its own mount: the
        # ancestors, down to the mount's root (the container's cgroup), are read too
        here = Path(path.lstrip("/"))
        for cgroup in (here, *here.parents):
            quota = _quota_of(base / cgroup, v2=controllers == "")
            if quota is not None:
                quotas.append(quota)
    return min(quotas) if quotas else None


def _v1_mount(controllers: str) -> Path:
    """Where cgroup v1 mounts the hierarchy of ``controllers``: its own name, or -- when the
    kernel lists them in another order than the mount's name (``cpuacct,cpu`` on RHEL 7 for
    the ``cpu,cpuacct`` mount) -- the ``cpu`` link systemd and container runtimes make."""
    for name in (controllers, ",".join(sorted(controllers.split(","))), "cpu"):
        if (CGROUP_ROOT / name).is_dir():
            return CGROUP_ROOT / name
    return CGROUP_ROOT / controllers


def _quota_of(cgroup: Path, *, v2: bool) -> float | None:
    try:
        if v2:
            limit, period = (cgroup / "cpu.max").read_text().split()[:2]
            if limit == "max":
                return None
        else:
            limit = (cgroup / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu.cfs_period_us").read_text().strip()
        quota, every = int(limit), int(period)
    except (OSError, ValueError):
        return None
    return quota / every if quota > 0 and every > 0 else None
