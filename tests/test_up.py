"""The README's first command, as a user runs it: a cluster comes up, answers, and Ctrl-C leaves nothing."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from llmgw.auth import AuthDir
from llmgw_launcher import procs
from llmgw_launcher.records import Records
from tests.cluster_support import up_engine_ports
from tests.launcher_support import pid_alive, processes_with
from tests.test_sim_engine import free_port
from tests.waiting import eventually

ROOT = Path(__file__).parent.parent

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def operator_sees_the_cluster(text: str, data: Path) -> None:
    """Authentication is on: the printed ctl line and API token work, and nothing works without them."""
    auth = AuthDir(data / "auth")
    assert sorted(auth.identities()) == ["ctl", "fleet", "gateway", "node-local-1", "observer", "placement"]
    assert 'include "../auth/auth.conf"' in (data / "nats" / "nats-server.conf").read_text()
    assert "nkey_seed_file" in (data / "server.yaml").read_text()
    assert "nkey_seed_file" in (data / "agent.yaml").read_text()
    assert str(auth.seed("gateway")) in (data / "gateway.yaml").read_text()

    # The line as printed, pasted into the shell `./dev up` ran from: llmgw is not on its PATH.
    ctl_line = re.search(
        r"as the operator: (LLMGW_NATS_URL=(\S+) LLMGW_NATS_NKEY=(\S+) (\S+) ctl nodes)$", text, re.M
    )
    assert ctl_line, text
    assert ctl_line.group(3) == str(auth.seed("ctl"))
    assert ctl_line.group(4) == ".venv/bin/llmgw"
    shell = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "VIRTUAL_ENV"))}
    shell["PATH"] = "/usr/bin:/bin"
    listed = subprocess.run(
        ["bash", "-c", ctl_line.group(1)], cwd=ROOT, capture_output=True, text=True, env=shell, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].startswith("local-1  alive  2x NVIDIA H100 80GB HBM3")
    env = {**os.environ, "LLMGW_NATS_URL": ctl_line.group(2), "LLMGW_NATS_NKEY": ctl_line.group(3)}
    env.pop("LLMGW_NATS_INSECURE", None)
    ctl = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "ctl"]
    env.pop("LLMGW_NATS_NKEY")
    refused = subprocess.run([*ctl, "nodes"], capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 2
    assert refused.stderr.startswith("llmgw: llmgw-ctl: no NATS identity for nats://127.0.0.1:")

    api = re.search(r"API (http://\S+)\)", text)
    token = re.search(r"its API token: (\S+) \(read only: (\S+)\)", text)
    assert api, text
    assert token, text
    assert token.group(1) == auth.token()
    async with httpx.AsyncClient(base_url=api.group(1), timeout=10) as client:
        assert (await client.get("/api/replicas")).status_code == 401
        for t in token.groups():
            r = await client.get("/api/replicas", headers={"Authorization": f"Bearer {t}"})
            assert r.status_code == 200
            assert r.json()["chat.r0"]["state"] == "ready"


def free_block(n: int) -> int:
    """The first of `n` consecutive ports that are all free now, below the kernel's
    ephemeral range: `llmgw up` takes the ports after --api-port for each node's metrics,
    and a port picked by the kernel for us has neighbours it hands to outgoing connections."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, 20000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {n} consecutive free ports in 10000-19999")


