"""The argument parser every `llmgw` command line is built with: a typo'd subcommand, choice
or flag is answered with the closest one it knows, and by the parser that was reading it (so
`llmgw ctl get nodes --watchh` prints `get`'s usage, not the top-level one)."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Sequence
from typing import Any

# What a shell reports for a process that a closed pipe ended (128 + SIGPIPE).
CLOSED_PIPE_EXIT = 141


class Parser(argparse.ArgumentParser):
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            # Said here, by the innermost parser that met them, rather than by the top-level
            # one after every subcommand has returned (argparse's own behaviour).
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._suggest_flag(extras)}")
        return parsed, extras

    def _suggest_flag(self, extras: list[str]) -> str:
        flags = [s for s in self._option_string_actions if s.startswith("--")]
        for extra in extras:
            if extra.startswith("-"):
                close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is not None and isinstance(value, str) and value not in choices:
            close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
            if close:
                listed = ", ".join(map(str, choices))
                raise argparse.ArgumentError(
                    action, f"invalid choice: {value!r} (did you mean {close[0]!r}? choose from {listed})"
                )
        super()._check_value(action, value)


def stdout_closed() -> int:
    """The exit after stdout's reader went away (`llmgw ctl get nodes | head`): quietly, as other
    command-line tools do. Stdout is pointed at /dev/null so that the interpreter's own flush at
    exit does not raise a second BrokenPipeError (the recipe of Python's `signal` documentation)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)
    return CLOSED_PIPE_EXIT
