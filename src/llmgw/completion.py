"""`llmgw completion bash|zsh`: a static completion script, generated from the command line's
own parser (every subcommand, flag and fixed choice it knows), so it never drifts from it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

SHELLS = ("bash", "zsh")


@dataclass
class Level:
    """What may follow one command path (`""`, `"ctl"`, `"ctl get"`)."""

    words: list[str] = field(default_factory=list)
    # A flag that takes one of fixed choices: the choices, completed after it.
    flag_choices: dict[str, list[str]] = field(default_factory=dict)


def levels(parser: argparse.ArgumentParser, path: str = "") -> dict[str, Level]:
    """Every command path of `parser` and what may follow it, in the parser's own order."""
    level = Level()
    found = {path: level}
    subcommands: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            # Every name a subcommand answers to (aliases included), then what each one takes.
            for name, sub in action.choices.items():
                level.words.append(name)
                subcommands.append((name, sub))
        elif action.option_strings:
            if action.help == argparse.SUPPRESS:
                continue
            level.words += action.option_strings
            if action.choices is not None:
                for flag in action.option_strings:
                    level.flag_choices[flag] = [str(c) for c in action.choices]
        elif action.choices is not None:
            level.words += [str(c) for c in action.choices]
    for name, sub in subcommands:
        found |= levels(sub, f"{path} {name}".strip())
    return found


def _words(items: list[str]) -> str:
    return " ".join(dict.fromkeys(items))


def bash(parser: argparse.ArgumentParser) -> str:
    prog = parser.prog
    found = levels(parser)
    paths = " | ".join(f'"{p}"' for p in found if p)
    choice_cases = []
    word_cases = []
    for path, level in found.items():
        for flag, choices in level.flag_choices.items():
            choice_cases.append(f'        "{path}:{flag}") words="{_words(choices)}" ;;')
        word_cases.append(f'        "{path}") words="{_words(level.words)}" ;;')
    fn = f"_{prog.replace('-', '_')}"
    return "\n".join(
        [
            f'# {prog} completion for bash: eval "$({prog} completion bash)"',
            f"{fn}() {{",
            '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
            '    local path="" next words="" i',
            "    for ((i = 1; i < COMP_CWORD; i++)); do",
            '        next="${path:+$path }${COMP_WORDS[i]}"',
            '        case "$next" in',
            f'            {paths}) path="$next" ;;',
            "        esac",
            "    done",
            '    case "$path:$prev" in',
            *choice_cases,
            "    esac",
            '    if [ -z "$words" ]; then',
            '        case "$path" in',
            *("    " + c for c in word_cases),
            "        esac",
            "    fi",
            '    COMPREPLY=($(compgen -W "$words" -- "$cur"))',
            "}",
            f"complete -F {fn} {prog}",
            "",
        ]
    )


def zsh(parser: argparse.ArgumentParser) -> str:
    """zsh runs the bash script through its own bashcompinit."""
    return "\n".join(
        [
            f"#compdef {parser.prog}",
            f'# {parser.prog} completion for zsh: eval "$({parser.prog} completion zsh)"',
            "autoload -U +X compinit && compinit",
            "autoload -U +X bashcompinit && bashcompinit",
            bash(parser).split("\n", 1)[1],
        ]
    )


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    return bash(parser) if shell == "bash" else zsh(parser)
