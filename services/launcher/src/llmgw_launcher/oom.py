"""Whether the kernel's OOM killer ended an engine that died by SIGKILL, and the evidence.

A SIGKILL says nothing of who sent it: an operator, a supervisor's timeout, or the kernel
out of memory. The kernel counts the OOM kills of each memory cgroup, so the count of the
engine's cgroup is read when the engine starts (`find`: its cgroup from `/proc/<pid>/cgroup`,
and again when it is ready, since a wrapper may move it), and read again at its exit
(`explain`): a count that rose is the kernel's word. Both cgroup versions are read:

    v2  <mount>/<path>/memory.events       `oom_kill N`
    v1  <memory mount>/<path>/memory.oom_control   `oom_kill N` (kernels since 4.13)

Where the kernel log is readable (`/dev/kmsg`), a line that names the pid since it started
(`Killed process 4242 (llama-server)`, `oom-kill:…,pid=4242,…`) is evidence too. Where
neither can be read, nothing is said beyond the signal. The count is the cgroup's: when the
engine shares its cgroup with other processes, an OOM kill of one of them during the
engine's life is counted as well; the kernel log, where it is readable, names the process.

Reading is blocking (a few small files): run it in a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
KMSG = Path("/dev/kmsg")
# The kernel log is read to at most this many records (its ring buffer is a few MB at most).
KMSG_RECORDS = 100_000


@dataclass(frozen=True)
class MemCgroup:
    """An engine's memory cgroup: the file that counts its OOM kills, and the count at a time."""

    file: Path
    count: int

    @property
    def kind(self) -> str:
        return self.file.name  # memory.events (v2) or memory.oom_control (v1)


def oom_kills(text: str) -> int | None:
    """The `oom_kill N` of a memory.events or memory.oom_control file, else None."""
    found = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(found.group(1)) if found else None


def mounts(mountinfo: str) -> tuple[Path | None, Path | None, str, str]:
    """The cgroup v2 mount and the v1 memory mount of a `/proc/self/mountinfo`, with the
    hierarchy root each mounts (inside a cgroup namespace, "/")."""
    v2: Path | None = None
    v1: Path | None = None
    v2_root = v1_root = "/"
    for line in mountinfo.splitlines():
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        root, point, fstype, options = fields[3], fields[4], rest[0], rest[2]
        if fstype == "cgroup2" and v2 is None:
            v2, v2_root = Path(point), root
        elif fstype == "cgroup" and "memory" in options.split(",") and v1 is None:
            v1, v1_root = Path(point), root
    return v2, v1, v2_root, v1_root


def _under(mount: Path, mount_root: str, path: str) -> Path:
    if mount_root != "/" and path.startswith(mount_root):
        path = path[len(mount_root) :]
    return mount / path.lstrip("/")


def counter_file(cgroup: str, mountinfo: str) -> Path | None:
    """The file that counts OOM kills for the process whose `/proc/<pid>/cgroup` is `cgroup`."""
    v2, v1, v2_root, v1_root = mounts(mountinfo)
    for line in cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "" and v2 is not None:
            candidate = _under(v2, v2_root, path) / "memory.events"
            if candidate.exists():
                return candidate
    for line in cgroup.splitlines():
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(",") and v1 is not None:
            candidate = _under(v1, v1_root, path) / "memory.oom_control"
            if candidate.exists():
                return candidate
    return None


def find(pid: int, proc: Path = PROC) -> MemCgroup | None:
    """The memory cgroup of a running process and its OOM kills so far; None where unreadable."""
    try:
        cgroup = (proc / str(pid) / "cgroup").read_text()
        mountinfo = (proc / "self" / "mountinfo").read_text()
    except OSError:
        return None
    file = counter_file(cgroup, mountinfo)
    if file is None:
        return None
    count = _count(file)
    return MemCgroup(file, count) if count is not None else None


def _count(file: Path) -> int | None:
    try:
        return oom_kills(file.read_text())
    except OSError:
        return None


def kernel_lines(pid: int, since_s: float, kmsg: Path = KMSG) -> list[str] | None:
    """The kernel log's OOM lines that name `pid`, logged `since_s` (seconds since boot) or
    later; None where the log cannot be read."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found: list[str] = []
    mine = re.compile(rf"(Killed process {pid} \(|[,:]pid={pid},)")
    try:
        for _ in range(KMSG_RECORDS):
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break  # the end of the log
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # records overwritten while reading: go on from the oldest kept
                return found or None
            if not record:
                break
            line = _kmsg_line(record.decode(errors="replace"))
            if line is not None and line[0] >= since_s and mine.search(line[1]):
                found.append(line[1])
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return found


def _kmsg_line(record: str) -> tuple[float, str] | None:
    """`6,1234,25634597919,-;Memory cgroup out of memory: Killed process …` as (seconds, text)."""
    head, sep, text = record.partition(";")
    parts = head.split(",")
    if not sep or len(parts) < 3 or not parts[2].isdigit():
        return None
    return int(parts[2]) / 1e6, text.split("\n", 1)[0]


def start_seconds(start_ticks: int) -> float:
    """A process's start (field 22 of /proc/<pid>/stat, clock ticks since boot) in seconds."""
    return start_ticks / os.sysconf("SC_CLK_TCK")


def explain(cgroup: MemCgroup | None, pid: int, start_ticks: int, kmsg: Path = KMSG) -> str:
    """`killed by the kernel's OOM killer (memory.events oom_kill 3 → 4, /sys/fs/cgroup/…)` for
    a process that died by SIGKILL, if the kernel says it did; else ""."""
    evidence: list[str] = []
    if cgroup is not None:
        now = _count(cgroup.file)
        if now is not None and now > cgroup.count:
            evidence.append(f"{cgroup.kind} oom_kill {cgroup.count} → {now}, {cgroup.file.parent}")
    # A second early, for the ticks' rounding and a log clock that runs a little apart.
    lines = kernel_lines(pid, start_seconds(start_ticks) - 1.0, kmsg) if start_ticks else None
    if lines:
        killed = [line for line in lines if "Killed process" in line] or lines
        # `… Killed process 4242 (python) total-vm:…kB, anon-rss:…kB`: the rest is page counts.
        evidence.append(f"kernel log: {killed[-1].split(', file-rss', 1)[0][:200]}")
    if not evidence:
        return ""
    return f"killed by the kernel's OOM killer ({'; '.join(evidence)})"
