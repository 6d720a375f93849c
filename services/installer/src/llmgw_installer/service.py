"""The installer service: probe the node, converge its engines on the desired list, report, recheck.

No exception leaves the main loop: a pass that fails (a corrupt archive, a
release API down, a bus timeout, a bug) costs that pass. An engine that did
not install is tried again after llmgw's backoff (`llmgw_core.retry`: jittered,
growing to a cap, never later than the recheck interval); a run of such passes is
logged when it starts and when it ends. A change of the desired engines wakes the
loop at once.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import anyio
import anyio.abc
import httpx
import msgspec
from opentelemetry import trace
from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric, StateSetMetricFamily

from llmgw_core.bus import Bus
from llmgw_core.claims import hold
from llmgw_core.config import AgentConfig
from llmgw_core.errors import BusError
from llmgw_core.events import (
    DesiredEngines,
    EngineInventory,
    EngineSpec,
    EngineState,
    EngineStateName,
    InstallProgress,
    NodeFacts,
    NodeStatus,
    now,
)
from llmgw_core.installed import engines_root, read_marker
from llmgw_core.metrics import SLOW_BUCKETS, Collect, add_bus, counter, new_registry, serve_metrics
from llmgw_core.probe import Probe, advertised_address
from llmgw_core.retry import Backoff, Outage, Retry
from llmgw_core.staged import held, shapes
from llmgw_core.subjects import ENGINES_KEY
from llmgw_core.telemetry import context_from

from . import ospkg
from .archive import Limits
from .checks import missing_libraries
from .engines import configured_engines
from .envs import ENV_ENGINES, EnvInstallation, digest, lock_of, remove_unwanted, wanted_dir
from .pipeline import Installation, InstallContext, Ldd, clean_staging
from .sharing import WheelShare
from .wheels import remove_unwanted_wheels

log = logging.getLogger("llmgw.installer")
tracer = trace.get_tracer("llmgw.installer")

# Placement refuses CPU profiles here for the same reason (docs/placement.md, "No AVX2").
NO_AVX2 = (
    "no AVX2: llama.cpp's CPU build would run several times slower here; "
    "placement sends this node no CPU profiles (GPU profiles still run)"
)


# How often the installer looks at the weights store for a model staged or evicted since it last
# reported (directory names and small files only): placement hears of it within this, not at the
# next recheck, so a failover goes where the weights now are and a model is fitted once staged.
WEIGHTS_POLL_S = 2.0


def staged_state(models: Path) -> tuple[dict[str, str], tuple[str, ...]]:
    """What the node's weights store holds, as the probe reports it (keys and their shapes)."""
    return held(models), tuple(sorted(shapes(models)))


def node_facts(config: AgentConfig, probe: Probe | None = None) -> NodeFacts:
    probe = probe or Probe(
        config.node,
        model_paths=config.model_paths,
        models_dir=config.state_path / "models",
        mgmt_addr=config.mgmt_addr,
        mgmt_iface=config.mgmt_iface,
    )
    facts = probe.facts()
    if config.simulate is not None:
        facts = msgspec.structs.replace(
            facts,
            gpus=config.simulate.gpu_list(),
            hcas=config.simulate.hcas,
            simulated=True,
            nvidia_driver=facts.nvidia_driver or ("sim" if config.simulate.gpu_list() else ""),
            memory_mb=config.simulate.memory_mb or facts.memory_mb,
        )
    return facts


ENGINE_STATES: tuple[str, ...] = get_args(EngineStateName)


def warnings_for(facts: NodeFacts, engines: tuple[EngineState, ...] = ()) -> tuple[str, ...]:
    cpu_only = tuple(f"{e.name} {e.version}: CPU build only: {e.cpu_only}" for e in engines if e.cpu_only)
    return (() if facts.has_avx2 else (NO_AVX2,)) + cpu_only


