"""GPU classes: the catalog says `H100-80G`, nvidia-smi says `NVIDIA H100 80GB HBM3`."""

from __future__ import annotations

import functools
import re

from llmgw_core.engines import GPUInfo

_MODEL = re.compile(r"\b([A-Z]{1,3}\d{2,4}[A-Z]{0,3})\b")
_NAME_MEMORY = re.compile(r"(\d+)\s*GB", re.IGNORECASE)


def gpu_class(gpu: GPUInfo) -> str:
    """`<model>-<memory>G`, e.g. H100-80G, A100-40G, L40S-48G; the memory in whole GiB as marketed."""
    return _class_of(gpu.name, gpu.memory_mb)


@functools.lru_cache(maxsize=4096)
def _class_of(gpu_name: str, memory_mb: int) -> str:
    gpu = GPUInfo(index=0, name=gpu_name, memory_mb=memory_mb)
    name = gpu.name.replace("NVIDIA", "").replace("Tesla", "").replace("GeForce", "")
    m = _MODEL.search(name.upper())
    model = m.group(1) if m else name.strip().split()[0] if name.strip() else "GPU"
    memory = 0
    nm = _NAME_MEMORY.search(gpu.name)
    if nm:
        memory = int(nm.group(1))
    elif gpu.memory_mb:
        memory = round(gpu.memory_mb / 1024)
    return f"{model}-{memory}G" if memory else model
