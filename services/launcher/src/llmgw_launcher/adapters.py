"""A base replica's LoRA adapters, staged and checked on the node before its engine starts.

Each adapter the profile names (`Profile.adapters`) is staged as weights are (`Weights.stage`:
hf:// and https:// verified and shared by peers, file:// checked to exist), its GGUF header
read as hostile bytes and checked against the base's (`llmgw_core.adapter_header`), and linked
as `<state_dir>/adapters/<shard>/<adapter>.gguf`: the path the engine is given, whose file name
is how the gateway finds the adapter's id in the engine's `/lora-adapters` answer.

vLLM (and the simulator) load adapters at run time instead: each is a PEFT directory, checked
(`llmgw_core.adapter_peft`, its rank within the profile's max_lora_rank) and linked as
`<state_dir>/adapters/<shard>/<adapter>`, and the engine starts with none loaded; they are on
the status as loadable (`ShardStatus.adapters_loadable`) until a gateway asks for one
(`adapter_loads`).

A bad adapter (not an adapter, another architecture, a base it does not fit, a broken header, a
source that cannot be staged) is refused by name, in words on the shard's status
(`ShardStatus.adapters_refused`); the base starts without it, with the others. An adapter never
stops its base: llama-server exits at start on an adapter it cannot load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from llmgw_core import fit
from llmgw_core.adapter_header import fit_problem, read_adapter
from llmgw_core.adapter_peft import PeftError, read_peft
from llmgw_core.adapter_rules import max_lora_rank
from llmgw_core.adapters import RUNTIME_ENGINES, Adapter, ServedAdapter
from llmgw_core.sources import SourceError

from .attempt import Failure, bounded
from .weights import WeightsError

if TYPE_CHECKING:
    from .attempt import Attempt, Runner


def link_path(state_dir: Path, shard: str, adapter: str) -> Path:
    """Where the engine reads `adapter`'s file for `shard` (names are tokens: no path parts)."""
    return state_dir / "adapters" / shard / f"{adapter}.gguf"


def runtime_link_path(state_dir: Path, shard: str, adapter: str) -> Path:
    """Where a runtime engine (vLLM) reads `adapter`'s PEFT directory for `shard`."""
    return state_dir / "adapters" / shard / adapter


def check_peft(directory: Path, max_rank: int) -> str | None:
    """Why the PEFT adapter at `directory` cannot be loaded by an engine serving ranks up to
    `max_rank`; None when it can. Blocking: reads its config and its weights' header."""
    try:
        read_peft(directory, max_rank)
    except PeftError as exc:
        return str(exc)
    return None


def check(adapter_file: Path, base_file: str) -> str | None:
    """Why the adapter at `adapter_file` cannot be applied to the base model at `base_file`; None
    when it can. Blocking: reads both headers."""
    try:
        header = read_adapter(adapter_file)
    except fit.FitError as exc:
        return str(exc)
    try:
        return fit_problem(header, Path(base_file))
    except fit.FitError as exc:
        return f"cannot check it against the base: {exc}"


def link(target: Path, at: Path) -> None:
    """`at` made a symbolic link to `target`, replacing what was there (blocking)."""
    at.parent.mkdir(parents=True, exist_ok=True)
    tmp = at.with_name(f".{at.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target.resolve(), tmp)
    os.replace(tmp, at)


def forget(state_dir: Path, shard: str) -> None:
    """The links of a shard's adapters removed (blocking)."""
    where = state_dir / "adapters" / shard
    if not where.is_dir():
        return
    for entry in where.iterdir():
        if entry.is_symlink() or entry.is_file():
            entry.unlink()


class AdaptersHook:
    """The adapters the base's engine is started with: each staged, checked and linked, or
    refused by name on the shard's status."""

    name = "adapters"

    async def run(self, runner: Runner, attempt: Attempt) -> Failure | None:
        spec = runner.spec
        adapters = spec.profile.adapters
        runner.adapters_refused = ()
        runner.adapters_served = ()
        runner.adapters_staged = {}
        if not adapters or not spec.is_leader:
            return None
        served: list[Adapter] = []
        refused: list[str] = []
        ctx = runner.ctx
        await ctx.workers.files(forget, ctx.state_dir, spec.shard)
        for adapter in adapters:
            words = await self._one(runner, attempt, adapter)
            if isinstance(words, str):
                refused.append(bounded(f"adapter {adapter.name} refused: {words}"))
            else:
                served.append(words)
        runner.adapters_refused = tuple(refused)
        if spec.profile.engine in RUNTIME_ENGINES:
            # Loaded on demand, when a gateway asks (`adapter_loads`): none at start.
            runner.adapters_staged = {a.name: a.source.removeprefix("file://") for a in served}
            return None
        runner.adapters_served = tuple(ServedAdapter(name=a.name, scale=a.scale) for a in served)
        attempt.adapters = tuple(served)
        return None

    async def _one(self, runner: Runner, attempt: Attempt, adapter: Adapter) -> Adapter | str:
        ctx = runner.ctx
        try:
            source = adapter.model_source
        except SourceError as exc:
            return str(exc)
        if ctx.weights is None:
            return "this node stages no weights"

        def report(words: str) -> None:
            runner.progress("waiting", f"adapter {adapter.name}: {words}")

        try:
            path = await ctx.weights.stage(source, report)
        except WeightsError as exc:
            return exc.reason
        runtime = runner.spec.profile.engine in RUNTIME_ENGINES
        if runtime:
            problem = await ctx.workers.files(check_peft, path, max_lora_rank(runner.spec.profile))
        else:
            problem = await ctx.workers.files(check, path, attempt.model_path)
        if problem is not None:
            return problem
        where = runtime_link_path if runtime else link_path
        at = where(ctx.state_dir, runner.spec.shard, adapter.name)
        try:
            await ctx.workers.files(link, path, at)
        except OSError as exc:
            return f"cannot link {at}: {exc.strerror}"
        return msgspec.structs.replace(adapter, source=f"file://{at}", sha256="")
