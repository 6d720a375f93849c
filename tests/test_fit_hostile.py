"""Model headers from outside (a hub's, a peer's, a node's report of a shape) read within bounds.

Every count, dimension, offset and length in a GGUF or safetensors header is checked against
the file's size and a `ModelShape`'s bounds before use: a hostile header costs a `HeaderError`
naming what is wrong, read in bounded memory and time, never another exception. A shape whose
figures are impossible does not decode, and one built in memory is refused by the estimate."""

from __future__ import annotations

import json
import os
import struct
import tempfile
import time
import tracemalloc
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core import fit
from llmgw_core.engines import GPUInfo, Profile
from llmgw_core.events import MODEL_MAX_BYTES, ModelShape, NodeStatus
from llmgw_core.fit import FitError, HeaderError, check_shard, estimate, figure, read_shape, shape_problem
from tests.tiny_model import write_tiny_llama

MiB = 1024**2

# ---- writing GGUF headers by hand ----


def gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def kv_str(key: str, value: bytes) -> bytes:
    return gstr(key.encode()) + struct.pack("<I", 8) + gstr(value)


def kv_u32(key: str, value: int) -> bytes:
    return gstr(key.encode()) + struct.pack("<II", 4, value)


def tensor_info(name: str, dims: list[int], kind: int = 0, offset: int = 0) -> bytes:
    return (
        gstr(name.encode())
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + (struct.pack("<IQ", kind, offset))
    )


def gguf(kvs: list[bytes], tensors: list[bytes] = (), data: int = 0, n_kv: int | None = None) -> bytes:  # type: ignore[assignment]
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * (-len(body) % 32)
    return body + b"\0" * data


LLAMA_KVS = [
    kv_str("general.architecture", b"llama"),
    kv_u32("llama.embedding_length", 64),
    kv_u32("llama.attention.head_count", 4),
    kv_u32("llama.block_count", 2),
    kv_u32("llama.context_length", 512),
]


def test_a_hand_written_gguf_reads_as_the_package_writes_it(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf(LLAMA_KVS, [tensor_info("w", [64, 2])], data=512))
    shape = read_shape(path)
    assert (shape.weight_bytes, shape.n_layer, shape.n_head_kv, shape.head_dim_k, shape.context_length) == (
        512,
        2,
        4,
        16,
        512,
    )


def peak_mib(call: object) -> tuple[float, float, BaseException | None]:
    """What `call` costs: its peak of Python memory (MiB), its seconds, and what it raised."""
    tracemalloc.start()
    started = time.perf_counter()
    raised: BaseException | None = None
    try:
        call()  # type: ignore[operator]
    except Exception as exc:
        raised = exc
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] / MiB
    tracemalloc.stop()
    return peak, seconds, raised


def test_a_gguf_architecture_of_256_mib_is_refused_unread(tmp_path: Path) -> None:
    # Read through the `gguf` package, this header cost 1.9 GB of memory and one log line of
    # 268 million characters. The file is as long as the string says (a sparse file).
    path = tmp_path / "evil.gguf"
    n = 256 * MiB
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gstr(b"general.architecture") + struct.pack("<IQ", 8, n)
    with path.open("wb") as f:
        f.write(head)
        f.truncate(len(head) + n)
    peak, seconds, raised = peak_mib(lambda: read_shape(path))
    assert isinstance(raised, HeaderError)
    assert str(raised) == (
        f"{path}: GGUF header: general.architecture is 268,435,456 bytes long; "
        "an architecture's name is at most 64"
    )
    assert peak < 8, peak
    assert seconds < 2, seconds