@contextlib.contextmanager
def dev_up(tmp_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """`./dev up` in its own process group; killed at the end if a test left it running."""
    data = tmp_path / "cluster"
    out = tmp_path / "up.log"
    argv = [
        "./dev",
        "up",
        "--data-dir",
        str(data),
        "--port",
        str(free_port()),
        "--api-port",
        str(free_block(8)),  # and the metrics ports of up to 3 nodes after it
        "--gateway-port",
        str(free_port()),
        *up_engine_ports(),
    ]
    with out.open("wb") as log:
        proc = subprocess.Popen(
            [*argv, *flags],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        yield proc, data, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def ready(proc: subprocess.Popen[bytes], out: Path) -> tuple[str, str]:
    """The endpoint `llmgw up` prints (the gateway's base URL) and the engine's own URL."""

    def ready_urls() -> tuple[str, str]:
        text = out.read_text(errors="replace")
        assert proc.poll() is None, text
        endpoint = re.search(r"the endpoint, OpenAI base_url: (http://\S+)/v1 ", text)
        engine = re.search(r"is ready \(replica r0, engine at (http://\S+)\)", text)
        assert endpoint, text[-2000:]
        assert engine, text[-2000:]
        return endpoint.group(1), engine.group(1)

    return await eventually(ready_urls, timeout=240, interval=0.5)


def printed_key(text: str) -> dict[str, str]:
    """The `Authorization` header of the curl `llmgw up` prints: its key `default`'s secret."""
    found = re.search(r"curl -s \S+ -H 'Authorization: Bearer (sk-llmgw-\S+)'", text)
    assert found, text[-2000:]
    return {"Authorization": f"Bearer {found.group(1)}"}


def up_here(*args: str) -> subprocess.CompletedProcess[str]:
    """`llmgw up` as a command, for what it refuses (it exits before starting anything)."""
    argv = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "up", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)


async def ctrl_c(proc: subprocess.Popen[bytes], out: Path, data: Path) -> None:
    # Ctrl-C, as a terminal sends it: to the whole foreground process group.
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=60)
    # `llmgw up` may outlive the wrappers that started it by a moment while it stops everything.
    await eventually(lambda: "llmgw: stopped" in out.read_text(), timeout=60)
    await eventually(lambda: processes_with(str(data)) == [], timeout=30)


async def test_dev_up_brings_up_a_cluster_that_answers_and_stops_cleanly(tmp_path: Path) -> None:
    with dev_up(tmp_path) as (proc, data, out):
        url, engine = await ready(proc, out)
        text = out.read_text()
        assert "curl -s " + url + "/v1/chat/completions" in text
        assert "INSECURE" not in text
        # Keys are required: the curl carries key `default`'s secret, kept (0600) in the data dir.
        key = printed_key(text)
        assert f"Bearer {(data / 'api-key').read_text().strip()}" == key["Authorization"]
        assert (data / "api-key").stat().st_mode & 0o777 == 0o600
        # What it waited for, in order, as it happened.
        said = [line for line in text.splitlines() if line.startswith("llmgw: ")]
        progress = [
            "llmgw: NATS JetStream is up at nats://127.0.0.1:",
            "llmgw: placement created the streams and buckets",
            "llmgw: placement is leading (",
            "llmgw: node local-1 probed: 2x NVIDIA H100 80GB HBM3 (simulated); engines: sim",
            "llmgw: chat r0 on local-1: engine ",
            "llmgw: deployment chat replica r0: ready",
            "llmgw: deployment chat is ready (replica r0, engine at ",
        ]
        at = [next(i for i, line in enumerate(said) if line.startswith(p)) for p in progress]
        assert at == sorted(at), said
        assert re.search(r"^llmgw: chat r0 on local-1: engine (starting|loading)", text, re.MULTILINE), text
        async with httpx.AsyncClient(timeout=10) as client:
            for model in ("chat", "tiny-chat"):
                r = await client.post(
                    f"{url}/v1/chat/completions",
                    json={"model": model, "messages": [{"role": "user", "content": "hello"}]},
                    headers=key,
                )
                assert r.status_code == 200, r.text
                assert r.json()["model"] == "tiny-chat"
            r = await client.post(f"{url}/v1/chat/completions", json={"model": "chat", "messages": []})
            assert r.status_code == 401
            # The cluster page's chat box: placement names the gateway, whose answers the
            # page's scripts may read (a browser's preflight from the page's origin is allowed).
            http = msgspec.yaml.decode((data / "server.yaml").read_bytes())["http"]
            assert http["gateway_url"] == url
            page = f"http://127.0.0.1:{http['port']}"
            asked = {
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization",
            }
            r = await client.options(f"{url}/v1/chat/completions", headers={"Origin": page, **asked})
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] == page
            r = await client.options(f"{url}/v1/chat/completions", headers={"Origin": "http://evil", **asked})
            assert "access-control-allow-origin" not in r.headers
        await operator_sees_the_cluster(text, data)
        port = engine.rsplit(":", 1)[1]
        engines = processes_with(f"--port {port} --model tiny-chat", under=data)
        assert len(engines) == 1
        agents = processes_with(str(data))
        assert len(agents) >= 5, (
            "nats-server, placement, installer, launcher and gateway run from the data dir"
        )

        await ctrl_c(proc, out, data)
        assert [p for p in engines if pid_alive(p)] == []
        assert processes_with(str(data)) == []


