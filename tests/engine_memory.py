"""What the real engines allocate for a model on CPU: the figures the fit estimate is checked against.

- llama.cpp: `llama-server -lv 4` logs `CPU_Mapped model buffer size = 0.45 MiB` and
  `CPU KV buffer size = 0.25 MiB` while loading; we read them and stop it.
- vLLM: its CPU runner logs no weights figure (the GPU runner's `Model loading took … GiB`
  is not printed there), so a child process loads the model with vLLM's own `LLM` and
  prints the bytes of the parameters and buffers vLLM built and filled (counted before its
  CPU kernels repack them), and the KV cache it sized:
  `CPU KV cache size: N tokens` for the explicit `VLLM_CPU_KVCACHE_SPACE` GiB.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MiB = 1024**2
GiB = 1024**3

_MODEL_BUF = re.compile(r"(\S+) model buffer size =\s*([\d.]+) MiB")
_KV_BUF = re.compile(r"(\S+) KV buffer size =\s*([\d.]+) MiB")


@dataclass(frozen=True)
class LlamaMemory:
    model_bytes: float
    kv_bytes: float
    log: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_memory(bin_dir: str, model: Path, args: list[str], *, timeout: float = 120.0) -> LlamaMemory:
    """Start llama-server on `model`, read its buffer sizes from the log, and stop it (its own group)."""
    argv = [f"{bin_dir}/llama-server", "-m", str(model), "-t", "1", "-lv", "4"]
    argv += ["--host", "127.0.0.1", "--port", str(_free_port()), *args]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    done = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "llama_kv_cache: size" in line or "listening on" in line:
                done.set()
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not done.wait(timeout):
            raise TimeoutError(f"llama-server printed no KV cache size in {timeout:.0f} s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        reader.join(30)
        assert proc.stdout is not None
        proc.stdout.close()
    log = "".join(lines)
    model_mib = sum(float(m[2]) for m in _MODEL_BUF.finditer(log))
    kv_mib = sum(float(m[2]) for m in _KV_BUF.finditer(log))
    if not model_mib or not kv_mib:
        raise AssertionError(f"no model or KV buffer size in llama-server's log:\n{log[-3000:]}")
    return LlamaMemory(model_bytes=model_mib * MiB, kv_bytes=kv_mib * MiB, log=log)


_VLLM_CHILD = r"""
import json, sys
from vllm.model_executor.model_loader import base_loader
from vllm import LLM

# vLLM's CPU kernels repack the linear layers' weights into oneDNN handles once loaded and
# drop the parameters, so the bytes are counted as loaded, just before that repacking.
held = []
process = base_loader.process_weights_after_loading

def counted(model, *args, **kwargs):
    tensors = list(model.parameters()) + list(model.buffers())
    held.append(sum(t.numel() * t.element_size() for t in tensors))
    return process(model, *args, **kwargs)

base_loader.process_weights_after_loading = counted
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=int(sys.argv[3]), enforce_eager=True)
config = llm.llm_engine.vllm_config.cache_config
print("FIT " + json.dumps({"weights": held[0], "kv_tokens": config.kv_cache_size_tokens}), flush=True)
"""


@dataclass(frozen=True)
class VllmMemory:
    weight_bytes: int
    # The KV cache vLLM sized in the explicit space: bytes per token = space / tokens.
    kv_tokens: int
    kv_space_bytes: int
    log: str

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_space_bytes / self.kv_tokens


def vllm_memory(model: Path, *, dtype: str, max_model_len: int, timeout: float = 900.0) -> VllmMemory:
    """Load `model` with vLLM's CPU build in a child process and read what it holds."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", _VLLM_CHILD, str(model), dtype, str(max_model_len)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(30)
        raise TimeoutError(
            f"vLLM did not load in {time.monotonic() - started:.0f} s:\n{out[-3000:]}"
        ) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    found = [line for line in out.splitlines() if line.startswith("FIT ")]
    if proc.returncode != 0 or not found:
        raise AssertionError(f"vLLM exited {proc.returncode} without its figures:\n{out[-4000:]}")
    figures = json.loads(found[-1][4:])
    return VllmMemory(
        weight_bytes=int(figures["weights"]), kv_tokens=int(figures["kv_tokens"]), kv_space_bytes=GiB, log=out
    )