def test_a_gguf_array_count_of_2_62_is_refused_before_any_loop(tmp_path: Path) -> None:
    path = tmp_path / "evil.gguf"
    strings = gstr(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**62)
    path.write_bytes(gguf([*LLAMA_KVS, strings], data=64))
    peak, seconds, raised = peak_mib(lambda: read_shape(path))
    assert isinstance(raised, HeaderError)
    assert str(raised) == (
        f"{path}: GGUF header: 'tokenizer.ggml.tokens' has 4,611,686,018,427,387,904 elements, "
        f"more than the file's {path.stat().st_size:,} bytes hold"
    )
    assert peak < 8, peak
    assert seconds < 2, seconds
    fixed = gstr(b"tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 2**62)
    path.write_bytes(gguf([*LLAMA_KVS, fixed], data=64))
    with pytest.raises(HeaderError, match="runs past the file's"):
        read_shape(path)


def test_huge_gguf_dimensions_and_offsets_are_refused_with_the_figures(tmp_path: Path) -> None:
    # ggml has 4 dimensions at most; 3,000 of them (each 2**63) made the stage never end.
    path = tmp_path / "evil.gguf"
    path.write_bytes(gguf(LLAMA_KVS, [tensor_info("w", [2**63] * 3000)]))
    with pytest.raises(HeaderError) as e:
        read_shape(path)
    assert str(e.value) == f"{path}: GGUF header: tensor 'w' has 3,000 dimensions; ggml has at most 4"
    path.write_bytes(gguf(LLAMA_KVS, [tensor_info("w", [2**40, 2**40])]))
    with pytest.raises(HeaderError) as e:
        read_shape(path)
    assert str(e.value) == f"{path}: GGUF header: tensor 'w' has more than 1,125,899,906,842,624 elements"
    # A tensor whose data lies past the file's end.
    path.write_bytes(gguf(LLAMA_KVS, [tensor_info("w", [64], offset=2**60)], data=256))
    with pytest.raises(HeaderError) as e:
        read_shape(path)
    assert str(e.value) == (
        f"{path}: GGUF header: tensor data runs to 1,152,921,504,606,847,232 bytes past the header, "
        "past the 256 bytes the file holds there"
    )
    # Tensors that overlap to claim more than the file holds.
    path.write_bytes(gguf(LLAMA_KVS, [tensor_info(f"w{i}", [64]) for i in range(4)], data=256))
    with pytest.raises(HeaderError, match="tensors of 1,024 bytes in all, more than the file's 256"):
        read_shape(path)


def test_gguf_counts_out_of_bounds_and_of_the_wrong_type_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.gguf"
    big = gstr(b"llama.block_count") + struct.pack("<IQ", 10, 2**63)
    path.write_bytes(gguf([*LLAMA_KVS[:3], big, LLAMA_KVS[4]], data=0))
    with pytest.raises(HeaderError) as e:
        read_shape(path)
    assert (
        str(e.value)
        == f"{path}: GGUF header: llama.block_count 9,223,372,036,854,775,808 is outside 0 to 4,294,967,296"
    )
    neg = gstr(b"llama.block_count") + struct.pack("<Iq", 11, -5)
    path.write_bytes(gguf([*LLAMA_KVS[:3], neg, LLAMA_KVS[4]]))
    with pytest.raises(HeaderError, match=r"llama\.block_count -5 is outside"):
        read_shape(path)
    text = gstr(b"llama.block_count") + struct.pack("<I", 8) + gstr(b"two")
    path.write_bytes(gguf([*LLAMA_KVS[:3], text, LLAMA_KVS[4]]))
    with pytest.raises(HeaderError, match=r"'llama\.block_count' is not an integer"):
        read_shape(path)
    # A per-layer count is an array of one value per layer: the cache is sized by the largest.
    layers = (
        gstr(b"llama.attention.head_count_kv") + struct.pack("<IIQ", 9, 4, 3) + struct.pack("<3I", 1, 8, 2)
    )
    path.write_bytes(gguf([*LLAMA_KVS, layers]))
    assert read_shape(path).n_head_kv == 8


def test_a_safetensors_offset_of_10_400_is_refused_in_words_not_overflowed(tmp_path: Path) -> None:
    # Read before, its 10**400 bytes became the model's weight and overflowed the estimate
    # (OverflowError), which failed placement's whole step.
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    )
    raw = b'{"w":{"dtype":"I8","shape":[2],"data_offsets":[0,1' + b"0" * 400 + b"]}}"
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4096)
    with pytest.raises(HeaderError) as e:
        read_shape(tmp_path)
    assert str(e.value) == (
        f"{path}: safetensors header: tensor 'w': data_offsets end 10**400 "
        "past the file's 4,096 bytes of data"
    )
    # Negative and impossible dimensions; a tensor whose bytes disagree with its shape.
    for tensor, words in [
        ({"dtype": "I8", "shape": [-1], "data_offsets": [0, 1]}, "tensor 'w': a dimension of -1"),
        (
            {"dtype": "I8", "shape": [2**40, 2**40], "data_offsets": [0, 1]},
            "tensor 'w': more than 1,125,899,906,842,624 elements",
        ),
        (
            {"dtype": "F16", "shape": [4], "data_offsets": [0, 4]},
            "4 elements of F16 are 8 bytes, its data_offsets hold 4",
        ),
        ({"dtype": "I8", "shape": [2], "data_offsets": [8, 2]}, "data_offsets [8, 2]"),
    ]:
        raw = json.dumps({"w": tensor}).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4096)
        with pytest.raises(HeaderError, match=words.replace("[", r"\[").replace("]", r"\]")):
            read_shape(tmp_path)


