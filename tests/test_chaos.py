"""The chaos soak in CI: bounded, seeded, replayable (`python -m tests.chaos --seed N`)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.chaos import Soak

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(420), pytest.mark.soak]


async def test_a_chaos_soak_ends_converged(tmp_path: Path, soak: bool) -> None:
    """Faults for 30 s per commit (about a dozen), 150 s in `just soak`; LLMGW_CHAOS_SECONDS
    sets another length."""
    seed = int(os.environ.get("LLMGW_CHAOS_SEED", random.randrange(1 << 20)))
    seconds = float(os.environ.get("LLMGW_CHAOS_SECONDS", "150" if soak else "30"))
    soak = Soak(tmp_path, seed, seconds)
    problems = await soak.run()
    assert problems == [], f"seed {seed} (replay: python -m tests.chaos --seed {seed}): {problems}"
    assert any("kill -9" in f or "SIGSTOP" in f for f in soak.faults), "the soak injected process faults"
