"""Secrets in environments: which variables hold them, and how they are kept out of
logs, events, the API and `llmgw ctl`'s output.

A profile's `env` reaches an engine's environment as is (it is how an engine
gets `HF_TOKEN`); everywhere else its secret values read `***`. Text that may
quote them (an engine's last log lines in a failure reason) is scrubbed of
the values themselves.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

MASK = "***"

# fnmatch patterns on the upper-cased name.
SECRET_NAMES = ("*_TOKEN", "*_KEY", "*SECRET*", "*PASSWORD*", "HF_*")

# Shorter values are not scrubbed from text: "1" or "on" would blank out half a log line.
MIN_SCRUBBED_LENGTH = 4


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, pattern) for pattern in SECRET_NAMES)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment with every secret value replaced by `***`."""
    return {k: MASK if is_secret(k) else v for k, v in env.items()}


def secret_values(*envs: Mapping[str, str]) -> list[str]:
    """The values of secret variables, longest first (so a value inside another goes second)."""
    found = {v for env in envs for k, v in env.items() if is_secret(k) and len(v) >= MIN_SCRUBBED_LENGTH}
    return sorted(found, key=lambda v: (-len(v), v))


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of a secret value replaced by `***`."""
    for value in secrets:
        if value in text:
            text = text.replace(value, MASK)
    return text
