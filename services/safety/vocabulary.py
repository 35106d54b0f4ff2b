"""The words and phrases prompt expansion may add: the shipped list
(``expansion_words.txt``) or an operator's file of the same form, by kind
(quality, lighting, composition...). Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

SHIPPED = Path(__file__).with_name("expansion_words.txt")
# What joins a prompt and the phrases added to it: a phrase never holds one.
SEPARATOR = ", "
_KIND = re.compile(r"\[([^\[\]]*)\]")
_WORD = re.compile(r"\w+")


def words_of(text: str) -> frozenset[str]:
    """The words of ``text``, lower-cased: what tells whether a prompt already has a phrase."""
    return frozenset(_WORD.findall(text.lower()))


@dataclass(frozen=True)
class Vocabulary:
    """Phrases by kind, in the file's order; each phrase once, lower-case, its
    words separated by single spaces."""

    kinds: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def shipped(cls) -> Vocabulary:
        return cls.load(SHIPPED)

    @classmethod
    def load(cls, path: Path) -> Vocabulary:
        """``path``'s phrases; ValueError naming the file (and line) that cannot be used."""
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"expansion vocabulary {path}: {exc}") from None
        try:
            return cls.parse(text)
        except ValueError as exc:
            raise ValueError(f"expansion vocabulary {path}: {exc}") from None

    @classmethod
    def parse(cls, text: str) -> Vocabulary:
        """One phrase a line; ``[kind]`` starts a kind (phrases before any: kind
        ""); ``#`` starts a comment."""
        kinds: dict[str, list[str]] = {}
        seen: set[str] = set()
        kind = ""
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            header = _KIND.fullmatch(line)
            if header:
                kind = header[1].strip()
                continue
            phrase = " ".join(line.lower().split())
            if "," in phrase:
                raise ValueError(f"line {number}: {phrase!r} holds a comma, which separates phrases")
            if not words_of(phrase):
                raise ValueError(f"line {number}: {phrase!r} has no word")
            if phrase not in seen:
                seen.add(phrase)
                kinds.setdefault(kind, []).append(phrase)
        if not seen:
            raise ValueError("no phrases")
        return cls(tuple((k, tuple(phrases)) for k, phrases in kinds.items()))

    @cached_property
    def phrases(self) -> tuple[str, ...]:
        return tuple(p for _, phrases in self.kinds for p in phrases)

    @cached_property
    def words(self) -> frozenset[str]:
        """Every word of every phrase: all that an expander may add."""
        return frozenset(w for p in self.phrases for w in words_of(p))


def expanded_text(prompt: str, phrases: list[str]) -> str:
    """The prompt with ``phrases`` added: the prompt as written (less trailing commas
    and spaces), then each phrase after a comma; the prompt itself without any."""
    if not phrases:
        return prompt
    base = prompt.rstrip(" \t\r\n,")
    return SEPARATOR.join([base, *phrases]) if base else SEPARATOR.join(phrases)
