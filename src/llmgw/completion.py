"""`llmgw completion bash|zsh`: a completion script generated from the command line's own parser
(every subcommand, flag and fixed choice it knows), so it never drifts from it.

Where a name goes (`llmgw ctl get nodes <TAB>`, `describe deployment <TAB>`, `cordon <TAB>`,
`deploy … --profile <TAB>`), the script asks the cluster: `llmgw ctl get KIND -o name` with the
connection flags of the line being completed. An argument says which names go there with
`completes` (set by `ctl._args.names`): a kind, or `@KIND`, the kind its KIND argument named."""

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
    # A flag whose value is the name of an object of a kind: the kind.
    flag_names: dict[str, str] = field(default_factory=dict)
    # Every flag here that takes a value, those not offered included: what follows one is its
    # value, never an argument.
    valued: list[str] = field(default_factory=list)
    # The arguments in order, each `=w1 w2` (one of fixed words), `:kind` (a name of that
    # kind), `@N` (a name of the kind argument N named), or "" (anything: bash offers files).
    positionals: list[str] = field(default_factory=list)


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
            if action.nargs != 0:
                level.valued += action.option_strings
            if action.help == argparse.SUPPRESS:
                continue
            level.words += action.option_strings
            completes = getattr(action, "completes", "")
            if action.choices is not None:
                for flag in action.option_strings:
                    level.flag_choices[flag] = [str(c) for c in action.choices]
            elif completes:
                for flag in action.option_strings:
                    level.flag_names[flag] = completes
            elif action.nargs != 0:
                level.value_flags += action.option_strings
        elif action.choices is not None:
            level.positionals.append("=" + _words([str(c) for c in action.choices]))
        else:
            completes = getattr(action, "completes", "")
            if completes == "@KIND":
                # The kind is the argument before it that took one of fixed words.
                kind = max(i for i, p in enumerate(level.positionals) if p.startswith("="))
                level.positionals.append(f"@{kind}")
            else:
                level.positionals.append(f":{completes}" if completes else "")
    for name, sub in subcommands:
        found |= levels(sub, f"{path} {name}".strip())
    return found


def _words(items: list[str]) -> str:
    return " ".join(dict.fromkeys(items))


# The connection flags of `llmgw ctl`, passed on to the `get KIND -o name` that lists names.
CONNECTION_PATH = "ctl"


def bash(parser: argparse.ArgumentParser) -> str:
    prog = parser.prog
    found = levels(parser)
    paths = " | ".join(f'"{p}"' for p in found if p)
    connection = found.get(CONNECTION_PATH, Level())
    conn_valued = [f for f in connection.valued if f.startswith("--") and f != "--version"]
    conn_flags = [*conn_valued, *(f for f in connection.words if f == "--insecure")]
    choice_cases = []
    word_cases = []
    for path, level in found.items():
        for flag, choices in level.flag_choices.items():
            choice_cases.append(f'        "{path}:{flag}") words="{_words(choices)}"; took=1 ;;')
        for flag, kind in level.flag_names.items():
            choice_cases.append(f'        "{path}:{flag}") words="$({fn_names(prog)} {kind})"; took=1 ;;')
        if level.value_flags:
            cases = " | ".join(f'"{path}:{flag}"' for flag in level.value_flags)
            choice_cases.append(f"        {cases}) COMPREPLY=(); return 0 ;;")
        flags = [w for w in level.words if w.startswith("-")]
        others = [w for w in level.words if not w.startswith("-")]
        specs = " ".join(f'"{p}"' for p in level.positionals)
        word_cases.append(
            f'        "{path}") words="{_words(others)}" flags="{_words(flags)}" '
            f'valued="{_words(level.valued)}" specs=({specs}) ;;'
        )
    fn = f"_{prog.replace('-', '_')}"
    return "\n".join(
        [
            f'# {prog} completion for bash: eval "$({prog} completion bash)"',
            f"{fn_names(prog)}() {{",
            "    # The names of objects of a kind, as the cluster on the line holds them (none when",
            "    # it cannot be reached: bash then offers nothing rather than a wrong word).",
            "    local line",
            f'    "${{COMP_WORDS[0]}}" {CONNECTION_PATH} "${{conn[@]}}" get "$1" -o name 2>/dev/null |',
            '        while IFS= read -r line; do printf "%s\\n" "${line#*/}"; done',
            "}",
            f"{fn}() {{",
            '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
            '    local path="" next words="" flags="" valued="" start=1 skip=0 took=0 i w spec',
            "    local -a specs=() given=() conn=()",
            "    for ((i = 1; i < COMP_CWORD; i++)); do",
            '        next="${path:+$path }${COMP_WORDS[i]}"',
            '        case "$next" in',
            f'            {paths}) path="$next"; start=$((i + 1)) ;;',
            "        esac",
            "    done",
            "    # The connection flags on the line, passed on when names are asked of the cluster.",
            "    for ((i = 1; i < COMP_CWORD; i++)); do",
            '        w="${COMP_WORDS[i]}"',
            f'        if [[ " {" ".join(conn_valued)} " == *" $w "* ]]; then',
            '            conn+=("$w" "${COMP_WORDS[i+1]}")',
            "            ((i++))",
            f'        elif [[ " {" ".join(conn_flags)} " == *" $w "* ]]; then',
            '            conn+=("$w")',
            "        fi",
            "    done",
            '    case "$path" in',
            *word_cases,
            "    esac",
            "    # The value of the flag before the cursor.",
            '    case "$path:$prev" in',
            *choice_cases,
            "    esac",
            "    if ((!took)); then",
            "        # Flags once a word starts with '-', as git's and kubectl's completions offer them;",
            "        # else a subcommand, or the next argument (flags and their values skipped): one of",
            "        # fixed words (a kind), or a name (of the kind before it), asked of the cluster.",
            "        if ((${#specs[@]})); then",
            "            for ((i = start; i < COMP_CWORD; i++)); do",
            '                w="${COMP_WORDS[i]}"',
            "                if ((skip)); then skip=0; continue; fi",
            '                case "$w" in',
            '                    -*) [[ " $valued " == *" $w "* ]] && skip=1 ;;',
            '                    *) given+=("$w") ;;',
            "                esac",
            "            done",
            '            spec="${specs[${#given[@]}]-}"',
            '            case "$spec" in',
            '                =*) words="${spec#=}" ;;',
            f'                :*) words="$({fn_names(prog)} "${{spec#:}}")" ;;',
            f'                @*) words="$({fn_names(prog)} "${{given[${{spec#@}}]}}")" ;;',
            '                *) words="" ;;',
            "            esac",
            '            if [[ "$cur" == -* || ( -z "$words" && ${#given[@]} -ge ${#specs[@]} ) ]]; then',
            '                words="$flags"',
            "            fi",
            '        elif [[ "$cur" == -* || -z "$words" ]]; then',
            '            words="$flags"',
            "        fi",
            "    fi",
            '    COMPREPLY=($(compgen -W "$words" -- "$cur"))',
            "}",
            # -o default: where nothing is offered (a flag's file or value), bash offers file names.
            f"complete -o default -F {fn} {prog}",
            "",
        ]
    )


def fn_names(prog: str) -> str:
    return f"_{prog.replace('-', '_')}_names"


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
