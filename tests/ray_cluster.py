"""Ray clusters for the tests of `cullama serve --replicas` (tests/replicas/): each in a temp dir of its own (RAY_TMPDIR,
short: Ray's unix sockets live under it, and their paths must stay under 107 bytes), found and reaped by that dir,
never by a process's name (other Ray clusters may run on the machine, this suite's own or not).

    env = ray_env(root)   # the environment of a `cullama serve --replicas` whose cluster lives under root
    ray_pids(root)        # the processes of that cluster still alive (orphans too: Ray's agents outlive a SIGKILL)
    reap(root)            # kill them (SIGKILL), and remove the dir
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path


def ray_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="cr", dir="/tmp"))


def ray_env(root: Path, **more: str) -> dict:
    """The environment of a process that starts (or joins) the cluster under `root`: no usage reports, no token
    file written under HOME (the cluster is on this machine only, for seconds)."""
    return {**os.environ, "RAY_TMPDIR": str(root), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
            **more}


def _refers_to(pid: int, root: str) -> bool:
    try:
        if root in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(root):
                    return True
            except OSError:
                pass
    except OSError:
        pass
    return False


def ray_pids(root: Path) -> list[int]:
    """The live processes whose command line or open files name `root` (gcs, raylet, the agents, which keep the
    session's logs open), and all their descendants (workers, replicas)."""
    root_s = str(root)
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                if stat.rpartition(")")[2].split()[0] == "Z":  # a zombie is gone
                    continue
                parents[int(entry)] = int(stat.rpartition(")")[2].split()[1])
            except OSError:
                pass
    found = {pid for pid in parents if pid != os.getpid() and _refers_to(pid, root_s)}
    grew = True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return sorted(found)


def reap(root: Path, wait_s: float = 10.0) -> list[int]:
    """Kill what is left of the cluster under `root` (SIGKILL, by pid) and remove the dir; the pids killed."""
    left = ray_pids(root)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    while ray_pids(root) and time.monotonic() < deadline:
        time.sleep(0.1)
    shutil.rmtree(root, ignore_errors=True)
    return left
