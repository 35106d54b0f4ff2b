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
        "A file of the operator's own words and phrases to refuse, one per line ('#' starts a comment), added to "
        "the shipped list. Empty: the shipped list alone.",
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
