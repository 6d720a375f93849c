"""llmgw's version, from one place: the installed package's metadata (pyproject.toml's `version`),
shown by `llmgw --version`, `/healthz`, `llmgw_build_info` and traces' `service.version`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def llmgw_version() -> str:
    """The installed llmgw-core's version (every llmgw package is released with the same one)."""
    try:
        return version("llmgw-core")
    except PackageNotFoundError:
        return "unknown"
