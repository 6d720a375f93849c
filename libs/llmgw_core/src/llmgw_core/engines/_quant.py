"""Quantization methods and the GPU generation each needs.

Minimum compute capability per method, from vLLM's quantization configs
(`get_min_capability()` in vllm/model_executor/layers/quantization/*.py),
as capability x 10. fp8 is the W8A8 path (Ada/Hopper); the others are the
kernels vLLM selects for that method. SGLang uses the same method names and
kernels, so one table serves both. Methods not listed are not checked.
"""

from __future__ import annotations

MIN_CAPABILITY: dict[str, int] = {
    "fp8": 89,
    "awq": 75,
    "gptq": 60,
    "awq_marlin": 80,
    "gptq_marlin": 80,
    "gptq_marlin_24": 80,
    "marlin": 80,
    "bitsandbytes": 70,
    "compressed-tensors": 70,
}


def quantization_of(args: tuple[str, ...] | list[str]) -> str | None:
    """The method named by `--quantization X`, `--quantization=X` or `-q X`; the last one wins.

    The last, because that is the one the engine uses: vLLM and SGLang parse
    their command line with argparse, where a repeated option keeps its last
    value. Checking the first would pass a profile whose kernels the GPU lacks.
    """
    found: str | None = None
    it = iter(range(len(args)))
    for i in it:
        arg = args[i]
        if arg in ("--quantization", "-q") and i + 1 < len(args):
            found = args[i + 1]
            next(it, None)
        elif arg.startswith("--quantization="):
            found = arg.split("=", 1)[1]
    return found


def parse_capability(text: str) -> int | None:
    """`"8.9"` -> 89; anything unparseable (`"[N/A]"`, `""`) -> None."""
    major, dot, minor = text.strip().partition(".")
    if not dot or not major.isdigit() or not minor.isdigit():
        return None
    return int(major) * 10 + int(minor)


def format_capability(value: int) -> str:
    return f"{value // 10}.{value % 10}"
