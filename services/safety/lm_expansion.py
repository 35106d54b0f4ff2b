"""The model expander: a causal language model continues ``prompt + ","`` with
phrases of the vocabulary, as Fooocus's GPT-2 does, seeded by the job's seed.

Fooocus masks the logits to the token ids that spell its vocabulary's words; this
holds the model closer: a trie of each phrase's token ids allows, at each step,
only the tokens that continue some phrase not yet had, and a separator (",") or
the end only where a phrase is whole. So every phrase added is one of the
vocabulary's, spelt as it is there, whatever the weights say (random ones too).
Each token is drawn among the ``top_k`` likeliest of those allowed by a
``torch.Generator`` seeded with the job's seed, on the CPU: the same request
expands the same way on any host and whatever else the process runs. A step
with one allowed token asks the model nothing; its token is fed with the next."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.models.builtins import Builtin, builtin_dir, ensure_builtin
from services.safety.vocabulary import SEPARATOR, Vocabulary, expanded_text, words_of

# The language models Darkroom builds itself, on first use, into the models directory.
BUILTIN_EXPANDERS = {
    "builtin:tiny-gpt2": Builtin("services.safety.tiny_gpt2", "build_tiny_gpt2", "darkroom_tiny_gpt2.json"),
}


def model_directory(source: str, models_dir: Path) -> Path:
    """Where the model named ``source`` is: a builtin's directory, built if it is not
    yet, or ``source`` itself, which must be a transformers directory."""
    builtin = BUILTIN_EXPANDERS.get(source)
    if builtin is not None:
        return ensure_builtin(builtin, builtin_dir(models_dir, source))
    directory = Path(source).expanduser()
    if not (directory / "config.json").is_file():
        known = ", ".join(sorted(BUILTIN_EXPANDERS))
        raise ValueError(f"expansion model {source!r}: not a transformers directory (no config.json), nor {known}")
    return directory


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    end: int | None = None  # the phrase whose tokens end here
    below: set[int] = field(default_factory=set)  # the phrases ending here or under it


class PhraseTrie:
    """The phrases' token ids, as a tree from their first token."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self.root = _Node()
        for phrase, tokens in enumerate(sequences):
            node = self.root
            node.below.add(phrase)
            for token in tokens:
                node = node.children.setdefault(token, _Node())
                node.below.add(phrase)
            if node.end is None and node is not self.root:
                node.end = phrase


@dataclass(frozen=True)
class Limits:
    max_tokens: int
    max_phrases: int
    top_k: int


def choose_phrases(
    trie: PhraseTrie,
    phrase_words: Sequence[frozenset[str]],
    had: frozenset[str],
    next_logits: Callable[[list[int]], torch.Tensor],
    *,
    separator: int,
    eos: int,
    limits: Limits,
    generator: torch.Generator,
) -> list[int]:
    """The phrases chosen, by index, in order. ``next_logits(tokens)`` feeds the model
    ``tokens`` (those chosen since its last call; the first call also feeds the
    context) and returns the next token's logits, on the CPU. A phrase whose words
    are all ``had`` (or added before) is never started."""
    have = set(had)
    banned = {i for i, words in enumerate(phrase_words) if words <= have}
    chosen: list[int] = []
    fed: list[int] = []  # chosen and not yet fed to the model
    node = trie.root
    for _ in range(limits.max_tokens):
        allowed = [t for t, child in node.children.items() if not child.below <= banned]
        whole = node.end is not None and node.end not in banned
        if whole:
            allowed += [separator, eos]
        if not allowed:
            break
        if len(allowed) == 1:
            token = allowed[0]
        else:
            token = _draw(next_logits(fed), allowed, limits.top_k, generator)
            fed = []
        if whole and token in (separator, eos):
            assert node.end is not None
            chosen.append(node.end)
            have |= phrase_words[node.end]
            banned |= {i for i, words in enumerate(phrase_words) if words <= have}
            if token == eos or len(chosen) == limits.max_phrases:
                return chosen
            node = trie.root
        else:
            node = node.children[token]
        fed.append(token)
    if node.end is not None and node.end not in banned:
        chosen.append(node.end)  # whole when the tokens ran out: as if it had ended there
    return chosen


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """``n`` intra-op threads while the model runs. A small model's steps are too
    short to share between threads, and threads that spin waiting for each other
    on a busy host cost it tens of milliseconds a step. With PyTorch's OpenMP
    backend this is the calling thread's setting alone; restored afterwards."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _draw(logits: torch.Tensor, allowed: list[int], top_k: int, generator: torch.Generator) -> int:
    ids = torch.tensor(sorted(allowed))
    scores = logits[ids]
    top, where = torch.topk(scores, min(top_k, len(allowed)))
    pick = torch.multinomial(torch.softmax(top, dim=0), 1, generator=generator)
    return int(ids[where[pick]].item())


class ModelExpander:
    """A causal language model from a transformers directory (AutoModelForCausalLM and
    its tokenizer), its phrases held to ``vocabulary``; not thread-safe: one call at
    a time (the gateway's expansion thread)."""

    name = "model"

    def __init__(
        self,
        directory: Path,
        vocabulary: Vocabulary,
        *,
        max_tokens: int,
        max_phrases: int,
        top_k: int,
        device: str = "cpu",
        threads: int = 1,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.directory = directory
        self.device = torch.device(device)
        self.limits = Limits(max_tokens, max_phrases, top_k)
        self.threads = threads
        self.tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32)
        self.model = model.to(self.device).eval()
        lead = self._ids(",")
        if len(lead) != 1:
            raise ValueError(f"expansion model {directory}: its tokenizer spells ',' in {len(lead)} tokens, not one")
        self.separator = lead[0]
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"expansion model {directory}: its tokenizer has no end-of-text token")
        self.eos = int(eos)
        self.phrases = vocabulary.phrases
        self.phrase_words = [words_of(p) for p in self.phrases]
        self.trie = PhraseTrie([self._phrase_ids(p) for p in self.phrases])
        # The key-value cache's argument (and output) was ``past_key_values`` before
        # transformers 5.x named it ``cache``; only the last position's logits are read.
        forward = inspect.signature(self.model.forward).parameters
        self._cache_name = "cache" if "cache" in forward else "past_key_values"
        self._one_logit = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        config = self.model.config
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
        # The context is cut from the front to leave room for the new tokens.
        self.max_context = max(1, int(positions) - max_tokens - 1)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _phrase_ids(self, phrase: str) -> list[int]:
        """The phrase's tokens as they follow a comma in running text (" soft lighting")."""
        after = self._ids(SEPARATOR + phrase)
        return after[1:] if after[:1] == [self.separator] else self._ids(" " + phrase)

    def expand(self, prompt: str, seed: int) -> str:
        context = self._ids(prompt.rstrip(" \t\r\n,") + ",")[-self.max_context :]
        generator = torch.Generator(device="cpu").manual_seed(seed)
        past: list[object] = [None]

        def next_logits(tokens: list[int]) -> torch.Tensor:
            fed = (context if past[0] is None else []) + tokens
            ids = torch.tensor([fed], device=self.device)
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_name: past[0]}, **self._one_logit)
            past[0] = getattr(out, self._cache_name)
            return out.logits[0, -1].float().cpu()

        with torch.inference_mode(), _threads(self.threads):
            chosen = choose_phrases(
                self.trie,
                self.phrase_words,
                words_of(prompt),
                next_logits,
                separator=self.separator,
                eos=self.eos,
                limits=self.limits,
                generator=generator,
            )
        return expanded_text(prompt, [self.phrases[i] for i in chosen])
