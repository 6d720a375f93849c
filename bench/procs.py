"""Stopping the processes a benchmark started."""

from __future__ import annotations

import subprocess


def terminate(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after `grace_s`; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
