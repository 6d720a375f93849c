"""The simulator's answers: words that are a function of the prompt and their place in the
answer alone, so that an answer continued on another simulator (a gateway continuing an answer
broken off) goes on with the words an unbroken one would have given."""

from __future__ import annotations

import hashlib

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "llamas",
    "graze",
    "on",
    "green",
    "hills",
    "and",
    "engines",
    "hum",
    "in",
    "racks",
    "of",
    "gpus",
]


def _tokens(prompt: str, n: int, start: int = 0) -> list[str]:
    """Deterministic output: word k of the answer to a prompt is a function of the prompt and
    k alone, so an answer continued from its first `start` words (`_continued`) goes on with
    the words an unbroken answer would have given."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return [WORDS[(seed + i * 7) % len(WORDS)] for i in range(start, start + n)]


def _text(words: list[str], start: int) -> str:
    """Words `start`… of an answer as its text: a space before each but the answer's first."""
    return "".join(w if start + i == 0 else " " + w for i, w in enumerate(words))


# A continued completion's prompt is searched for its own earlier answer this far back, in words.
CONTINUED_WORDS_MAX = 4096
_WORD_SET = frozenset(WORDS)


def _continued(prompt: str) -> tuple[str, int]:
    """A completion prompt that ends with the simulator's own answer to an earlier prompt (a
    gateway continuing an answer broken off): that earlier prompt and the words of its answer
    already given; else `(prompt, 0)`."""
    tail = prompt.split(" ")
    found = (prompt, 0)
    for k in range(1, min(len(tail), CONTINUED_WORDS_MAX) + 1):
        token = tail[-k]
        rest = " ".join(tail[len(tail) - k + 1 :])
        # The answer's first word may follow the earlier prompt with no space between.
        for word in (w for w in WORDS if token.endswith(w)):
            text = word + (" " + rest if rest else "")
            base = prompt[: len(prompt) - len(text)]
            # Its last word first: the whole text is compared only where that one is right.
            last = text.rpartition(" ")[2]
            if _tokens(base, 1, k - 1) == [last] and _text(_tokens(base, k), 0) == text:
                found = (base, k)
        if token not in _WORD_SET:
            break
    return found
