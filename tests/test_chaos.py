"""The chaos soak in CI: bounded, seeded, replayable (`python -m tests.chaos --seed N`)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.chaos import Soak

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(420)]


async def test_a_chaos_soak_ends_converged(tmp_path: Path) -> None:
    seed = int(os.environ.get("LLMGW_CHAOS_SEED", random.randrange(1 << 20)))
    seconds = float(os.environ.get("LLMGW_CHAOS_SECONDS", "150"))
    soak = Soak(tmp_path, seed, seconds)
    problems = await soak.run()
    assert problems == [], f"seed {seed} (replay: python -m tests.chaos --seed {seed}): {problems}"
    assert any("kill -9" in f or "SIGSTOP" in f for f in soak.faults), "the soak injected process faults"
