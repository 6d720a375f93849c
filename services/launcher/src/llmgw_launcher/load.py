"""An engine's load, read from its metrics endpoint: requests running and waiting, KV-cache use,
and the LoRA adapters with requests running or waiting (`lora_in_use`).

Each engine names its gauges its own way (`LOAD_METRICS`); `parse_load` is pure and reads
only those lines of the exposition text (vLLM's runs to a hundred kilobytes of histograms),
with prometheus_client's parser. Several samples of one gauge (vLLM labels them by model and
by data-parallel engine) add up for requests; the fullest KV cache is the one reported.

`Scraper` fetches the text through one HTTP client per launcher, kept open between scrapes.
A scrape that fails (the engine is busy, or restarting) is not a health failure: the health
check judges that. It only leaves the load as last read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmgw_core.events import EngineLoad

# A metrics answer larger than this is cut: the gauges read here come early in every
# engine's exposition, and a runaway endpoint must not fill the launcher's memory.
MAX_METRICS_BYTES = 4 << 20


@dataclass(frozen=True)
class LoadMetrics:
    """The gauges an engine reports its load with; each as the names it has gone by."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    # A fraction (1 is full), where the engine has one.
    kv_cache: tuple[str, ...] = ()
    # The gauge naming the LoRA adapters with requests running or waiting (`lora_in_use`),
    # where the engine loads adapters at run time.
    lora: str = ""


LOAD_METRICS: dict[str, LoadMetrics] = {
    # vLLM's v1 engine; `gpu_cache_usage_perc` before 0.10. Both are fractions despite the name.
    "vllm": LoadMetrics(
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_cache=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        lora="vllm:lora_requests_info",
    ),
    # llama-server with --metrics. Its KV-cache gauges (`kv_cache_usage_ratio`) were removed
    # before b11434, which reports none: the load says so rather than 0.
    "llamacpp": LoadMetrics(
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        kv_cache=("llamacpp:kv_cache_usage_ratio",),
    ),
    "sglang": LoadMetrics(
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_cache=("sglang:token_usage",),
    ),
    "sim": LoadMetrics(
        running=("llmgw_sim_requests_running",),
        waiting=("llmgw_sim_requests_waiting",),
        kv_cache=("llmgw_sim_kv_cache_usage_ratio",),
        lora="llmgw_sim_lora_requests_info",
    ),
}


def parse_load(text: str, metrics: LoadMetrics, at: float = 0.0) -> EngineLoad | None:
    """The load in an exposition text; None if it has neither requests gauge (not this
    engine's metrics, or an engine too old to have them)."""
    wanted = {*metrics.running, *metrics.waiting, *metrics.kv_cache}
    # Only the lines of the wanted families go to the parser: a name is followed by `{`, a
    # space, or (in `# TYPE` / `# HELP` lines) comes after the keyword.
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2] in wanted:
                kept.append(line)
            continue
        end = len(line)
        for stop in ("{", " "):
            at_stop = line.find(stop)
            if at_stop >= 0:
                end = min(end, at_stop)
        if line[:end] in wanted:
            kept.append(line)
    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families("\n".join(kept) + "\n"):
            for sample in family.samples:
                if sample.name in wanted and not math.isnan(sample.value):
                    values.setdefault(sample.name, []).append(sample.value)
    except ValueError:
        return None
    running = _first(values, metrics.running)
    waiting = _first(values, metrics.waiting)
    if running is None and waiting is None:
        return None
    kv = _first(values, metrics.kv_cache, largest=True)
    return EngineLoad(
        running=int(running or 0),
        waiting=int(waiting or 0),
        kv_cache_usage=None if kv is None else min(1.0, max(0.0, kv)),
        at=at,
    )


def _first(values: dict[str, list[float]], names: tuple[str, ...], largest: bool = False) -> float | None:
    """The first of `names` that has samples: their sum, or with `largest` the largest."""
    for name in names:
        if name in values:
            return max(values[name]) if largest else sum(values[name])
    return None