def while_rechecked(spec: EngineSpec, last: EngineState | None, root: Path) -> EngineState:
    """What a desired engine is reported as while this pass checks or installs it.

    An installed engine stays installed while it is rechecked (ldd and --version take
    seconds, and placement refuses an `installing` node): as last reported, or, after
    a restart, as its marker says. Only the recheck's own outcome changes that.
    """
    if last is not None and last.runs and last.version == spec.version:
        return last
    where = install_dir(root, spec)
    marker = read_marker(where) if where is not None else None
    if marker is not None:
        return EngineState(
            name=spec.name,
            state="installed",
            version=spec.version,
            path=marker.bin_dir,
            engine_version=marker.version,
            cpu_only=marker.cpu_only,
        )
    return EngineState(name=spec.name, state="installing", version=spec.version)


def install_dir(root: Path, spec: EngineSpec) -> Path | None:
    """Where a desired engine is installed: a build per tag, an environment per version and
    variant (None while its lock cannot be read)."""
    if spec.name in ENV_ENGINES:
        return wanted_dir(root, spec)
    return root / spec.name / spec.version


def named_as_desired(state: EngineState, desired: tuple[EngineSpec, ...]) -> EngineState:
    """A configured engine under the version `engines:` names for it, its own beside it."""
    for spec in desired:
        if spec.name == state.name and spec.version and state.runs:
            return msgspec.structs.replace(state, version=spec.version)
    return state


def _uv_bin() -> str:
    import uv

    return str(uv.find_uv_bin())