async def test_up_with_two_nodes_and_a_second_up_on_the_same_data_dir_refused(tmp_path: Path) -> None:
    with dev_up(tmp_path, "--insecure", "--nodes", "2", "--engine-ports", "29000-29199") as (proc, data, out):
        url, engine = await ready(proc, out)
        text = out.read_text()
        assert "llmgw: node local-1 probed: 2x NVIDIA H100 80GB HBM3 (simulated)" in text
        assert "llmgw: node local-2 probed: 2x NVIDIA H100 80GB HBM3 (simulated)" in text
        assert "for nodes local-1, local-2 (engine ports 29000-29199)" in text
        # Each node has its own agents and its own half of the engine ports.
        assert msgspec.yaml.decode((data / "agent-local-2.yaml").read_bytes())["port_range"] == [29100, 29199]
        assert 29000 <= int(engine.rsplit(":", 1)[1]) <= 29199
        assert len(processes_with(str(data / "agent-local-2.yaml"))) == 2, "its installer and launcher"
        secret = printed_key(text)["Authorization"].removeprefix("Bearer ")
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0) as client:
            done = await client.chat.completions.create(
                model="chat",
                messages=[{"role": "user", "content": "hello"}],  # type: ignore[arg-type]
            )
            assert done.choices[0].message.content

        # A second `up` on the same directory refuses at once, in one line, naming the first.
        conf = data / "nats" / "nats-server.conf"
        before = conf.stat().st_mtime_ns
        second = up_here("--data-dir", str(data), "--port", str(free_port()), "--api-port", str(free_port()))
        assert second.returncode == 1
        m = re.fullmatch(
            rf"llmgw: {re.escape(str(data))} is in use by another `llmgw up` \(pid (\d+)\); "
            r"stop it \(Ctrl-C\) or pass another --data-dir\n",
            second.stderr,
        )
        assert m, second.stderr
        assert pid_alive(int(m.group(1)))
        assert conf.stat().st_mtime_ns == before
        await ctrl_c(proc, out, data)


def test_up_refuses_a_port_in_use_an_unusable_data_dir_and_bad_engine_ports(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        refused = up_here("--data-dir", str(tmp_path / "a"), "--port", str(port))
    assert refused.returncode == 1
    assert refused.stderr == (
        f"llmgw: port {port} (NATS, --port) is in use on 127.0.0.1: Address already in use; "
        "stop what holds it or choose another port\n"
    )
    assert not (tmp_path / "a" / "nats").exists()

    (tmp_path / "file").write_text("")
    refused = up_here("--data-dir", str(tmp_path / "file" / "cluster"))
    assert refused.returncode == 1
    assert refused.stderr == (
        f"llmgw: cannot use {tmp_path / 'file' / 'cluster'} as the data dir: Not a directory; "
        "pass --data-dir a directory you can write\n"
    )

    refused = up_here("--data-dir", str(tmp_path / "b"), "--engine-ports", "29000")
    assert refused.returncode == 1
    assert refused.stderr == (
        "llmgw: --engine-ports '29000' is not a port range: give LOW-HIGH with "
        "1024 <= LOW <= HIGH <= 65535, e.g. 28000-28999\n"
    )
    assert not (tmp_path / "b").exists()


async def test_dev_up_without_authentication_must_be_asked_for_and_says_so(tmp_path: Path) -> None:
    with dev_up(tmp_path, "--insecure") as (proc, data, out):
        await ready(proc, out)
        text = out.read_text()
        assert "llmgw: INSECURE: NATS and the API run without authentication (--insecure)" in text
        assert not (data / "auth").exists()
        assert "include" not in (data / "nats" / "nats-server.conf").read_text()
        # Each service says so in its own log too.
        placement_log = (data / "logs" / "placement.log").read_text()
        assert "connecting to NATS at nats://127.0.0.1:" in placement_log
        assert "without credentials (insecure)" in placement_log
        assert "has no token (http: insecure: true)" in placement_log
        api = re.search(r"curl -s (http://\S+)/api/replicas", text)
        assert api, text
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(f"{api.group(1)}/api/replicas")).status_code == 200
        # The printed command, pasted into the shell `./dev up` ran from (no llmgw on its PATH).
        line = re.search(
            r"^llmgw: the cluster: (LLMGW_NATS_URL=\S+ LLMGW_NATS_INSECURE=1 .+ ctl nodes)$", text, re.M
        )
        assert line, text
        shell = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "VIRTUAL_ENV"))}
        shell["PATH"] = "/usr/bin:/bin"
        listed = subprocess.run(
            ["bash", "-c", line.group(1)], cwd=ROOT, capture_output=True, text=True, env=shell, timeout=60
        )
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.splitlines()[1].startswith("local-1  alive  2x NVIDIA H100 80GB HBM3")
        await ctrl_c(proc, out, data)


