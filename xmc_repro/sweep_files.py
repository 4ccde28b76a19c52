"""The hidden files a sweep's own process shares with its jobs, under `multirun/`: `.outcomes-<id>.txt` (each job's
outcome, for the sweep's last line) and `.runs-<id>.txt` (the runs its jobs opened, closed by the sweep if its
launcher kills them). The sweep removes both as it ends; one killed with SIGKILL cannot, so every start removes
those whose process is gone, after closing the runs they list that its jobs left RUNNING.

`<id>` is `<host>-<pid>-<8 hex digits>`: a pid alone is reused, and a folder shared between machines (a cluster's
home) holds sweeps of other hosts, whose pids mean nothing here. Imports nothing heavy: it runs before every run.
"""

from __future__ import annotations

import os
import platform
import re
import uuid
from pathlib import Path

# Files of earlier versions have no host in their id: taken as this host's.
_NAME = re.compile(r"\.(?:outcomes|runs)-(?:(?P<host>.+)-)?(?P<pid>\d+)-[0-9a-f]{8}\.txt")


def _host() -> str:
    return re.sub(r"[^\w.]", "_", platform.node()) or "host"  # no `-`: it separates the id's parts


def paths(folder: Path) -> tuple[Path, Path]:
    """(outcomes, runs) of a new sweep run from this process."""
    sweep = f"{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return folder / f".outcomes-{sweep}.txt", folder / f".runs-{sweep}.txt"


def stale(folder: Path) -> list[Path]:
    """The files of this host's sweeps whose process is gone. An unreadable folder gives none: what writes there
    reports it."""
    try:
        found = list(folder.iterdir()) if folder.is_dir() else []
    except OSError:
        return []
    gone = []
    for path in found:
        match = _NAME.fullmatch(path.name)
        if not match or match["host"] not in (None, _host()):
            continue
        try:
            if not alive(int(match["pid"]), path.stat().st_mtime):
                gone.append(path)
        except OSError:  # removed meanwhile by another sweep
            continue
    return gone


def remove(paths: list[Path]) -> None:
    """Remove `paths`; one already removed (by another start) or not ours to remove is left unsaid."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            continue


def alive(pid: int, since_s: float | None) -> bool:
    """Whether process `pid` may be the one that was running at `since_s` (epoch seconds; None: at any time). A pid
    is reused: a process created after that (after a reboot or a container's restart) is not the same one.
    psutil, not os.kill(pid, 0): on Windows that terminates the process."""
    import psutil

    try:
        created = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:  # another user's process: it may be the one
        return True
    # 2 s of slack: psutil derives a start time from the boot time, which a clock adjustment can shift
    return since_s is None or created <= since_s + 2


def listed_runs(path: Path) -> list[list[str]]:
    """[run id, tracking uri, run folder] of each run the sweep's jobs opened (its `.runs-<id>.txt`), read without
    importing MLflow."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    return [line.split("\t") for line in lines if line.count("\t") == 2]
