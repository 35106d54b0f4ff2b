"""Prompt expansion: a short prompt made more detailed by adding style phrases
(quality, lighting, composition, medium...) taken from a vocabulary, never a word
of the expander's own. Two expanders: ``TemplateExpander`` (no model: phrases
drawn by a seeded RNG) and ``ModelExpander`` (``services.safety.lm_expansion``: a
causal language model whose choice is held to the vocabulary, as Fooocus does).

Both are seeded by the job's seed and depend on nothing else (not the host, not
PYTHONHASHSEED, not other work in the process): the same request expands the
same way. Expanding is blocking and CPU- or GPU-bound; the gateway runs it on a
thread of its own, once per job, and stores the result on the job."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Protocol

from services.config.safety import ExpansionSettings
from services.safety.vocabulary import Vocabulary, expanded_text, words_of

TEMPLATE = "template"
MODEL = "model"
OFF = "off"


class Expander(Protocol):
    """Makes a prompt more detailed; blocking: callers on an event loop run it in a thread."""

    name: str  # "template" or "model": the label of its metrics

    def expand(self, prompt: str, seed: int) -> str:
        """``prompt``, then ", " and the phrases added (each from the vocabulary); the
        same for the same prompt and seed."""
        ...


class TemplateExpander:
    """Up to ``max_phrases`` phrases, one kind after another in an order the seed
    shuffles, each drawn from its kind by ``random.Random(seed)``; a phrase whose
    words the prompt (or an earlier phrase) already has is passed over."""

    name = TEMPLATE

    def __init__(self, vocabulary: Vocabulary, *, max_phrases: int) -> None:
        self.vocabulary = vocabulary
        self.max_phrases = max_phrases
        self._kinds = [[(p, words_of(p)) for p in phrases] for _, phrases in vocabulary.kinds]

    def expand(self, prompt: str, seed: int) -> str:
        # An int seeds Mersenne Twister the same way on every host and whatever
        # PYTHONHASHSEED is (only str and bytes seeds would be hashed).
        rng = random.Random(seed)
        order = list(range(len(self._kinds)))
        rng.shuffle(order)
        have = set(words_of(prompt))
        added: list[str] = []
        while len(added) < self.max_phrases:
            before = len(added)
            for kind in order:
                if len(added) == self.max_phrases:
                    break
                fresh = [(p, words) for p, words in self._kinds[kind] if not words <= have]
                if fresh:
                    phrase, words = fresh[rng.randrange(len(fresh))]
                    added.append(phrase)
                    have |= words
            if len(added) == before:  # every phrase's words are had
                break
        return expanded_text(prompt, added)


def vocabulary_of(settings: ExpansionSettings) -> Vocabulary:
    return (
        Vocabulary.load(Path(settings.expansion_vocabulary)) if settings.expansion_vocabulary else Vocabulary.shipped()
    )


def build_expander(settings: ExpansionSettings, models_dir: Path) -> Expander | None:
    """The expander the settings name (None: expansion is off), loaded: a model is
    read from its directory, or built first if it is a builtin (``builtin:tiny-gpt2``)."""
    if settings.prompt_expander == OFF:
        return None
    vocabulary = vocabulary_of(settings)
    if settings.prompt_expander == TEMPLATE:
        return TemplateExpander(vocabulary, max_phrases=settings.expansion_max_phrases)
    from services.safety.lm_expansion import ModelExpander, model_directory

    return ModelExpander(
        model_directory(settings.expansion_model, models_dir),
        vocabulary,
        max_tokens=settings.expansion_max_tokens,
        max_phrases=settings.expansion_max_phrases,
        top_k=settings.expansion_top_k,
        device=settings.expansion_device,
        threads=settings.expansion_threads,
    )