def test_a_safetensors_header_past_the_file_or_nested_too_deep_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    )
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(FitError) as e:
        read_shape(tmp_path)
    assert str(e.value) == f"{path}: header length 1,000 runs past the file's 10 bytes"
    assert not isinstance(e.value, HeaderError), "not taken for a safetensors file: no header to refuse"
    deep = b'{"w":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path.write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(HeaderError):
        read_shape(tmp_path)
    # Many tiny entries are counted before any is decoded.
    many = b"{" + b",".join(b'"%d":{}' % i for i in range(200_000)) + b"}"
    path.write_bytes(struct.pack("<Q", len(many)) + many)
    peak, _seconds, raised = peak_mib(lambda: read_shape(tmp_path))
    assert isinstance(raised, HeaderError)
    assert "more than 131,072 tensors" in str(raised)
    assert peak < 16, peak
    # A config.json nested too deep is not a config.
    path.write_bytes(struct.pack("<Q", 2) + b"{}")
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FitError, match="nests too deep"):
        read_shape(tmp_path)


def test_an_index_naming_a_file_outside_the_directory_is_refused_unopened(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    )
    for name in ("../../etc/passwd", "/dev/zero", ".."):
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
        with pytest.raises(HeaderError) as e:
            read_shape(tmp_path)
        assert str(e.value) == (
            f"{tmp_path}/model.safetensors.index.json: weight_map names {name!r}, not a file of {tmp_path}"
        )


def test_a_file_of_another_kind_under_a_models_name_is_no_header_error(tmp_path: Path) -> None:
    # Not a model llmgw can size (started unchecked, as before), but no hostile header either.
    path = tmp_path / "notes.gguf"
    path.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(FitError) as e:
        read_shape(path)
    assert str(e.value) == f"{path}: no GGUF magic; not a GGUF file"
    assert not isinstance(e.value, HeaderError)
    # With the magic, the rest is a header that must keep its format's rules.
    path.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    with pytest.raises(HeaderError, match="version"):
        read_shape(path)


def test_a_fifo_under_a_models_name_is_refused_not_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "m.gguf")
    with pytest.raises(FitError) as e:
        read_shape(tmp_path / "m.gguf")
    assert str(e.value) == f"{tmp_path}/m.gguf: not a regular file"


# ---- shapes on the wire and in memory ----

SHAPE = {
    "format": "gguf",
    "weight_bytes": 433920,
    "n_layer": 2,
    "n_head_kv": 2,
    "head_dim_k": 16,
    "head_dim_v": 16,
    "context_length": 512,
}


def test_a_shape_with_impossible_figures_does_not_decode_and_says_where() -> None:
    for field, value in [
        ("weight_bytes", 10**400),
        ("n_layer", -1),
        ("n_head_kv", 2**64),
        ("float_params", -(10**15)),
    ]:
        raw = msgspec.json.encode({**SHAPE, field: value})
        with pytest.raises(msgspec.ValidationError, match=rf"at `\$.{field}`"):
            msgspec.json.decode(raw, type=ModelShape)
    # A node status carrying one does not decode: placement keeps the node's last good value.
    status = {
        "node": "n1",
        "facts": {"node": "n1", "shapes": {"hf://evil/bomb@main": {**SHAPE, "weight_bytes": 10**400}}},
    }
    with pytest.raises(msgspec.ValidationError) as e:
        msgspec.json.decode(msgspec.json.encode({"kind": "NodeStatus", **status}), type=NodeStatus)
    assert str(e.value) == ("Expected `int` <= 1125899906842624 - at `$.facts.shapes[...].weight_bytes`")


def profile(engine: str = "llamacpp", *args: str, **kw: object) -> Profile:
    return msgspec.convert(
        {"name": "p", "engine": engine, "model_path": "/m", "args": list(args), **kw}, Profile
    )


