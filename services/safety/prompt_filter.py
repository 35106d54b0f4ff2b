"""The prompt filter: whether a prompt holds a word or phrase of the list, and of
which category ("profanity": any of the list; "sexual": one of its sexual
subset). Pure and fast (tens of microseconds for a short prompt): the gateway
runs it on every submit's prompt, on the event loop.

The list is better-profanity's shipped file (MIT), read as a file (its own API
keeps global state and is slow), less the ordinary words ``prompt_words.EXCLUDED``
names, with ``prompt_words.ADDED``, and the operator's own file. A verdict never
says which word matched.

Text and list are compared after the same normalisation (``services.safety.prompt_text``).
Words are matched whole, phrases word by word: "Scunthorpe", "class", "cockpit",
"therapist" and "grape" hold listed words and are not refused."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.config.fields import SettingsError
from services.config.safety import SafetySettings
from services.safety.prompt_text import (
    ASCII_SPELLED,
    ASCII_WORD,
    LEET,
    MAX_SPELLED,
    NOT_WORD,
    RUN,
    SPELLED,
    WORD,
    normalised,
    readings,
    stem,
    words_of,
)
from services.safety.prompt_words import ADDED, EXCLUDED, SEXUAL

PROFANITY, SEXUAL_CATEGORY = "profanity", "sexual"
# Every category a verdict may hold, as moderation results name them.
CATEGORIES = (PROFANITY, SEXUAL_CATEGORY)
_SECTION = re.compile(r"\[(\w+)\]")

_END = ""  # a trie node's key for the categories of the word ending there

Categories = frozenset[str]


@dataclass(frozen=True)
class Verdict:
    """What the filter found: the categories of the words it matched, never the words."""

    categories: Categories = frozenset()

    @property
    def flagged(self) -> bool:
        return bool(self.categories)


PASSED = Verdict()


@dataclass(frozen=True)
class Entry:
    """One line of a list: its words, normalised, and its categories."""

    words: tuple[str, ...]
    categories: Categories
    spelled: bool  # written letter by letter ("s.o.b."): matched only where a prompt spells it out too

    @property
    def key(self) -> str:
        return "".join(self.words) if self.spelled else " ".join(self.words)


def entry_of(line: str, categories: Categories) -> Entry | None:
    """The entry a list's line holds (None for a blank line)."""
    words = words_of(line)
    if not words:
        return None
    spelled = len(words) > 1 and all(len(w) == 1 for w in words)
    return Entry(tuple(words), categories, spelled)


def shipped_list() -> Path:
    """better-profanity's word list, found without importing the package (its import
    loads the list into its own global state)."""
    spec = importlib.util.find_spec("better_profanity")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("better-profanity is not installed: its word list is the prompt filter's")
    return Path(spec.origin).with_name("profanity_wordlist.txt")


def shipped_entries() -> list[Entry]:
    """The shipped list less EXCLUDED, with ADDED; SEXUAL's words "sexual" too."""
    lines = [*shipped_list().read_text(encoding="utf-8").splitlines(), *ADDED]
    entries = []
    for line in lines:
        entry = entry_of(line, frozenset({PROFANITY}))
        if entry is None or entry.key in EXCLUDED:
            continue
        if entry.key in SEXUAL:
            entry = Entry(entry.words, frozenset({PROFANITY, SEXUAL_CATEGORY}), entry.spelled)
        entries.append(entry)
    return entries


def operator_entries(text: str, where: str = "the operator's list") -> list[Entry]:
    """An operator's list: one word or phrase per line, '#' starting a comment; a
    line ``[sexual]`` makes the lines after it sexual as well (``[profanity]``: back
    to the default). ValueError naming the line for any other section."""
    entries = []
    categories = frozenset({PROFANITY})
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        section = _SECTION.fullmatch(line)
        if section:
            name = section.group(1).lower()
            if name not in CATEGORIES:
                raise ValueError(f"{where}, line {number}: [{name}] is not one of {', '.join(CATEGORIES)}")
            categories = frozenset({PROFANITY, name})
            continue
        entry = entry_of(line, categories)
        if entry is not None:
            entries.append(entry)
    return entries


def from_settings(safety: SafetySettings) -> PromptFilter:
    """The shipped list, with the operator's file; SettingsError naming the variable
    for a file that cannot be read or holds an unknown section."""
    try:
        return PromptFilter.shipped(safety.prompt_filter_words)
    except (OSError, ValueError) as exc:
        variable = SafetySettings.setting("prompt_filter_words").variable
        raise SettingsError(f"{variable}={safety.prompt_filter_words!r}: {exc}") from None


