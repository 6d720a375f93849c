"""A PEFT LoRA adapter's directory (what vLLM and the simulator load at run time) read as hostile
bytes: a config that is not a LoRA adapter's, or whose rank is above the profile's
max_lora_rank, is refused with a PeftError naming it, in bounded time: never another exception."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.adapter_peft import CONFIG_MAX_BYTES, PeftError, peft_config, read_peft
from tests.adapters_support import write_peft_lora

WHERE = "legal/adapter_config.json"


def config(**fields: object) -> bytes:
    base: dict[str, object] = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not None}).encode()


def test_a_peft_directory_reads_as_a_lora_adapter(tmp_path: Path) -> None:
    found = read_peft(write_peft_lora(tmp_path / "legal", rank=16, alpha=32), max_rank=64)
    assert (found.rank, found.alpha, found.target_modules, found.base_model) == (
        16,
        32.0,
        ("q_proj", "v_proj"),
        "org/base",
    )


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (
            config(r=128),
            f"{WHERE}: rank '128' is outside 1 to 64 (the base profile's max_lora_rank); "
            "raise max_lora_rank on the profile, or serve an adapter of lower rank",
        ),
        (
            config(r=0),
            f"{WHERE}: rank '0' is outside 1 to 64 (the base profile's max_lora_rank); "
            "raise max_lora_rank on the profile, or serve an adapter of lower rank",
        ),
        (config(r="8"), f"{WHERE}: r (the rank) is '8', not a whole number"),
        (config(r=True), f"{WHERE}: r (the rank) is bool, not a whole number"),
        (config(peft_type="IA3"), f"{WHERE}: peft_type 'IA3'; llmgw serves LORA adapters"),
        (config(lora_alpha="x"), f"{WHERE}: lora_alpha is 'x', not a number"),
        (config(lora_alpha=1e9), f"{WHERE}: lora_alpha '1000000000.0' is outside -1e6 to 1e6"),
        (
            config(target_modules=[]),
            f"{WHERE}: target_modules is list; a LoRA adapter names the modules it adapts",
        ),
        (config(target_modules=[1]), f"{WHERE}: target_modules holds '1', not a module name"),
        (config(base_model_name_or_path=7), f"{WHERE}: base_model_name_or_path is '7', not a model name"),
        (b"[1]", f"{WHERE}: not a JSON object"),
        (b"\xff", f"{WHERE}: not JSON (JSON is malformed: invalid character (byte 0))"),
        (b" " * (CONFIG_MAX_BYTES + 1), f"{WHERE}: 65,537 bytes; a PEFT config is at most 65,536"),
    ],
)
def test_a_config_that_is_not_a_servable_lora_is_refused_in_words(raw: bytes, words: str) -> None:
    with pytest.raises(PeftError) as exc:
        peft_config(raw, WHERE, max_rank=64)
    assert str(exc.value) == words


def test_a_directory_without_weights_or_with_a_broken_safetensors_header_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PeftError, match="not a directory"):
        read_peft(tmp_path / "none", 64)
    d = write_peft_lora(tmp_path / "a")
    weights = d / "adapter_model.safetensors"
    weights.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(PeftError, match=r"its header says 1,099,511,627,776 bytes in a file of 10"):
        read_peft(d, 64)
    weights.unlink()
    with pytest.raises(PeftError, match=r"cannot be read .* a PEFT adapter has its weights there"):
        read_peft(d, 64)
    # A FIFO where the config belongs: refused, not waited on.
    (d / "adapter_config.json").unlink()
    os.mkfifo(d / "adapter_config.json")
    with pytest.raises(PeftError, match="not a regular file"):
        read_peft(d, 64)


FUZZ = settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_any_bytes_are_a_config_or_a_peft_error(raw: bytes) -> None:
    with contextlib.suppress(PeftError):
        peft_config(raw, WHERE, max_rank=64)


@FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "peft_type": _json | st.just("LORA"),
            "r": _json | st.integers(-10, 100),
            "lora_alpha": _json,
            "target_modules": _json | st.lists(st.text(max_size=300), max_size=300),
            "base_model_name_or_path": _json,
        },
    )
)
def test_fuzz_config_fields_of_any_type_give_a_config_or_a_peft_error(doc: dict[str, object]) -> None:
    raw = json.dumps(doc).encode()
    try:
        found = peft_config(raw, WHERE, max_rank=64)
    except PeftError as exc:
        words = str(exc)
        found = None
    if found is None:
        assert len(words) < 1024
    else:
        assert 1 <= found.rank <= 64
        assert len(found.target_modules) <= 256


def test_deep_nesting_is_refused_not_a_recursion_error() -> None:
    with pytest.raises(PeftError, match="not JSON"):
        peft_config(b"[" * 60_000, WHERE, max_rank=64)