# --- supervision: what `up` does when one of its children dies -----------------------


def started_pids(text: str) -> dict[str, int]:
    """The pids `llmgw up` says it started, by child: `llmgw: pids: nats-server 12, placement 13, …`."""
    m = re.search(r"^llmgw: pids: (.+); each is restarted if it exits$", text, re.MULTILINE)
    assert m, text[-3000:]
    return {name: int(pid) for name, pid in (item.rsplit(" ", 1) for item in m.group(1).split(", "))}


def recorded_engine(data: Path) -> tuple[int, int, int]:
    """The engine's pid, start time and port, from the shard record its launcher wrote."""
    records, problems = Records(data / "agent").load_all()
    assert problems == []
    assert len(records) == 1, records
    (record,) = records.values()
    (proc,) = record.procs
    return proc.pid, proc.start_time, record.port


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def chat(url: str, headers: dict[str, str]) -> bool:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(
            f"{url}/v1/chat/completions",
            json={"model": "chat", "messages": [{"role": "user", "content": "hello"}]},
            headers=headers,
        )
    assert r.status_code == 200, r.text
    return True


async def test_up_says_its_nats_server_died_and_restarts_it_on_the_same_port_and_store(
    tmp_path: Path,
) -> None:
    with dev_up(tmp_path) as (proc, data, out):
        url, _ = await ready(proc, out)
        text = out.read_text()
        nats = started_pids(text)["nats-server"]
        port = re.search(r"NATS JetStream is up at nats://127\.0\.0\.1:(\d+) ", text)
        assert port, text
        os.kill(nats, signal.SIGKILL)

        # Said at once: which child, how it ended, its last log lines; then restarted.
        def restarted() -> int:
            said = out.read_text()
            assert f"llmgw: nats-server (pid {nats}) was killed by signal SIGKILL after " in said, said[
                -3000:
            ]
            assert f"s; the last lines of {data / 'logs' / 'nats.log'}:\n    [{nats}] " in said
            assert re.search(
                rf"^llmgw: restarting nats-server in [\d.]+s \(same port {port.group(1)}, "
                rf"same store {re.escape(str(data / 'nats'))}\)$",
                said,
                re.MULTILINE,
            ), said[-3000:]
            m = re.search(r"^llmgw: nats-server restarted \(pid (\d+)\)$", said, re.MULTILINE)
            assert m, said[-3000:]
            return int(m.group(1))

        new = await eventually(restarted, timeout=20, interval=0.2)
        assert new != nats
        assert pid_alive(new)
        # The cluster resumes: the deployment answers through the gateway again, and placement
        # acts on a change made after the restart (its watch and lease came back).
        await eventually(lambda: chat(url, printed_key(text)), timeout=120, interval=1)
        ctl_line = re.search(r"LLMGW_NATS_URL=(\S+) LLMGW_NATS_NKEY=(\S+) \S+ ctl nodes", text)
        token = re.search(r"its API token: (\S+) ", text)
        api = re.search(r"API (http://\S+)\)", text)
        assert ctl_line, text
        assert token, text
        assert api, text
        env = {**os.environ, "LLMGW_NATS_URL": ctl_line.group(1), "LLMGW_NATS_NKEY": ctl_line.group(2)}
        env.pop("LLMGW_NATS_INSECURE", None)
        ctl = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "ctl"]

        def scaled() -> bool:
            done = subprocess.run(
                [*ctl, "scale", "chat", "--replicas", "2"],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            return True

        await eventually(scaled, timeout=60, interval=1)

        async def two_ready() -> bool:
            async with httpx.AsyncClient(base_url=api.group(1), timeout=10) as client:
                r = await client.get("/api/replicas", headers={"Authorization": f"Bearer {token.group(1)}"})
            assert r.status_code == 200, r.text
            states = {k: v["state"] for k, v in r.json().items()}
            assert states == {"chat.r0": "ready", "chat.r1": "ready"}, states
            return True

        await eventually(two_ready, timeout=120, interval=1)
        await ctrl_c(proc, out, data)
        assert not pid_alive(new)


async def test_up_stops_the_engine_of_a_launcher_that_died_and_exits_naming_its_taken_port(
    tmp_path: Path,
) -> None:
    with dev_up(tmp_path, "--insecure") as (proc, data, out):
        _, engine_url = await ready(proc, out)
        text = out.read_text()
        engine, engine_started, engine_port = recorded_engine(data)
        assert engine_url.endswith(f":{engine_port}")
        assert pid_alive(engine)
        launcher = started_pids(text)["launcher"]
        metrics = re.search(r"local-1 launcher http://127\.0\.0\.1:(\d+)/metrics", text)
        assert metrics, text
        metrics_port = int(metrics.group(1))

        # The launcher dies and another process takes its metrics port: a launcher started
        # again cannot listen, so restarting it cannot help.
        os.kill(launcher, signal.SIGKILL)
        with socket.socket() as held:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

            def take() -> bool:
                try:
                    held.bind(("127.0.0.1", metrics_port))
                except OSError:
                    return False
                held.listen()
                return True

            await eventually(take, timeout=10, interval=0.005)
            assert proc.wait(timeout=120) == 1
        said = out.read_text()
        assert f"llmgw: launcher (pid {launcher}) was killed by signal SIGKILL after " in said
        # Up's port check may come first, or the restarted launcher may fail to listen.
        why = (
            rf"launcher (was killed by signal SIGKILL|exited with code 1) and cannot be restarted: "
            rf"port {metrics_port} \(local-1's launcher metrics, --api-port \+ 2\) is held by another "
            r"process \(Address already in use\); stop what holds it, then run `llmgw up` again"
        )
        assert re.search(rf"^llmgw: giving up: {why}; stopping the cluster$", said, re.MULTILINE), said[
            -3000:
        ]
        # The launcher is gone, so `up` stops the engine it recorded, and exits naming the cause.
        assert (
            "llmgw: stopping 1 engine process group left running without a launcher: "
            f"local-1/chat-r0-0's sim (pid {engine})\n"
        ) in said
        assert re.search(rf"^llmgw: stopped\n(.*\n)?llmgw: {why}$", said, re.MULTILINE), said[-3000:]
        assert procs.start_time(engine) != engine_started
        assert port_free(engine_port)
        assert Records(data / "agent").load_all() == ({}, [])
        assert processes_with(str(data)) == []


async def test_up_exits_naming_a_child_that_exits_each_time_it_starts(tmp_path: Path) -> None:
    with dev_up(tmp_path, "--insecure") as (proc, data, out):
        await ready(proc, out)
        engine, engine_started, engine_port = recorded_engine(data)
        gateway = started_pids(out.read_text())["gateway"]
        # From now on the gateway cannot start: its configuration does not load.
        (data / "gateway.yaml").write_text("http: {port: not-a-port}\n")
        os.kill(gateway, signal.SIGKILL)

        assert proc.wait(timeout=180) == 1
        said = out.read_text()
        log = data / "logs" / "gateway.log"
        # Each exit is said as it happens, with the gateway's own last words, and restarted after
        # a longer wait each time.
        exits = re.findall(
            rf"^llmgw: gateway \(pid \d+\) exited with code 2 after [\d.]+s; "
            rf"the last lines of {re.escape(str(log))}:\n(?:    .*\n)*?    llmgw-gateway: "
            rf"{re.escape(str(data / 'gateway.yaml'))}: Expected `int`, got `str` - at `\$\.http\.port`\n"
            r"llmgw: (?:restarting gateway in|giving up)",
            said,
            re.MULTILINE,
        )
        assert f"llmgw: gateway (pid {gateway}) was killed by signal SIGKILL after " in said
        # The kill counts as the first quick exit, unless the gateway had run 30 s by then.
        assert len(exits) in (4, 5), said[-4000:]
        delays = [
            float(d) for d in re.findall(r"^llmgw: restarting gateway in ([\d.]+)s$", said, re.MULTILINE)
        ]
        assert len(delays) >= 4, said[-4000:]
        assert delays == sorted(delays)
        why = f"gateway exited 5 times in a row within 30s of starting (last: exited with code 2); see {log}"
        assert f"llmgw: giving up: {why}; stopping the cluster\n" in said
        assert f"llmgw: stopped\nllmgw: {why}\n" in said
        # Its launcher was alive: it stopped the engine itself.
        assert "without a launcher" not in said
        assert procs.start_time(engine) != engine_started
        assert port_free(engine_port)
        assert processes_with(str(data)) == []
