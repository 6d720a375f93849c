"""A LoRA adapter's GGUF header read as hostile bytes, and whether it fits its base.

A file that is not an adapter, is one of another architecture or shape, or breaks the format
is refused with a FitError naming it, in bounded time and memory: never another exception."""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

# Imported here, before the fuzz tests' first example: the walk imports it on its first call,
# and that second under load would count against the first example's deadline.
import gguf.constants  # noqa: F401
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.adapter_header import AdapterError, adapter_header, fit_problem, read_adapter
from llmgw_core.fit import FitError, HeaderError
from tests.adapters_support import write_tiny_lora
from tests.tiny_model import write_tiny_llama


def test_a_tiny_lora_reads_as_an_adapter_for_its_base(tmp_path: Path) -> None:
    base = write_tiny_llama(tmp_path / "base.gguf")
    lora = write_tiny_lora(tmp_path / "lora.gguf", rank=4, alpha=8.0)
    header = read_adapter(lora)
    assert header.architecture == "llama"
    assert header.alpha == 8.0
    assert header.rank == 4
    assert header.shapes["blk.0.attn_q.weight"] == (64, 64)
    assert fit_problem(header, base) is None


def test_an_adapter_of_another_architecture_does_not_fit(tmp_path: Path) -> None:
    base = write_tiny_llama(tmp_path / "base.gguf")
    header = read_adapter(write_tiny_lora(tmp_path / "lora.gguf", arch="qwen2"))
    assert (
        fit_problem(header, base) == "the adapter is for architecture 'qwen2', the base base.gguf is 'llama'"
    )


def test_an_adapter_of_another_width_does_not_fit(tmp_path: Path) -> None:
    base = write_tiny_llama(tmp_path / "base.gguf")
    header = read_adapter(write_tiny_lora(tmp_path / "lora.gguf", n_embd=32))
    problem = fit_problem(header, base)
    assert problem is not None
    assert "'blk.0.attn_q.weight' is 32 x 32, the base's is 64 x 64" in problem


def test_an_adapter_for_a_deeper_model_does_not_fit(tmp_path: Path) -> None:
    base = write_tiny_llama(tmp_path / "base.gguf")
    header = read_adapter(write_tiny_lora(tmp_path / "lora.gguf", n_layer=3))
    assert fit_problem(header, base) == (
        "the adapter changes tensor 'blk.2.attn_q.weight', which the base base.gguf does not have"
    )


def test_a_model_is_not_an_adapter(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=r"not an adapter \(no general.type"):
        read_adapter(write_tiny_llama(tmp_path / "base.gguf"))


@pytest.mark.parametrize(
    ("general", "kind", "words"),
    [
        ("model", "lora", r"not an adapter \(general.type 'model'"),
        ("adapter", "control_vector", r"not a LoRA adapter \(adapter.type 'control_vector'"),
        ("adapter", None, r"not a LoRA adapter \(no adapter.type"),
    ],
)
def test_other_kinds_of_gguf_are_refused_by_name(
    tmp_path: Path, general: str, kind: str | None, words: str
) -> None:
    lora = write_tiny_lora(tmp_path / "x.gguf", general_type=general, adapter_type=kind)
    with pytest.raises(AdapterError, match=words):
        read_adapter(lora)


def test_not_a_gguf_at_all(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"<html>not found</html>" * 4)
    with pytest.raises(FitError, match="no GGUF magic"):
        read_adapter(path)


def test_a_truncated_adapter_is_a_header_error(tmp_path: Path) -> None:
    lora = write_tiny_lora(tmp_path / "x.gguf")
    data = lora.read_bytes()
    lora.write_bytes(data[:200])
    with pytest.raises(HeaderError):
        read_adapter(lora)


# ---- hostile bytes ----


def _gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _kv(key: str, kind: int, value: bytes) -> bytes:
    return _gstr(key.encode()) + struct.pack("<I", kind) + value


def _tensor(name: str, dims: list[int], kind: int = 0, offset: int = 0) -> bytes:
    return (
        _gstr(name.encode())
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", kind, offset)
    )


def _gguf(kvs: list[bytes], tensors: list[bytes], data: int) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * (-len(body) % 32)
    return body + b"\0" * data


_ADAPTER_KVS = [
    _kv("general.architecture", 8, _gstr(b"llama")),
    _kv("general.type", 8, _gstr(b"adapter")),
    _kv("adapter.type", 8, _gstr(b"lora")),
    _kv("adapter.lora.alpha", 6, struct.pack("<f", 16.0)),
]

FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def _read_bytes(data: bytes) -> object:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.gguf"
        path.write_bytes(data)
        try:
            return read_adapter(path)
        except FitError as exc:
            return exc


@FUZZ
@given(st.binary(max_size=2048))
def test_any_bytes_give_an_adapter_or_its_own_error(data: bytes) -> None:
    found = _read_bytes(b"GGUF" + data)
    assert not isinstance(found, BaseException) or isinstance(found, FitError)


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["blk.0.attn_q.weight", "output.weight", "x"]),
            st.sampled_from([".lora_a", ".lora_b", ""]),
            st.lists(st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1)), max_size=5),
            st.integers(0, 40),
        ),
        max_size=6,
    ),
    st.integers(0, 4096),
    st.sampled_from([0, 5, 6, 7, 8, 12, 99]),
)
def test_hostile_tensor_shapes_and_alpha_give_an_adapter_or_its_own_error(
    tensors: list[tuple[str, str, list[int], int]], data: int, alpha_kind: int
) -> None:
    alpha = {5: struct.pack("<i", 3), 6: struct.pack("<f", float("nan")), 12: struct.pack("<d", 1e300)}
    kvs = [*_ADAPTER_KVS[:3], _kv("adapter.lora.alpha", alpha_kind, alpha.get(alpha_kind, b"\1" * 8))]
    infos = [_tensor(name + suffix, dims, kind) for name, suffix, dims, kind in tensors]
    found = _read_bytes(_gguf(kvs, infos, data))
    assert not isinstance(found, BaseException) or isinstance(found, FitError), found


def test_a_well_formed_header_in_bytes_reads_its_rank() -> None:
    tensors = [
        _tensor("blk.0.attn_q.weight.lora_a", [64, 8]),
        _tensor("blk.0.attn_q.weight.lora_b", [8, 64], offset=64 * 8 * 4),
    ]
    header = adapter_header(_gguf(_ADAPTER_KVS, tensors, 2 * 64 * 8 * 4), Path("a.gguf"))
    assert (header.rank, header.alpha) == (8, 16.0)


def test_a_rank_past_the_bound_is_refused() -> None:
    n = 10_000
    tensors = [
        _tensor("w.lora_a", [1, n]),
        _tensor("w.lora_b", [n, 1], offset=n * 4),
    ]
    with pytest.raises(AdapterError, match="rank 10,000; llmgw serves ranks 1 to 8,192"):
        adapter_header(_gguf(_ADAPTER_KVS, tensors, 2 * n * 4), Path("a.gguf"))


def test_lora_a_and_b_of_different_ranks_are_refused() -> None:
    tensors = [_tensor("w.lora_a", [4, 2]), _tensor("w.lora_b", [3, 4], offset=32)]
    with pytest.raises(AdapterError, match="lora_a's rank 2 is not lora_b's 3"):
        adapter_header(_gguf(_ADAPTER_KVS, tensors, 96), Path("a.gguf"))
