"""How the prompt filter reads text: text and the word list are compared after the same normalisation:
- Unicode NFKC (fullwidth, circled and mathematical letters become plain), case
  folding, accents and other combining marks stripped, invisible characters
  (zero-width spaces and joiners, soft hyphens) dropped, Cyrillic and Greek
  letters that look Latin read as Latin;
- leetspeak: 0 o, 1 i or l, 3 e, 4 a, 5 s, 7 t, 8 b, 9 g, @ a, $ s, ! i, | i or l,
  + t, a * inside a word any letter; a word of digits alone is a number, never
  folded ("455 horsepower");
- a word spelled out letter by letter ("s e x", "s.e.x", "f-u-c-k") is read
  joined;
- three or more of a letter read as one or two ("fuuuck", "sexxx");
- a plural read as its singular too ("dicks", "sexes")."""

from __future__ import annotations

import itertools
import math
import re
import unicodedata
from collections.abc import Iterator

# Characters no one sees: dropped, so "s\u200bex" reads "sex".
_INVISIBLE = dict.fromkeys(
    (
        0x00AD,
        0x034F,
        0x061C,
        0x115F,
        0x1160,
        0x17B4,
        0x17B5,
        0x3164,
        0xFEFF,
        0xFFA0,
        *range(0x180B, 0x1810),
        *range(0x200B, 0x2010),
        *range(0x202A, 0x202F),
        *range(0x2060, 0x2070),
        *range(0xFE00, 0xFE10),
        *range(0xE0000, 0xE0080),
    )
)
# Cyrillic and Greek letters drawn as Latin ones (after case folding).
_LOOKALIKES = str.maketrans(
    {
        **dict(zip("авсеёһіјкмнорѕтухԁӏ", "abceehijkmhopstyxdl", strict=True)),
        **dict(zip("αβεηικνορστυχɡ", "abenikvopstuxg", strict=True)),
    }
)
_MARKS = re.compile("[\u0300-\u036f\u0483-\u0489\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]+")
# A word: letters and digits, and the symbols leetspeak writes letters with; a
# '!', '|' or '*' at its ends is punctuation ("shit!", "*fuck*"), not a letter.
WORD = re.compile(r"[\w@$+€](?:[\w@$!|+*€]*[\w@$+€])?")
# Two or more words of one letter each: a word spelled out ("s e x", "f-u-c-k").
SPELLED = re.compile(r"(?<!\w)\w(?!\w)(?:\W+\w(?!\w))+")
# The same for ASCII text (most prompts), which they scan twice as fast.
ASCII_WORD = re.compile(WORD.pattern, re.ASCII)
ASCII_SPELLED = re.compile(SPELLED.pattern, re.ASCII)
NOT_WORD = re.compile(r"\W+")
LEET = {
    "0": "o",
    "1": "il",
    "3": "e",
    "4": "a",
    "5": "s",
    "7": "t",
    "8": "b",
    "9": "g",
    "@": "a",
    "$": "s",
    "!": "i",
    "|": "il",
    "+": "t",
    "€": "e",
}
RUN = re.compile(r"(.)\1{2,}")
# Readings tried of one word at most: past it, the first reading of each symbol alone.
MAX_READINGS = 64
# The longest word looked for where a prompt spells one out letter by letter.
MAX_SPELLED = 12
_SIBILANT = ("s", "x", "z", "ch", "sh")


def normalised(text: str) -> str:
    """``text`` as it is compared with the list: the module's normalisation up to
    leetspeak, and '_' a space, as between words."""
    text = unicodedata.normalize("NFKC", text).casefold().replace("_", " ")
    if text.isascii():
        return text
    text = text.translate(_INVISIBLE).translate(_LOOKALIKES)
    return _MARKS.sub("", unicodedata.normalize("NFD", text))


def words_of(text: str) -> list[str]:
    """The words of ``text``, normalised."""
    return WORD.findall(normalised(text))


def readings(word: str) -> Iterator[str]:
    """``word`` with each leetspeak symbol read as each letter it may be (at most
    MAX_READINGS of them); a word without one is its only reading."""
    if word.isalpha() or word.isdigit():
        yield word
        return
    options = [LEET.get(c, c) for c in word]
    if math.prod(len(o) for o in options) > MAX_READINGS:
        options = [o[0] for o in options]
    for letters in itertools.product(*options):
        yield "".join(letters)


def stem(word: str) -> str | None:
    """``word``'s singular, if it reads as a plural."""
    if word.endswith("es") and word[:-2].endswith(_SIBILANT):
        return word[:-2]
    if word.endswith("s") and not word.endswith("ss") and len(word) > 3:
        return word[:-1]
    return None
