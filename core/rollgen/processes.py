"""This machine's processes, as rollgen's watchers see them (Linux ``/proc``): which run, which
descend from a process, and the line of parents that ties a process to the one it serves."""

from __future__ import annotations

import os
from pathlib import Path


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie waiting to be reaped)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def descendants(pid: int) -> dict[int, str]:
    """The processes below ``pid`` and their command lines (empty where ``/proc`` is not)."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for tasks in Path(f"/proc/{parent}/task").glob("*/children"):
            for child in map(int, tasks.read_text().split()):
                if child not in found:
                    found[child] = _cmdline(child)
                    todo.append(child)
    return found


def lifeline(owner: int) -> tuple[int, ...]:
    """The processes from this one's parent up to ``owner``: those whose end ends what this
    process does for ``owner`` (empty: this process is ``owner``, or does not descend from it)."""
    line: list[int] = []
    pid = os.getpid()
    while pid != owner:
        stat = _stat(pid)
        if stat is None or int(stat[1]) <= 1:
            return ()
        pid = int(stat[1])
        line.append(pid)
    return tuple(line)


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command (state, parent, ...); None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
