"""The prompt processor's settings (``services/safety``): what is checked, where, and
what a flag does; and how prompts are expanded. docs/safety.md says what each verdict
does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.config.fields import Codec, Section, setting

# What the image filter's flag does to an output: withheld, blurred, or only marked.
OUTPUT_POLICIES = ("block", "blur", "flag")


def _policy(value: Any) -> str:
    policy = str(value).strip()
    if policy not in OUTPUT_POLICIES:
        raise ValueError(f"{policy!r} is not one of {', '.join(OUTPUT_POLICIES)}")
    return policy


def _lane_policies_from_text(raw: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for entry in raw.split(","):
        if entry.strip():
            try:
                lane, policy = entry.split(":")
            except ValueError:
                raise ValueError(f"entry {entry.strip()!r}: expected lane:policy") from None
            pairs.append((lane.strip(), _policy(policy)))
    return tuple(pairs)


def _lane_policies_from_toml(table: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(table, dict):
        raise ValueError("expected a table of lane = policy")
    return tuple((lane, _policy(policy)) for lane, policy in table.items())


LANE_POLICIES = Codec(
    "lane:policy (block, blur or flag), comma-separated",
    _lane_policies_from_text,
    _lane_policies_from_toml,
    lambda pairs: ",".join(f"{lane}:{policy}" for lane, policy in pairs),
)


@dataclass(frozen=True)
class SafetySettings(Section):
    """The prompt filter (the gateway), the image filter (the decoders, and a sampler
    decoding its own latents) and what its flag does."""

    prompt_filter: bool = setting(
        True, "Refuse a prompt that the word and phrase list matches, before anything is stored or charged."
    )
    prompt_filter_words: str = setting(
        "",
        "A file of the operator's own words and phrases to refuse, one per line ('#' starts a comment; a line "
        "[sexual] makes the lines after it sexual too, [profanity] profanity only), added to the shipped list "
        "(docs/safety.md). Empty: the shipped list alone.",
    )
    image_filter: bool = setting(
        True, "Score every output with the NSFW classifier after it is decoded and before it is stored."
    )
    image_filter_threshold: float = setting(
        0.8, "The NSFW score (0..1) from which an output or a moderated image is flagged.", at_least=0.0, at_most=1.0
    )
    output_policies: tuple[tuple[str, str], ...] = setting(
        (("free", "block"),),
        "What a flag does to the outputs of each lane's jobs: block (withheld), blur, or flag (returned as made, "
        "marked); a lane not named: flag. A tenant's own policy (darkroom tenants) overrides its lane's.",
        codec=LANE_POLICIES,
    )

    def policy_for(self, lane: str) -> str:
        """The lane's policy: what its jobs' flagged outputs get unless their tenant says otherwise."""
        return dict(self.output_policies).get(lane, "flag")


# Which expander the gateway runs: template (no model), model (a causal language
# model), or off (a request asking for expansion is refused).
EXPANDERS = ("template", "model", "off")


@dataclass(frozen=True)
class ExpansionSettings(Section):
    """Prompt expansion at the gateway (services/safety/expansion.py): a prompt made more
    detailed with phrases of a vocabulary, seeded by the job's seed, once per job."""

    prompt_expander: str = setting(
        "template",
        "What expands a prompt that asks for it (SubmitJobRequest.expand_prompt, or its tenant's default): "
        "template (phrases of the vocabulary drawn by the seed, no model), model (EXPANSION_MODEL, held to the "
        "vocabulary), or off (a request asking for it is refused).",
        choices=EXPANDERS,
    )
    expansion_model: str = setting(
        "builtin:tiny-gpt2",
        "The causal language model of the model expander: a local transformers directory (e.g. SmolLM2-135M's), "
        "or builtin:tiny-gpt2 (random weights, built into DATA_DIR/models on first use: for tests).",
    )
    expansion_vocabulary: str = setting(
        "",
        "A file of the words and phrases expansion may add, one per line ('[kind]' starts a kind, '#' a "
        "comment). Empty: the shipped list (quality, lighting, composition, medium, colour, mood, style).",
    )
    expansion_max_phrases: int = setting(6, "The most phrases an expansion adds.", at_least=1, at_most=64)
    expansion_max_tokens: int = setting(
        24, "The model expander's most new tokens per expansion (a phrase cut short is dropped).", at_least=1
    )
    expansion_top_k: int = setting(
        8, "The model expander samples each token among the k likeliest the vocabulary allows.", at_least=1
    )
    expansion_device: str = setting(
        "cpu", "Where the model expander runs: cpu, or cuda where the gateway has a GPU.", choices=("cpu", "cuda")
    )
    expansion_threads: int = setting(
        1,
        "CPU threads the model expander runs on: 1 suits a small model, whose steps are too short to share.",
        at_least=1,
    )