# The labels of the LoRA gauge that name adapters, comma-separated: those with requests running,
# and those with requests waiting (vLLM's `vllm:lora_requests_info`, which the simulator copies).
_LORA_LABELS = frozenset({"running_lora_adapters", "waiting_lora_adapters"})
# One `name="value"` of a label set; a value's escapes kept as they are (no adapter name has one).
# Possessive, and a name begins only where no name character precedes it: on hostile bytes (a
# label never closed, a run of letters) the search is linear in the line, and its memory flat.
_LABEL = re.compile(r'(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*+)="([^"\\\n]*+(?:\\.[^"\\\n]*+)*+)"')
_NAME = re.compile(r"[^,]+")


def lora_in_use(text: str, gauge: str, names: Collection[str]) -> frozenset[str] | None:
    """The adapters of `names` that the engine says have requests running or waiting, from its
    LoRA gauge in an exposition text; None where the text has no sample of it (an engine started
    without LoRA, or too old to report it).

    vLLM sets the gauge to the time at each step, under labels naming the adapters in use then,
    and never removes a series: the text holds one line per set of adapters ever seen, and the
    latest value is the engine's word now. Outside bytes: a line that does not parse is passed
    over, and a name is kept only where it is one of `names` (the adapters the shard has), so
    a label of any length yields at most those, read one name at a time."""
    prefix = gauge + "{"
    latest = -math.inf
    found: set[str] | None = None
    for line in _lines_of(text, prefix):
        close = line.rfind("}")
        value = _sample_value(line[close + 1 :]) if close > 0 else None
        if value is None or value < latest:
            continue
        in_use: set[str] = set()
        for label in _LABEL.finditer(line, len(prefix), close):
            if label.group(1) in _LORA_LABELS:
                in_use.update(m.group() for m in _NAME.finditer(label.group(2)) if m.group() in names)
        if value > latest or found is None:
            latest, found = value, in_use
        else:  # two series set at one time: both are the engine's word
            found |= in_use
    return None if found is None else frozenset(found)


def _lines_of(text: str, prefix: str) -> Iterator[str]:
    """The lines of `text` that begin with `prefix`, each cut out alone (the text is up to
    MAX_METRICS_BYTES: split whole into lines, a hostile one of short lines is millions of
    strings)."""
    at = text.find(prefix)
    while at >= 0:
        end = text.find("\n", at)
        end = len(text) if end < 0 else end
        if at == 0 or text[at - 1] == "\n":
            yield text[at:end]
            at = text.find(prefix, end)
        else:
            at = text.find(prefix, at + len(prefix))


def _sample_value(rest: str) -> float | None:
    """The value of a sample line after its labels (` 1.7e9`, maybe a timestamp after it)."""
    parts = rest.split(None, 2)
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    return None if math.isnan(value) else value


def changed(old: EngineLoad | None, new: EngineLoad | None) -> bool:
    """Whether `new` is worth a status: the request counts moved, or the KV cache by a
    percentage point or more (a cache that fills token by token must not write at every read)."""
    if old is None or new is None:
        return old is not new
    if (old.running, old.waiting) != (new.running, new.waiting):
        return True
    if (old.kv_cache_usage is None) != (new.kv_cache_usage is None):
        return True
    if old.kv_cache_usage is None or new.kv_cache_usage is None:
        return False
    return abs(old.kv_cache_usage - new.kv_cache_usage) >= 0.01


class Scraper:
    """`await scraper.text(url)`: the metrics text, or None if it could not be had in time."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self._client: httpx.AsyncClient | None = None
        self.timeout_s = timeout_s
        self.scrapes = 0
        self.failures = 0

    async def text(self, url: str) -> str | None:
        if self._client is None:
            # Built at the first scrape: a client builds an SSL context, which a launcher
            # whose engines never become ready has no need for.
            self._client = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False)
        self.scrapes += 1
        try:
            async with self._client.stream("GET", url) as r:
                if r.status_code != 200:
                    self.failures += 1
                    return None
                body = bytearray()
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_METRICS_BYTES:
                        # Cut at the last whole line: a partial one would not parse.
                        del body[body.rfind(b"\n", 0, MAX_METRICS_BYTES) + 1 :]
                        break
        except httpx.HTTPError:
            self.failures += 1
            return None
        return body.decode("utf-8", "replace")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
