"""The README's first command, as a user runs it: a cluster comes up, answers, and Ctrl-C leaves nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.launcher_support import pid_alive, processes_with
from tests.test_sim_engine import free_port
from tests.waiting import eventually

ROOT = Path(__file__).parent.parent

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def test_dev_up_brings_up_a_cluster_that_answers_and_stops_cleanly(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    out = tmp_path / "up.log"
    with out.open("wb") as log:
        proc = subprocess.Popen(
            [
                "./dev",
                "up",
                "--data-dir",
                str(data),
                "--port",
                str(free_port()),
                "--api-port",
                str(free_port()),
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:

        def ready_url() -> str:
            text = out.read_text(errors="replace")
            assert proc.poll() is None, text
            m = re.search(r"is ready at (http://\S+)", text)
            assert m, text[-2000:]
            return m.group(1)

        url = await eventually(ready_url, timeout=240, interval=0.5)
        assert "curl -s " + url + "/v1/chat/completions" in out.read_text()
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(
                f"{url}/v1/chat/completions",
                json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hello"}]},
            )
        assert r.status_code == 200
        assert r.json()["model"] == "tiny-chat"
        port = url.rsplit(":", 1)[1]
        engines = processes_with(f"--port {port} --model tiny-chat")
        assert len(engines) == 1
        agents = processes_with(str(data))
        assert len(agents) >= 4, "nats-server, placement, installer and launcher run from the data dir"

        # Ctrl-C, as a terminal sends it: to the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        # `llmgw up` may outlive the wrappers that started it by a moment while it stops everything.
        await eventually(lambda: "llmgw: stopped" in out.read_text(), timeout=60)
        await eventually(lambda: processes_with(str(data)) == [], timeout=30)
        assert [p for p in engines if pid_alive(p)] == []
        assert processes_with(str(data)) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