def test_a_shape_built_with_impossible_figures_is_refused_by_the_estimate_in_words() -> None:
    # Weights of -10**15 bytes fit any GPU; 10**400 overflowed every float.
    for field, value, words in [
        ("weight_bytes", 10**400, "weight_bytes 10**400 is outside 0 to 1,125,899,906,842,624"),
        (
            "weight_bytes",
            -(10**15),
            "weight_bytes -1,000,000,000,000,000 is outside 0 to 1,125,899,906,842,624",
        ),
        ("n_layer", 2**64, "n_layer 18,446,744,073,709,551,616 is outside 0 to 1,048,576"),
    ]:
        shape = msgspec.structs.replace(ModelShape(**SHAPE), **{field: value})  # type: ignore[arg-type]
        assert shape_problem(shape) == words
        with pytest.raises(FitError) as e:
            check_shard(
                shape, profile(gpu_class="L40S-48G"), [GPUInfo(index=0, name="L40S", memory_mb=46068)]
            )
        assert str(e.value) == f"the model's shape cannot be used: {words}"
    # A profile's context of 1e400 tokens, a GPU or host reporting 10**400 MB: words, not OverflowError.
    ok = ModelShape(**SHAPE)  # type: ignore[arg-type]
    assert fit.profile_context(profile("vllm", "--max-model-len", "1e400"), ok) == 512
    with pytest.raises(FitError, match=r"a context of over 10\*\*308 tokens is past 4,294,967,296"):
        estimate(ok, profile("vllm", "--max-model-len", "1e308"))
    with pytest.raises(FitError, match=r"GPU 0 reports 10\*\*400 MB of memory"):
        check_shard(ok, profile(gpu_class="L40S-48G"), [GPUInfo(index=0, name="L40S", memory_mb=10**400)])
    with pytest.raises(FitError, match=r"the node reports 10\*\*400 MB of memory"):
        check_shard(ok, profile(), memory_mb=10**400)


def test_a_big_number_is_quoted_in_a_few_characters() -> None:
    assert [figure(n) for n in (4104, 10**400, 10**400 + 1, -(10**30), 10**21 - 1)] == [
        "4,104",
        "10**400",
        "over 10**400",
        "-10**30",
        "999,999,999,999,999,999,999",
    ]
    assert len(figure(10**4000)) < 20


# ---- fuzzing: arbitrary and mutated headers give a bounded shape or FitError, nothing else ----


def _tiny_gguf() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return write_tiny_llama(Path(d) / "m.gguf", n_layer=1, n_embd=32, n_head=2).read_bytes()


TINY_GGUF = _tiny_gguf()
TINY_HEADER_END = TINY_GGUF.index(b"blk.0") + 400  # the key-value pairs and tensor infos, about


def gguf_shape(buf: bytes) -> ModelShape:
    where = Path("fuzz.gguf")
    walk = fit.read_gguf_header(buf, where)
    return fit._gguf_shape(walk, where, walk.weight_bytes)


def within_bounds_or_fit_error(read: object) -> None:
    try:
        shape = read()  # type: ignore[operator]
    except FitError as exc:
        said = str(exc)
    else:
        assert isinstance(shape, ModelShape)
        assert shape_problem(shape) is None
        msgspec.json.decode(msgspec.json.encode(shape), type=ModelShape)  # decodes within its bounds
        return
    assert len(said) < 600, said[:200]


FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_as_a_gguf_give_fit_error_or_a_bounded_shape(data: bytes) -> None:
    within_bounds_or_fit_error(lambda: gguf_shape(data))
    within_bounds_or_fit_error(lambda: gguf_shape(b"GGUF\x03\0\0\0" + data))


@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(0, TINY_HEADER_END - 1), st.binary(min_size=1, max_size=8)),
        min_size=1,
        max_size=6,
    ),
    st.integers(24, len(TINY_GGUF)),
)
def test_a_mutated_gguf_header_gives_fit_error_or_a_bounded_shape(
    edits: list[tuple[int, bytes]], keep: int
) -> None:
    buf = bytearray(TINY_GGUF)
    for at, chunk in edits:
        buf[at : at + len(chunk)] = chunk
    within_bounds_or_fit_error(lambda: gguf_shape(bytes(buf)))
    within_bounds_or_fit_error(lambda: gguf_shape(bytes(buf[:keep])))


