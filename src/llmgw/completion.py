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
    # A flag that takes a free value (a file, a name): nothing offered, so bash offers file names.
    value_flags: list[str] = field(default_factory=list)


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
            elif action.nargs != 0:
                level.value_flags += action.option_strings
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
        if level.value_flags:
            cases = " | ".join(f'"{path}:{flag}"' for flag in level.value_flags)
            choice_cases.append(f"        {cases}) COMPREPLY=(); return 0 ;;")
        flags = [w for w in level.words if w.startswith("-")]
        others = [w for w in level.words if not w.startswith("-")]
        word_cases.append(f'        "{path}") words="{_words(others)}" flags="{_words(flags)}" ;;')
    fn = f"_{prog.replace('-', '_')}"
    return "\n".join(
        [
            f'# {prog} completion for bash: eval "$({prog} completion bash)"',
            f"{fn}() {{",
            '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
            '    local path="" next words="" flags="" i',
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
            "        # Flags once a word starts with '-', as git's and kubectl's completions offer them.",
            '        if [[ "$cur" == -* || -z "$words" ]]; then words="$flags"; fi',
            "    fi",
            '    COMPREPLY=($(compgen -W "$words" -- "$cur"))',
            "}",
            # -o default: where nothing is offered (a flag's file or value), bash offers file names.
            f"complete -o default -F {fn} {prog}",
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
