"""Prompt expansion's expanders: what they add comes from the vocabulary, is bounded,
skips what the prompt has, and depends on the prompt and seed alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.config.safety import ExpansionSettings
from services.safety.expansion import TemplateExpander, build_expander
from services.safety.lm_expansion import Limits, ModelExpander, PhraseTrie, choose_phrases, model_directory
from services.safety.tiny_gpt2 import TINY_GPT2_MARKER, build_tiny_gpt2
from services.safety.vocabulary import Vocabulary, expanded_text, words_of

SHIPPED = Vocabulary.shipped()
PROMPTS = ["a cat", "a lighthouse on a cliff at dusk, soft lighting", "portrait of an old sailor,", "猫と桜"]


def added(prompt: str, expanded: str) -> list[str]:
    """The phrases an expansion added to ``prompt``."""
    if expanded == prompt:
        return []
    base = prompt.rstrip(" ,")
    assert expanded.startswith(base + ", "), expanded
    return expanded[len(base) + 2 :].split(", ")


# -- the vocabulary ------------------------------------------------------------------


def test_vocabulary_reads_kinds_comments_and_drops_repeats() -> None:
    vocabulary = Vocabulary.parse("loose\n# a comment\n[light]\nSoft   Light  # soft\nsoft light\n[mood]\ncalm\n")
    assert vocabulary.kinds == (("", ("loose",)), ("light", ("soft light",)), ("mood", ("calm",)))
    assert vocabulary.words == {"loose", "soft", "light", "calm"}


@pytest.mark.parametrize(("text", "why"), [("red, blue\n", "comma"), ("# nothing\n[kind]\n", "no phrases")])
def test_vocabulary_refuses_what_it_cannot_use(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Vocabulary.parse(text)


def test_an_operators_file_is_named_in_its_error(tmp_path: Path) -> None:
    bad = tmp_path / "words.txt"
    bad.write_text("[x]\nfine\nnot, fine\n")
    with pytest.raises(ValueError, match=r"words\.txt: line 3"):
        Vocabulary.load(bad)


def test_expanded_text_joins_with_commas_and_keeps_a_prompt_without_phrases() -> None:
    assert expanded_text("a cat, ", ["soft light", "calm"]) == "a cat, soft light, calm"
    assert expanded_text("a cat", []) == "a cat"


# -- the template expander -------------------------------------------------------------


def test_template_expansion_is_seeded_bounded_and_from_the_vocabulary() -> None:
    expander = TemplateExpander(SHIPPED, max_phrases=5)
    again = TemplateExpander(SHIPPED, max_phrases=5)
    for prompt in PROMPTS:
        outputs = {expander.expand(prompt, seed) for seed in range(20)}
        assert len(outputs) > 10, "the seed chooses the phrases"
        for seed in range(20):
            expanded = expander.expand(prompt, seed)
            assert expanded == expander.expand(prompt, seed) == again.expand(prompt, seed)
            phrases = added(prompt, expanded)
            assert 1 <= len(phrases) <= 5
            assert set(phrases) <= set(SHIPPED.phrases)
            assert words_of(", ".join(phrases)) <= SHIPPED.words
            assert len(set(phrases)) == len(phrases)


def test_template_expansion_skips_phrases_whose_words_the_prompt_has() -> None:
    vocabulary = Vocabulary.parse("[light]\nsoft light\nred\n[mood]\nblue\ncalm blue\n")
    expander = TemplateExpander(vocabulary, max_phrases=10)
    for seed in range(10):
        phrases = added("red and blue", expander.expand("red and blue", seed))
        assert sorted(phrases) in (["calm blue", "soft light"],), phrases
    assert expander.expand("soft red light, calm blue", 3) == "soft red light, calm blue"


def test_template_expansion_takes_a_phrase_of_each_kind_before_a_second() -> None:
    expander = TemplateExpander(SHIPPED, max_phrases=len(SHIPPED.kinds))
    for seed in range(10):
        phrases = added("a cat", expander.expand("a cat", seed))
        kinds = {kind for kind, those in SHIPPED.kinds for p in phrases if p in those}
        assert len(kinds) == len(SHIPPED.kinds)


# -- constrained choice, with a stand-in for the model ---------------------------------


class Scripted:
    """Logits that favour one token at a time, in the order given; records what it is fed."""

    def __init__(self, favourites: list[int], size: int = 16) -> None:
        self.favourites = list(favourites)
        self.size = size
        self.fed: list[list[int]] = []

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        self.fed.append(list(tokens))
        logits = torch.zeros(self.size)
        if self.favourites:
            logits[self.favourites.pop(0)] = 50.0
        return logits


SEP, EOS = 14, 15
# Phrases as tokens: "soft light" = 1 2, "soft" = 1, "calm" = 3, "red sky" = 4 5.
SEQUENCES = [[1, 2], [1], [3], [4, 5]]
WORDS = [frozenset({"soft", "light"}), frozenset({"soft"}), frozenset({"calm"}), frozenset({"red", "sky"})]


def choose(script: Scripted, *, had: frozenset[str] = frozenset(), max_tokens: int = 20, max_phrases: int = 5):
    return choose_phrases(
        PhraseTrie(SEQUENCES),
        WORDS,
        had,
        script,
        separator=SEP,
        eos=EOS,
        limits=Limits(max_tokens, max_phrases, top_k=4),
        generator=torch.Generator().manual_seed(0),
    )


def test_choice_follows_the_model_within_the_phrases_and_feeds_it_every_token() -> None:
    # soft, light, ",", then red (its sky is the only way on: the model is not asked),
    # ",", then calm (all that is left: not asked either), end.
    script = Scripted([1, 2, SEP, 4, SEP, EOS])
    assert choose(script) == [0, 3, 2]
    fed = [t for call in script.fed for t in call]
    assert fed == [1, 2, SEP, 4, 5, SEP, 3]
    assert [5] not in script.fed, "a token with no alternative is fed with the next call"


def test_choice_never_starts_a_phrase_the_prompt_or_an_earlier_phrase_has() -> None:
    # "soft light" had: soft and soft light are both banned, calm is next, then red sky.
    script = Scripted([3, SEP, EOS])
    assert choose(script, had=frozenset({"soft", "light", "a"})) == [2, 3]
    # "soft" chosen first: "soft light" may follow (light is new), "soft" may not again.
    script = Scripted([1, SEP, 1, EOS])
    assert choose(script) == [1, 0]


def test_choice_stops_at_its_bounds_and_drops_a_phrase_cut_short() -> None:
    assert choose(Scripted([3, SEP, 4, 5]), max_tokens=3) == [2]  # red cut before its sky
    assert choose(Scripted([3, SEP, 1, 2]), max_tokens=4) == [2, 0]  # soft light whole at the last token
    assert choose(Scripted([3, SEP, 4, SEP, 1, SEP]), max_phrases=2) == [2, 3]
    everything = frozenset().union(*WORDS)
    assert choose(Scripted([]), had=everything) == []


# -- the tiny GPT-2 and the model expander ---------------------------------------------


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_directory("builtin:tiny-gpt2", tmp_path_factory.mktemp("models"))


def test_tiny_gpt2_is_built_once_the_same_from_its_seed(tiny_gpt2: Path, tmp_path: Path) -> None:
    assert (tiny_gpt2 / TINY_GPT2_MARKER).exists() and (tiny_gpt2 / "config.json").exists()
    assert model_directory("builtin:tiny-gpt2", tiny_gpt2.parent) == tiny_gpt2
    again = build_tiny_gpt2(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_gpt2 / name).read_bytes(), name


def test_a_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a transformers directory"):
        model_directory(str(tmp_path), tmp_path)


def test_model_expansion_adds_only_vocabulary_phrases_bounded_and_seeded(tiny_gpt2: Path) -> None:
    expander = ModelExpander(tiny_gpt2, SHIPPED, max_tokens=24, max_phrases=6, top_k=8)
    again = ModelExpander(tiny_gpt2, SHIPPED, max_tokens=24, max_phrases=6, top_k=8)
    for prompt in PROMPTS:
        outputs = set()
        for seed in range(25):
            expanded = expander.expand(prompt, seed)
            assert expanded == again.expand(prompt, seed) == expander.expand(prompt, seed)
            phrases = added(prompt, expanded)
            assert 1 <= len(phrases) <= 6
            assert set(phrases) <= set(SHIPPED.phrases), phrases
            assert words_of(", ".join(phrases)) <= SHIPPED.words
            outputs.add(expanded)
        assert len(outputs) > 5, "the seed chooses the phrases"


def test_model_expansion_skips_phrases_the_prompt_has(tiny_gpt2: Path) -> None:
    vocabulary = Vocabulary.parse("[x]\nsoft lighting\ngolden hour\nbokeh\n")
    expander = ModelExpander(tiny_gpt2, vocabulary, max_tokens=24, max_phrases=6, top_k=8)
    for seed in range(10):
        phrases = added("bokeh at golden hour", expander.expand("bokeh at golden hour", seed))
        assert phrases == ["soft lighting"]
    assert expander.expand("soft lighting, golden hour, bokeh", 1) == "soft lighting, golden hour, bokeh"


def test_max_tokens_bounds_what_the_model_adds(tiny_gpt2: Path) -> None:
    expander = ModelExpander(tiny_gpt2, SHIPPED, max_tokens=3, max_phrases=6, top_k=8)
    tokens = expander.tokenizer
    for seed in range(20):
        phrases = added("a cat", expander.expand("a cat", seed))
        spelt = sum(len(tokens(", " + p, add_special_tokens=False)["input_ids"]) for p in phrases)
        assert spelt <= 3 + 1  # the phrases' tokens and their separators, the first's comma in the context


def test_build_expander_follows_the_settings(tiny_gpt2: Path) -> None:
    assert build_expander(ExpansionSettings(prompt_expander="off"), tiny_gpt2.parent) is None
    assert build_expander(ExpansionSettings(), tiny_gpt2.parent).name == "template"  # type: ignore[union-attr]
    model = build_expander(ExpansionSettings(prompt_expander="model", expansion_max_phrases=2), tiny_gpt2.parent)
    assert isinstance(model, ModelExpander) and model.directory == tiny_gpt2
    assert len(added("a cat", model.expand("a cat", 4))) <= 2


_ELSEWHERE = """
import json, sys
from pathlib import Path
from services.safety.expansion import TemplateExpander
from services.safety.lm_expansion import ModelExpander
from services.safety.vocabulary import Vocabulary
v = Vocabulary.shipped()
t, m = TemplateExpander(v, max_phrases=6), ModelExpander(Path(sys.argv[1]), v, max_tokens=24, max_phrases=6, top_k=8)
print(json.dumps([[t.expand(p, s), m.expand(p, s)] for p in ("a cat", "a red fox") for s in (0, 7, 2**63 - 1)]))
"""


def test_expansion_is_the_same_in_another_process_whatever_its_hash_seed(tiny_gpt2: Path) -> None:
    template = TemplateExpander(SHIPPED, max_phrases=6)
    model = ModelExpander(tiny_gpt2, SHIPPED, max_tokens=24, max_phrases=6, top_k=8)
    here = [[template.expand(p, s), model.expand(p, s)] for p in ("a cat", "a red fox") for s in (0, 7, 2**63 - 1)]
    # One other process, of a hash seed other than this one's (random unless set).
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    out = subprocess.run(
        [sys.executable, "-c", _ELSEWHERE, str(tiny_gpt2)],
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(out.stdout.splitlines()[-1]) == here


# -- asking for it, on each door ---------------------------------------------------------


def test_a_request_that_says_nothing_takes_its_tenants_default() -> None:
    from gateway.expansion import asks_expansion
    from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

    assert asks_expansion(pb.SubmitJobRequest(), True) and not asks_expansion(pb.SubmitJobRequest(), False)
    assert not asks_expansion(pb.SubmitJobRequest(expand_prompt=False), True)
    assert asks_expansion(pb.SubmitJobRequest(expand_prompt=True), False)


def test_the_http_body_and_the_cli_leave_expand_prompt_unset_unless_they_say() -> None:
    import argparse

    from http_api.images import generation
    from services.ops.generate_cli import build_request

    assert not generation({"prompt": "x"})[0].HasField("expand_prompt")
    said = generation({"prompt": "x", "expand_prompt": False})[0]
    assert said.HasField("expand_prompt") and not said.expand_prompt
    assert generation({"prompt": "x", "expand_prompt": "true"}, form=True)[0].expand_prompt
    options = {"model": None, "negative_prompt": "", "width": None, "height": None, "steps": None, "seed": 3}
    for expand in (None, True, False):
        request = build_request("x", argparse.Namespace(**options, guidance=None, output="x.png", expand=expand))
        assert request.HasField("expand_prompt") == (expand is not None) and request.expand_prompt == bool(expand)


def test_the_images_response_gives_each_image_the_prompt_it_was_made_from() -> None:
    from http_api.images import Asked, images_response
    from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

    outputs = [pb.Image(data=b"png", width=64, height=64), pb.Image(data=b"png", width=64, height=64)]
    expanded = images_response(pb.Job(expanded_prompt="a cat, bokeh"), outputs, Asked(), lambda i: "")
    assert [d["revised_prompt"] for d in expanded["data"]] == ["a cat, bokeh"] * 2
    plain = images_response(pb.Job(), outputs, Asked(), lambda i: "")
    assert all("revised_prompt" not in d for d in plain["data"])
