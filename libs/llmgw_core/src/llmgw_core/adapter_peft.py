"""A PEFT LoRA adapter's directory, read as hostile bytes: what vLLM (and the simulator) load at
run time (`/v1/load_lora_adapter`).

PEFT writes an adapter as a directory: `adapter_config.json` (`peft_type` "LORA", the rank `r`,
`lora_alpha`, `target_modules`, `base_model_name_or_path`) beside `adapter_model.safetensors`.
vLLM refuses an adapter whose rank is above its `--max-lora-rank` only when asked to load it, in
the middle of a request held for it; refused here, on the node, by name, before any request.

    PeftError     the directory is not a PEFT LoRA adapter llmgw can serve on this base
"""

from __future__ import annotations

import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct

from .limits import shown

__all__ = [
    "CONFIG_MAX_BYTES",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "PeftConfig",
    "PeftError",
    "peft_config",
    "read_peft",
]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# PEFT's adapter_config.json is under 2 KiB; one far larger is not a config.
CONFIG_MAX_BYTES = 64 * 1024
# target_modules: a model has a few dozen kinds of linear layer.
TARGETS_MAX = 256
_TARGET_CHARS = 256
_BASE_CHARS = 512
# A safetensors header: 8 bytes of length, then that much JSON (bounded by the format at 100 MB).
_SAFETENSORS_HEADER_MAX = 100_000_000

_decoder = msgspec.json.Decoder()


class PeftError(Exception):
    """A directory that is not a PEFT LoRA adapter llmgw serves on this base."""


class PeftConfig(Struct, frozen=True, kw_only=True):
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str


def peft_config(raw: bytes, where: str, max_rank: int) -> PeftConfig:
    """`raw` (an adapter_config.json's bytes) read as a LoRA adapter's config whose rank is at
    most `max_rank`: PeftError for anything else, never another exception."""
    if len(raw) > CONFIG_MAX_BYTES:
        raise PeftError(f"{where}: {len(raw):,} bytes; a PEFT config is at most {CONFIG_MAX_BYTES:,}")
    try:
        doc = _decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise PeftError(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise PeftError(f"{where}: not a JSON object")
    kind = doc.get("peft_type", "LORA")
    if kind != "LORA":
        raise PeftError(f"{where}: peft_type {_said(kind)}; llmgw serves LORA adapters")
    rank = doc.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise PeftError(f"{where}: r (the rank) is {_said(rank)}, not a whole number")
    if not 1 <= rank <= max_rank:
        raise PeftError(
            f"{where}: rank {_said(rank)} is outside 1 to {max_rank} (the base profile's max_lora_rank); "
            "raise max_lora_rank on the profile, or serve an adapter of lower rank"
        )
    alpha = doc.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise PeftError(f"{where}: lora_alpha is {_said(alpha)}, not a number")
    if not -1e6 <= alpha <= 1e6:
        raise PeftError(f"{where}: lora_alpha {_said(alpha)} is outside -1e6 to 1e6")
    return PeftConfig(
        rank=rank,
        alpha=float(alpha),
        target_modules=_targets(doc.get("target_modules"), where),
        base_model=_base(doc.get("base_model_name_or_path"), where),
    )


def _targets(value: Any, where: str) -> tuple[str, ...]:
    # PEFT writes a list of module names, or one regular expression as a string.
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names:
        raise PeftError(
            f"{where}: target_modules is {_said(value)}; a LoRA adapter names the modules it adapts"
        )
    if len(names) > TARGETS_MAX:
        raise PeftError(f"{where}: target_modules names {len(names):,} modules, more than {TARGETS_MAX}")
    for name in names:
        if not isinstance(name, str) or not 0 < len(name) <= _TARGET_CHARS:
            raise PeftError(f"{where}: target_modules holds {_said(name)}, not a module name")
    return tuple(names)


def _base(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > _BASE_CHARS:
        raise PeftError(f"{where}: base_model_name_or_path is {_said(value)}, not a model name")
    return value


def _said(value: Any) -> str:
    if isinstance(value, str):
        return shown(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return shown(str(value))
    return type(value).__name__


def read_peft(directory: Path, max_rank: int) -> PeftConfig:
    """The adapter directory at `directory`, read and checked (blocking): its config
    (`peft_config`) and a safetensors weights file whose header length fits the file."""
    if not directory.is_dir():
        raise PeftError(f"{directory}: not a directory; a PEFT adapter is a directory with {CONFIG_NAME}")
    config = directory / CONFIG_NAME
    raw = _read_bounded(config, CONFIG_MAX_BYTES)
    found = peft_config(raw, str(config), max_rank)
    _check_weights(directory / WEIGHTS_NAME)
    return found


def _read_bounded(path: Path, limit: int) -> bytes:
    try:
        # Not blocking: a FIFO put where the config belongs would hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise PeftError(f"{path}: cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise PeftError(f"{path}: not a regular file")
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise PeftError(f"{path}: more than {limit:,} bytes; a PEFT config is far smaller")
    return raw


def _check_weights(path: Path) -> None:
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise PeftError(f"{path}: not a regular file")
            head = f.read(8)
    except OSError as exc:
        raise PeftError(
            f"{path}: cannot be read ({exc.strerror}); a PEFT adapter has its weights there"
        ) from None
    if len(head) < 8:
        raise PeftError(f"{path}: {info.st_size} bytes; not a safetensors file")
    (length,) = struct.unpack("<Q", head)
    if not 2 <= length <= min(_SAFETENSORS_HEADER_MAX, info.st_size - 8):
        raise PeftError(
            f"{path}: its header says {length:,} bytes in a file of {info.st_size:,}; not a safetensors file"
        )