class Installer:
    def __init__(
        self,
        config: AgentConfig,
        bus: Bus,
        probe: Probe | None = None,
        *,
        packages: ospkg.PackageManager | bool | None = True,
        http_timeout_s: float = 30.0,
        retry_backoff_s: float = 1.0,
        version_timeout_s: float = 20.0,
        install_backoff_s: float = 10.0,
        install_backoff_cap_s: float = 300.0,
        ldd: Ldd = missing_libraries,
        uv: str = "",
    ) -> None:
        self.config = config
        self.bus = bus
        self.probe = probe
        self.facts: NodeFacts | None = None
        self.engines: tuple[EngineState, ...] = ()
        self.probed_at = 0.0
        self.install_words = ""
        self.desired: tuple[EngineSpec, ...] = ()
        self.desired_traceparent = ""
        # Whether the desired engines were read at all: until then no environment is "no longer
        # wanted" (a store that did not answer at start would otherwise cost every one of them).
        self.desired_known = False
        self.failures = 0
        self.metrics_port = 0
        self.root = engines_root(config.state_dir)
        self.node = config.node
        # Engine wheels shared between nodes: its claims, what it holds, its wheel server.
        self.wheels = WheelShare(config.node, bus, self.root / ".wheels", self._report_wheels)
        self.packages = ospkg.detect() if packages is True else (packages or None)
        self.http_timeout_s = http_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.version_timeout_s = version_timeout_s
        self.install_backoff_s = install_backoff_s
        self.install_backoff_cap_s = install_backoff_cap_s
        self.ldd = ldd
        # The uv that builds vLLM's and SGLang's environments (a dependency of the installer).
        self.uv = uv or _uv_bin()
        self.limits = Limits(max_total_bytes=config.unpack_max_bytes, max_ratio=config.unpack_max_ratio)
        # Passes in a row that left an engine not running, or that faulted; the wait before
        # the next one (drawn once per pass), and the run of such passes as one outage.
        self.failing_passes = 0
        self.pass_backoff = Backoff(install_backoff_s, install_backoff_cap_s)
        self.pass_wait_s = 0.0
        self.failing = Outage(log, f"{config.node}: installing this node's engines")
        # The last pass hit a fault of the installer itself (not an engine refused).
        self.faulted = False
        self.faults = 0
        self._wake = anyio.Event()
        self._lock = anyio.Lock()
        # The NATS store was lost and its buckets are back: report this node again now (a pass
        # ends with it), not at the next recheck; until then placement knew no node.
        bus.losses.on_lost.append(lambda: self._wake.set())
        self.metrics_registry = new_registry("installer")
        self.install_seconds = Histogram(
            "llmgw_installer_install_duration_seconds",
            "Time an engine's install took (download, verify, unpack, check), by engine and outcome; "
            "rechecks of an installed engine are not counted.",
            ["engine", "outcome"],
            buckets=SLOW_BUCKETS,
            registry=self.metrics_registry,
        )
        self.metrics_registry.register(Collect(self._engine_metrics))
        add_bus(self.metrics_registry, bus)

    # --- reporting ---------------------------------------------------------------

    async def _status(self) -> NodeStatus:
        assert self.facts is not None
        status = NodeStatus(
            node=self.config.node,
            facts=self.facts,
            engines=self.engines,
            probed_at=self.probed_at,
            install=self.install_words,
            warnings=warnings_for(self.facts, self.engines),
            updated_at=now(),
            wheels=await anyio.to_thread.run_sync(self.wheels.held),
        )
        await self.bus.put(self.bus.names.nodes_bucket, self.config.node, status)
        return status

    async def _report_wheels(self) -> None:
        """The node's status again, for the wheels it claims or serves (once it has facts to say)."""
        if self.facts is not None:
            await self._status()

    async def serve_wheels(
        self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The node's wheel server on its `mgmt_addr` (`sharing.py`), until cancelled."""
        config = self.config
        host = await anyio.to_thread.run_sync(advertised_address, config.mgmt_addr, config.mgmt_iface)
        await self.wheels.serve(host, self._lock, task_status=task_status)

    async def _progress(self, progress: InstallProgress) -> None:
        log.info("%s", progress.message)
        self.install_words = progress.message if progress.outcome != "done" else ""
        try:
            await self.bus.publish(self.bus.names.node_install(self.config.node), progress)
            await self._status()
        except BusError as exc:
            log.warning("could not report install progress: %s", exc)

    # --- converging ----------------------------------------------------------------

    async def converge_once(self) -> NodeStatus | None:
        """Probe, check and install every engine, and report; returns what was reported.

        Never raises (but for cancellation): a fault is logged, counted, said in
        the node's status where the bus allows, and leaves `faulted` set; then
        the return value is None if nothing could be reported.
        """
        async with self._lock:
            self.faulted = False
            try:
                status: NodeStatus | None = await self._converge()
            except Exception as exc:
                status = await self._fault(exc)
            if self.faulted or status is None or any(not e.runs for e in self.engines):
                self.failing_passes += 1
                self.pass_wait_s = self.pass_backoff.wait(self.failing_passes)
                self.failing.failed(self._why_failing(status))
            else:
                self.failing_passes = 0
                self.failing.recovered()
            return status

    def _why_failing(self, status: NodeStatus | None) -> str:
        if self.faulted or status is None:
            return self.install_words or "the pass could not report"
        return "; ".join(f"engine {e.name} is {e.state}: {e.detail}" for e in self.engines if not e.runs)

    async def _fault(self, exc: Exception) -> NodeStatus | None:
        """A pass failed outside any one install: say so, and let the next pass try again."""
        self.faulted = True
        self.faults += 1
        if isinstance(exc, BusError):
            log.warning("this pass could not report: %s", exc)
        else:
            log.error("internal error in this pass: %s", exc, exc_info=exc)
        self.install_words = f"internal error: {type(exc).__name__}: {exc}"
        if self.facts is None:
            return None
        try:
            return await self._status()
        except BusError as bus_exc:
            log.warning("could not report the fault either: %s", bus_exc)
            return None

    async def _converge(self) -> NodeStatus:
        node = self.config.node
        facts = await anyio.to_thread.run_sync(node_facts, self.config, self.probe)
        names = self.bus.names
        if facts != self.facts:
            await self.bus.publish(names.node_facts(node), facts)
        self.facts = facts
        if self.probed_at == 0.0:
            removed = await anyio.to_thread.run_sync(clean_staging, self.root)
            if removed:
                log.warning("removed the leftovers of an interrupted install: %s", ", ".join(removed))
        states = [
            named_as_desired(s, self.desired)
            for s in await anyio.to_thread.run_sync(configured_engines, self.config)
        ]
        configured = {s.name for s in states}
        pending = [spec for spec in self.desired if spec.name not in configured]
        last = {e.name: e for e in self.engines}
        rechecked = [
            await anyio.to_thread.run_sync(while_rechecked, spec, last.get(spec.name), self.root)
            for spec in pending
        ]
        self.engines = tuple(sorted([*states, *rechecked], key=lambda s: s.name))
        self.probed_at = now()
        await self._status()
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.http_timeout_s)) as client:
            ctx = InstallContext(
                node=node,
                root=self.root,
                facts=facts,
                client=client,
                report=self._progress,
                github_api=self.config.github_api,
                mirror=self.config.mirror,
                packages=self.packages,
                allow_os_packages=self.config.allow_os_packages,
                retry_backoff_s=self.retry_backoff_s,
                version_timeout_s=self.version_timeout_s,
                limits=self.limits,
                ldd=self.ldd,
                wheels=self.wheels,
            )
            for spec in pending:
                state = await self._install(spec, ctx)
                if state.state == "broken":
                    # Seen broken (an upgrade removed a library, a file was deleted):
                    # say so, then install it again from scratch.
                    log.error("engine %s is broken: %s; reinstalling", spec.name, state.detail)
                    self._set_engine(state)
                    await self.bus.publish(
                        names.node_engines(node),
                        EngineInventory(node=node, probed_at=now(), engines=self.engines),
                    )
                    await self._status()
                    where = install_dir(self.root, spec)
                    if where is not None:
                        await anyio.to_thread.run_sync(shutil.rmtree, where)
                    state = await self._install(spec, ctx)
                self._set_engine(state)
        if self.desired_known:
            wanted = {d for spec in pending if (d := install_dir(self.root, spec)) is not None}
            removed = await anyio.to_thread.run_sync(remove_unwanted, self.root, wanted)
            if removed:
                log.info("removed engine environments no longer wanted: %s", ", ".join(removed))
            locks = {digest(lock) for spec in pending if spec.name in ENV_ENGINES and (lock := lock_of(spec))}
            gone = await anyio.to_thread.run_sync(remove_unwanted_wheels, self.root / ".wheels", locks)
            if gone:
                log.info("removed engine wheels no longer wanted: %s", ", ".join(gone))
        self.probed_at = now()
        await self.bus.publish(
            names.node_engines(node),
            EngineInventory(node=node, probed_at=self.probed_at, engines=self.engines),
        )
        status = await self._status()
        for engine in self.engines:
            if not engine.runs:
                log.warning("engine %s is %s: %s", engine.name, engine.state, engine.detail)
        return status

    async def _install(self, spec: EngineSpec, ctx: InstallContext) -> EngineState:
        """One engine's install or recheck; whatever goes wrong costs only this attempt."""
        with tracer.start_as_current_span(
            f"install {spec.name} {spec.version}", context=context_from(self.desired_traceparent)
        ):
            installation = (
                EnvInstallation(spec, ctx, self.uv) if spec.name in ENV_ENGINES else Installation(spec, ctx)
            )
            where = install_dir(self.root, spec)
            recheck = where is not None and await anyio.to_thread.run_sync(read_marker, where) is not None
            started = time.monotonic()
            try:
                state = await installation.run()
            except BusError:
                raise  # the pass cannot report; it is retried as a whole
            except Exception as exc:
                self.faulted = True
                self.faults += 1
                log.error("internal error installing %s %s: %s", spec.name, spec.version, exc, exc_info=exc)
                state = await installation.fail("failed", f"internal error: {type(exc).__name__}: {exc}")
            if not recheck:
                self.install_seconds.labels(spec.name, state.state).observe(time.monotonic() - started)
            return state

    def _set_engine(self, state: EngineState) -> None:
        others = [e for e in self.engines if e.name != state.name]
        self.engines = tuple(sorted([*others, state], key=lambda s: s.name))
        if state.state == "failed":
            self.install_words = f"install failed: {state.detail}"
            self.failures += 1

    # --- the service -----------------------------------------------------------------

    async def load_desired(self) -> None:
        found = await self.bus.get(self.bus.names.config_bucket, ENGINES_KEY, DesiredEngines)
        self.desired = found[0].engines if found else ()
        self.desired_traceparent = found[0].traceparent if found else ""
        self.desired_known = True

    async def _watch_desired(self) -> None:
        retry = Retry(log, "watching the desired engines", base_s=0.5, cap_s=30.0, known=(BusError,))
        while True:
            try:
                async for change in self.bus.watch(self.bus.names.config_bucket, DesiredEngines, ENGINES_KEY):
                    retry.succeeded()
                    desired = change.value.engines if change.value else ()
                    self.desired_traceparent = change.value.traceparent if change.value else ""
                    self.desired_known = True
                    if desired != self.desired:
                        self.desired = desired
                        self._wake.set()
            except Exception as exc:
                retry.failed(exc)
            await retry.wait()

    async def _watch_weights(self) -> None:
        """Report the node's facts again when its weights store changed (see WEIGHTS_POLL_S)."""
        models = self.config.state_path / "models"
        last: tuple[dict[str, str], tuple[str, ...]] | None = None
        while True:
            try:
                found = await anyio.to_thread.run_sync(staged_state, models)
                if found != last:
                    async with self._lock:
                        if self.facts is not None:
                            facts = await anyio.to_thread.run_sync(node_facts, self.config, self.probe)
                            if facts != self.facts:
                                await self.bus.publish(self.bus.names.node_facts(self.config.node), facts)
                                self.facts = facts
                                await self._status()
                    last = found
            except Exception as exc:  # the next look, or the next pass, reports it
                log.warning("could not report the weights this node holds: %s", exc)
            await anyio.sleep(WEIGHTS_POLL_S)

    def next_pass_in(self) -> float:
        """Seconds until the next pass: the recheck interval, or sooner while an engine is not running."""
        recheck = self.config.recheck_interval_s
        if not self.failing_passes:
            return recheck
        return min(recheck, self.pass_wait_s)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await self.load_desired()
        except Exception as exc:  # the watch below catches up once the bus answers
            log.warning("could not read the desired engines yet: %s", exc)
        async with anyio.create_task_group() as tg:
            # Heartbeats first; and while another installer works for this node id (a second
            # machine given the same id), this one stands by here and reports nothing.
            await tg.start(hold, self.bus, self.config.node, "installer", self.config.heartbeat_interval_s)
            if self.config.installer_metrics_port:
                self.metrics_port = await tg.start(
                    serve_metrics,
                    self.metrics_registry,
                    advertised_address(self.config.mgmt_addr, self.config.mgmt_iface),
                    self.config.installer_metrics_port,
                )
            try:
                await tg.start(self.serve_wheels)
            except OSError as exc:  # the node installs all the same; its peers go to the index
                log.warning("not serving engine wheels to other nodes: %s", exc)
            await self.converge_once()
            tg.start_soon(self._watch_desired)
            tg.start_soon(self._watch_weights)
            task_status.started()
            while True:
                delay = self.next_pass_in()
                if self.failing_passes:
                    log.debug("next attempt in %.0fs (%d failed passes in a row)", delay, self.failing_passes)
                with anyio.move_on_after(delay):
                    await self._wake.wait()
                # A fresh event before the pass: a change of the desired engines during
                # the pass wakes the next wait at once instead of being lost.
                self._wake = anyio.Event()
                await self.converge_once()

    def _engine_metrics(self) -> Iterator[Metric]:
        """The engines as last reported, read at each scrape: stable labels (the engine) only."""
        up = GaugeMetricFamily(
            "llmgw_installer_engine_up",
            "1 if the engine is installed or configured and runs.",
            labels=["engine"],
        )
        state = StateSetMetricFamily(
            "llmgw_installer_engine_state", "The engine's install state.", labels=["engine"]
        )
        info = InfoMetricFamily("llmgw_installer_engine", "The engine's version.", labels=["engine"])
        for e in self.engines:
            up.add_metric([e.name], int(e.runs))
            state.add_metric([e.name], {s: s == e.state for s in ENGINE_STATES})
            info.add_metric([e.name], {"version": e.version, "engine_version": e.engine_version})
        yield from (up, state, info)
        yield GaugeMetricFamily(
            "llmgw_installer_probed_at_seconds",
            "When this node last probed (Unix time).",
            value=self.probed_at,
        )
        yield counter("llmgw_installer_installs_failed", "Installs that failed.", self.failures)
        yield counter(
            "llmgw_installer_faults",
            "Passes or installs cut short by a fault of the installer itself.",
            self.faults,
        )