class PromptFilter:
    """The list, indexed for matching: words (those with digits or symbols matched
    as written, and as their letters), phrases by their first word, and a trie of
    the words a prompt may spell out letter by letter."""

    def __init__(self, entries: Iterable[Entry]) -> None:
        self._words: dict[str, Categories] = {}
        self._phrases: dict[str, list[tuple[tuple[str, ...], Categories]]] = {}
        self._by_length: dict[int, list[str]] = {}  # for a word with a '*' in it
        self._trie: dict[str, Any] = {}
        self._pairs: set[str] = set()  # the first two letters of the trie's words
        for entry in entries:
            if entry.spelled:
                self._insert(entry.key, entry.categories)
            elif len(entry.words) > 1:
                self._phrases.setdefault(entry.words[0], []).append((entry.words, entry.categories))
            else:
                self._words[entry.key] = self._words.get(entry.key, frozenset()) | entry.categories
        for word, categories in self._words.items():
            if word.isalpha():
                self._by_length.setdefault(len(word), []).append(word)
                if len(word) <= MAX_SPELLED:
                    self._insert(word, categories)

    @classmethod
    def shipped(cls, operator_words: str | Path = "") -> PromptFilter:
        """The shipped list, with the operator's file (``operator_words``) when one is named."""
        entries = shipped_entries()
        if operator_words:
            path = Path(operator_words)
            entries += operator_entries(path.read_text(encoding="utf-8"), str(path))
        return cls(entries)

    def check(self, text: str) -> Verdict:
        text = normalised(text)
        ascii = text.isascii()
        words = (ASCII_WORD if ascii else WORD).findall(text)
        unique = set(words)
        found: set[str] = set()
        for word in unique & self._words.keys():
            found |= self._words[word]
        for word in unique:
            if not word.isalpha():
                if not word.isdigit():  # a number is no word: "455 horsepower"
                    found |= self._symbols(word)
            elif word[-1] == "s":
                found |= self._words.get(stem(word) or "", frozenset())
        if RUN.search(text):
            for word in unique:
                if word.isalpha() and RUN.search(word):
                    found |= _plain(word, self._words)
        starting = unique & self._phrases.keys()
        if starting:
            for i, word in enumerate(words):
                if word in starting:
                    found |= self._phrase(words, i, self._phrases[word])
        for spelled in (ASCII_SPELLED if ascii else SPELLED).finditer(text):
            found |= self._spelled_out(NOT_WORD.sub("", spelled.group()))
        return Verdict(frozenset(found)) if found else PASSED

    def _symbols(self, word: str) -> Categories:
        """A word with digits or symbols in it ("p0rn", "@ss", "f*ck"), read as letters."""
        if "*" in word:
            return self._starred(word)
        for reading in readings(word):
            hit = _plain(reading, self._words)
            if hit:
                return hit
        return frozenset()

    def _starred(self, word: str) -> Categories:
        """A word with a '*' inside ("f*ck"): any listed word of its length it could be."""
        pattern = re.compile("".join("." if c == "*" else f"[{re.escape(c + LEET.get(c, ''))}]" for c in word))
        return next((self._words[w] for w in self._by_length.get(len(word), ()) if pattern.fullmatch(w)), frozenset())

    @staticmethod
    def _phrase(words: list[str], i: int, phrases: list[tuple[tuple[str, ...], Categories]]) -> Categories:
        found: Categories = frozenset()
        after = words[i + 1] if i + 1 < len(words) else ""
        for phrase, categories in phrases:
            # Most fail on their second word, cheaply (a phrase's last word may be a plural).
            if after != phrase[1] and (len(phrase) > 2 or stem(after) != phrase[1]):
                continue
            there = words[i : i + len(phrase)]
            last = there[-1]
            if len(there) == len(phrase) and there[:-1] == list(phrase[:-1]) and phrase[-1] in (last, stem(last)):
                found |= categories
        return found

    def _insert(self, word: str, categories: Categories) -> None:
        node = self._trie
        for c in word:
            node = node.setdefault(c, {})
        node[_END] = node.get(_END, frozenset()) | categories
        self._pairs.add(word[:2])

    def _spelled_out(self, letters: str) -> Categories:
        """What a word spelled out letter by letter holds: any stretch of it (the
        letters of one-letter words around it, "a" and "i", join it too), its digits
        and symbols read as letters too."""
        found: Categories = frozenset()
        if letters.isalpha():  # nothing to read two ways: one walk from each letter
            for start in range(len(letters) - 1):
                if letters[start : start + 2] not in self._pairs:  # most letters start no listed word
                    continue
                node = self._trie
                for at in range(start, len(letters)):
                    child = node.get(letters[at])
                    if child is None:
                        break
                    node = child
                    if at > start and _END in node:
                        found |= node[_END]
            return found
        for start in range(len(letters) - 1):
            stack = [(self._trie, start)]
            while stack:
                node, at = stack.pop()
                if at - start > 1 and _END in node:
                    found |= node[_END]
                if at == len(letters):
                    continue
                c = letters[at]
                for option in c + LEET.get(c, ""):
                    child = node.get(option)
                    if child is not None:
                        stack.append((child, at + 1))
        return found


def _plain(word: str, table: dict[str, Categories]) -> Categories:
    """A word of letters: as it is, as a plural's singular, and with its runs of three
    or more of a letter read as one and as two."""
    hit = table.get(word)
    if hit:
        return hit
    singular = stem(word)
    if singular is not None:
        hit = table.get(singular)
        if hit:
            return hit
    if RUN.search(word):
        for collapsed in (RUN.sub(r"\1", word), RUN.sub(r"\1\1", word)):
            hit = table.get(collapsed) or table.get(stem(collapsed) or "")
            if hit:
                return hit
    return frozenset()