CONFIG = json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}).encode()
HEADER = json.dumps(
    {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 32]},
        "b": {"dtype": "I8", "shape": [8], "data_offsets": [32, 40]},
    }
).encode()

ints = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2**63, 2**64, 10**400, -1]))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
tensors = st.dictionaries(
    st.text(max_size=8),
    st.one_of(
        json_values,
        st.fixed_dictionaries(
            {
                "dtype": st.sampled_from(["F16", "I8", "BF16", "F32", "X", ""]),
                "shape": st.lists(ints, max_size=4),
            },
            optional={"data_offsets": st.lists(ints, min_size=0, max_size=3)},
        ),
    ),
    max_size=4,
)


def safetensors_shape(
    header: bytes, length: int | None = None, data: int = 64, config: bytes = CONFIG
) -> object:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "config.json").write_bytes(config)
        n = len(header) if length is None else length
        (root / "model.safetensors").write_bytes(struct.pack("<Q", n) + header + b"\0" * data)
        return read_shape(root)


@FUZZ
@given(tensors, st.integers(0, 128))
def test_arbitrary_safetensors_headers_give_fit_error_or_a_bounded_shape(header: object, data: int) -> None:
    within_bounds_or_fit_error(lambda: safetensors_shape(json.dumps(header).encode(), data=data))


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, len(HEADER) - 1), st.binary(min_size=1, max_size=4)), max_size=4),
    st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    st.dictionaries(
        st.sampled_from(
            [
                "num_hidden_layers",
                "num_attention_heads",
                "hidden_size",
                "head_dim",
                "max_position_embeddings",
                "torch_dtype",
                "text_config",
            ]
        ),
        json_values,
    ),
)
def test_a_mutated_safetensors_header_and_config_give_fit_error_or_a_bounded_shape(
    edits: list[tuple[int, bytes]], length: int | None, config: dict[str, object]
) -> None:
    buf = bytearray(HEADER)
    for at, chunk in edits:
        buf[at : at + len(chunk)] = chunk
    cfg = json.dumps({**json.loads(CONFIG), **config}).encode()
    within_bounds_or_fit_error(lambda: safetensors_shape(bytes(buf), length, config=cfg))


@FUZZ
@given(st.dictionaries(st.sampled_from([*SHAPE, "float_params", "other_bytes", "dtype"]), json_values))
def test_decoding_a_shape_gives_one_within_bounds_or_a_decode_error(fields: dict[str, object]) -> None:
    try:
        raw = msgspec.json.encode({**SHAPE, **fields})
    except (TypeError, OverflowError, ValueError):
        return
    try:
        shape = msgspec.json.decode(raw, type=ModelShape)
    except msgspec.DecodeError:
        return
    assert shape_problem(shape) is None
    est = estimate(shape, profile("vllm", tp=2))
    assert 0 <= est.per_gpu <= MODEL_MAX_BYTES * 2**34


def test_a_gguf_that_shrinks_while_its_header_is_read_is_a_header_error(tmp_path: Path) -> None:
    # Read through a window, never mapped: a mapping of a file truncated under it (a model copied
    # over while the probe reads it) kills the reader with SIGBUS.
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf(LLAMA_KVS, [tensor_info("w", [64, 2])], data=512))
    size = path.stat().st_size
    with path.open("rb") as f:
        window = fit._Window(f.fileno(), size, path)
        path.write_bytes(b"GGUF")  # truncated to 4 bytes under the open file
        with pytest.raises(HeaderError) as e:
            fit.read_gguf_header(window, path)
    assert str(e.value) == f"{path}: the file changed while its header was read (at byte 4)"


@pytest.mark.parametrize("window", [8, 13, 64, 4096])
def test_a_header_read_through_any_window_reads_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    # Strings of a vocabulary cross the window's edges at every place: the walk reads the same.
    path = tmp_path / "m.gguf"
    path.write_bytes(TINY_GGUF)
    whole = gguf_shape(TINY_GGUF)
    monkeypatch.setattr(fit, "_WINDOW", window)
    assert read_shape(path) == whole
    # And a vocabulary cut short is refused the same through any window.
    cut = TINY_GGUF[: TINY_GGUF.index("▁ready".encode()) + 2]
    path.write_bytes(cut)
    with pytest.raises(HeaderError, match=r"a string in 'tokenizer\.ggml\.tokens'.* runs past the file's"):
        read_shape(path)
