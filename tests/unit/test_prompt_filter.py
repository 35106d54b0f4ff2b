"""The prompt filter on plain strings: leetspeak, spelled-out words, Unicode tricks,
repeated letters and plurals are caught; words that merely contain a listed one
(the Scunthorpe problem), the list's ordinary words and negative prompts are
not; the operator's list adds words and phrases, and a verdict names categories,
never words."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gateway.validation import violates_policy
from services.config.fields import SettingsError
from services.config.safety import SafetySettings
from services.safety import prompt_filter as pf
from services.safety.prompt_filter import PROFANITY, SEXUAL_CATEGORY, PromptFilter
from services.safety.prompt_words import ADDED, EXCLUDED, SEXUAL

BOTH = {PROFANITY, SEXUAL_CATEGORY}


@pytest.fixture(scope="module")
def shipped() -> PromptFilter:
    return PromptFilter.shipped()


def categories(f: PromptFilter, text: str) -> set[str]:
    return set(f.check(text).categories)


@pytest.mark.parametrize(
    "prompt",
    [
        "p0rn",
        "a p0rn star",
        "5h1t",
        "@ss",
        "a$$hole",
        "sh!+",
        "b00bs",
        "d1cks",
        "f*ck this",
        "p*ssy",
        "$ex on the beach",
        "N1GGER",
    ],
)
def test_leetspeak_is_read_as_letters(shipped: PromptFilter, prompt: str) -> None:
    assert shipped.check(prompt).flagged


@pytest.mark.parametrize(
    "prompt", ["s e x", "s.e.x", "S-E-X", "s_e_x", "s*e*x", "a f u c k i n g mess", "i f u c k", "s 3 x", "f.u.c.k."]
)
def test_a_word_spelled_out_letter_by_letter_is_read_joined(shipped: PromptFilter, prompt: str) -> None:
    assert shipped.check(prompt).flagged


@pytest.mark.parametrize(
    "prompt",
    [
        "\uff53\uff45\uff58",  # fullwidth
        "\U0001d42c\U0001d41e\U0001d431",  # mathematical bold
        "ⓢⓔⓧ",  # circled
        "séx",
        "s\u200bex",  # a zero-width space inside
        "s\u00adex",  # a soft hyphen inside
        "s\u0336e\u0336x\u0336",  # struck through with combining marks
        "\u0455\u0435\u0445",  # Cyrillic letters drawn as Latin ones
        "SeX",
    ],
)
def test_unicode_disguises_are_normalised(shipped: PromptFilter, prompt: str) -> None:
    assert categories(shipped, prompt) == BOTH


@pytest.mark.parametrize("prompt", ["fuuuuck", "sexxx", "booooobs", "shiiiit"])
def test_a_letter_repeated_is_read_once_or_twice(shipped: PromptFilter, prompt: str) -> None:
    assert shipped.check(prompt).flagged


@pytest.mark.parametrize("prompt", ["dicks", "sexes", "bitches"])
def test_a_plural_is_read_as_its_singular(shipped: PromptFilter, prompt: str) -> None:
    assert shipped.check(prompt).flagged


# Innocent prompts: each holds a listed word inside another, or one of the list's
# ordinary words that prompt_words.EXCLUDED leaves out, or something a careless
# reading of leetspeak would turn into one.
INNOCENT = [
    "Scunthorpe town centre at night",
    "the Essex coast, Sussex downs and Middlesex hospital",
    "a classic car in a glass house",
    "an assassin in a cockpit",
    "a cocktail with a peacock feather",
    "Penistone and Clitheroe railway stations",
    "an analysis of the therapist's notes",
    "grapes and shiitake on a plate",
    "cumulus clouds over a titan's button",
    "hello world",
    "a fat cat in the sun",
    "god rays through a cathedral window",
    "homo sapiens skull in a museum",
    "a Maine coon and a blue tit",
    "a 455 horsepower engine",
    "a gay couple at their wedding",
    "a sob story",
    "masterpiece, best quality, 8k, 1girl, solo",
    "(ultra realistic:1.2), 4 x 4 truck",
    "a pipe organ in a church",
    "Puss in Boots",
    "a virgin forest",
    "a comic strip",
    "a brush stroke",
    "a woman with kinky curls wearing a fanny pack",
    "a knight killing a dragon",
    "a rum bottle on a pirate ship",
    "Hancock and Dickens in a library",
    "a snatch of birdsong",
    "a blow dryer and a hand mirror",
    "golden hour over a deep lake",
]


@pytest.mark.parametrize("prompt", INNOCENT)
def test_innocent_prompts_pass(shipped: PromptFilter, prompt: str) -> None:
    assert not shipped.check(prompt).flagged


@pytest.mark.parametrize(
    "prompt", ["a blow job", "blow jobs", "golden shower", "hand job", "2 girls 1 cup", "a deep throat", "g-spot"]
)
def test_phrases_match_word_by_word(shipped: PromptFilter, prompt: str) -> None:
    assert categories(shipped, prompt) == BOTH


def test_the_list_s_categories_profanity_and_its_sexual_subset(shipped: PromptFilter) -> None:
    assert categories(shipped, "a bastard") == {PROFANITY}
    assert categories(shipped, "a nude portrait") == BOTH
    assert categories(shipped, "nsfw") == BOTH  # Darkroom's own addition
    assert categories(shipped, "a lighthouse") == set()


def test_a_verdict_says_nothing_of_the_word_it_matched(shipped: PromptFilter) -> None:
    verdict = shipped.check("a photo of a sexy pussy")
    assert [f.name for f in dataclasses.fields(verdict)] == ["categories"]
    assert "pussy" not in repr(verdict)


def test_the_negative_prompt_is_never_checked(shipped: PromptFilter) -> None:
    # Negative prompts steer away from what they name: "nsfw, nude" is what they are for.
    assert not violates_policy("a lighthouse", shipped)
    assert violates_policy("nsfw, nude", shipped)  # the same words as a prompt
    assert not violates_policy("nsfw, nude", None)  # the filter off


def test_the_operator_s_list_adds_words_phrases_and_sexual_ones(tmp_path: Path) -> None:
    words = tmp_path / "words.txt"
    words.write_text("# our own\ngrumpkin\npurple  haze   # a phrase\n\n[sexual]\nfeetpics\n[profanity]\nblorf\n")
    f = PromptFilter.shipped(words)
    assert categories(f, "a GRUMPKIN") == {PROFANITY}
    assert categories(f, "gr*mpkin") == {PROFANITY}
    assert categories(f, "purple haze at dawn") == {PROFANITY}
    assert not f.check("a purple sky, haze").flagged  # a phrase's words in order, side by side
    assert categories(f, "feetpics") == BOTH
    assert categories(f, "blorf") == {PROFANITY}
    assert categories(f, "sex") == BOTH  # and the shipped list as ever


def test_the_operator_s_list_is_checked_when_the_gateway_starts(tmp_path: Path) -> None:
    bad = tmp_path / "words.txt"
    bad.write_text("fine\n[violence]\nsword\n")
    with pytest.raises(SettingsError, match=r"DARKROOM_PROMPT_FILTER_WORDS=.*line 2: \[violence\]"):
        pf.from_settings(SafetySettings(prompt_filter_words=str(bad)))
    with pytest.raises(SettingsError, match="DARKROOM_PROMPT_FILTER_WORDS"):
        pf.from_settings(SafetySettings(prompt_filter_words=str(tmp_path / "missing.txt")))


def test_what_darkroom_changes_of_the_shipped_list_is_in_it() -> None:
    # Each word left out or called sexual is one of the list's (or ADDED): a new
    # better-profanity that renames one shows here, rather than as a silent gap.
    listed = {entry.key for entry in pf.shipped_entries()}
    shipped = {e.key for line in pf.shipped_list().read_text().splitlines() if (e := pf.entry_of(line, frozenset()))}
    assert EXCLUDED <= shipped
    assert SEXUAL <= listed
    assert set(ADDED) <= listed
    assert not EXCLUDED & listed
