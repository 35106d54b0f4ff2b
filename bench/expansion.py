"""What prompt expansion adds to a submit: per expansion, through the gateway's own
``Expansion`` (its thread, as a submit awaits it), for the template expander, the
tiny GPT-2 (``builtin:tiny-gpt2``: the target is at most 50 ms on the CPU), and
any other model asked for: a transformers directory (``--model DIR``, e.g.
SmolLM2-135M's) or a random-weight model of SmolLM2-135M's architecture
(``--smollm2-random``: what the real one costs a token; its tokenizer is the tiny
GPT-2's, which spells the vocabulary in fewer tokens than SmolLM2's would).

    python bench/expansion.py [--expansions N] [--model DIR ...] [--smollm2-random] [--threads N]
    python bench/expansion.py --smoke    # CI's check that it still runs: 30 expansions each
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.expansion import Expansion
from services.config.safety import ExpansionSettings
from services.safety.vocabulary import SEPARATOR

SMOKE = {"expansions": 30}
# Prompts of the lengths clients send: a few words to a paragraph.
PROMPTS = (
    "a cat",
    "a lighthouse on a cliff at dusk",
    "portrait of an old sailor with a grey beard, wearing a knitted cap",
    "a quiet street in a small european town after the rain, puddles reflecting the shop signs, a cyclist "
    "passing, early morning, the bakery just opening, pigeons on the cobblestones",
)


@dataclass(frozen=True)
class Row:
    expander: str
    model: str
    load_s: float
    times_ms: list[float]
    phrases: float  # added per expansion, on average

    def line(self) -> str:
        ordered = sorted(self.times_ms)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        return (
            f"| {self.expander} | {self.model} | {self.load_s:.2f} | {statistics.median(ordered):.2f} | "
            f"{p99:.2f} | {ordered[-1]:.2f} | {self.phrases:.1f} |"
        )


async def measure(settings: ExpansionSettings, models_dir: Path, label: str, expansions: int) -> Row:
    expansion = Expansion(settings, models_dir)
    started = time.perf_counter()
    await expansion.start(asyncio.Event())
    load_s = time.perf_counter() - started
    times, added = [], 0
    for i in range(expansions):
        prompt = PROMPTS[i % len(PROMPTS)]
        began = time.perf_counter()
        expanded = await expansion.expand(prompt, i)
        times.append((time.perf_counter() - began) * 1000)
        added += len(expanded[len(prompt) :].split(SEPARATOR)) - 1 if expanded != prompt else 0
    await expansion.stop()
    return Row(settings.prompt_expander, label, load_s, times, added / expansions)


def build_smollm2_random(path: Path, tokenizer_from: Path) -> Path:
    """SmolLM2-135M's architecture (its published config) with random weights, and the tiny GPT-2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from), local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


async def run(args: argparse.Namespace, models_dir: Path) -> list[Row]:
    common = {
        "expansion_max_tokens": args.max_tokens,
        "expansion_max_phrases": args.max_phrases,
        "expansion_threads": args.threads,
    }
    rows = [await measure(ExpansionSettings(**common), models_dir, "(none)", args.expansions)]
    tiny = ExpansionSettings(prompt_expander="model", **common)
    rows.append(await measure(tiny, models_dir, "builtin:tiny-gpt2", args.expansions))
    models = [(Path(m), Path(m).name) for m in args.model]
    if args.smollm2_random:
        made = build_smollm2_random(models_dir / "smollm2-135m-random", models_dir / "tiny-gpt2")
        models.append((made, "SmolLM2-135M architecture, random weights"))
    for directory, label in models:
        settings = ExpansionSettings(prompt_expander="model", expansion_model=str(directory), **common)
        rows.append(await measure(settings, models_dir, label, args.expansions))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--expansions", type=int, default=500, help="expansions per expander (seeds 0..N-1)")
    parser.add_argument("--model", action="append", default=[], help="a transformers directory to measure as well")
    parser.add_argument("--smollm2-random", action="store_true", help="measure SmolLM2-135M's architecture too")
    parser.add_argument("--max-tokens", type=int, default=ExpansionSettings().expansion_max_tokens)
    parser.add_argument("--max-phrases", type=int, default=ExpansionSettings().expansion_max_phrases)
    parser.add_argument("--threads", type=int, default=ExpansionSettings().expansion_threads)
    parser.add_argument("--models-dir", help="where builtins are built (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="darkroom-expansion-") as tmp:
        rows = asyncio.run(run(args, Path(args.models_dir) if args.models_dir else Path(tmp)))
    print(
        f"Per expansion, awaited through the gateway's expansion thread, {args.expansions} prompts of 2 to 30 "
        f"words, at most {args.max_phrases} phrases and {args.max_tokens} new tokens, {args.threads} thread(s) "
        f"on a {os.cpu_count()}-core CPU:\n"
    )
    print("| expander | model | load s | p50 ms | p99 ms | max ms | phrases added |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(row.line())
    tiny = rows[1]
    p99 = sorted(tiny.times_ms)[min(len(tiny.times_ms) - 1, round(0.99 * (len(tiny.times_ms) - 1)))]
    print(f"\ntiny GPT-2: p99 {p99:.1f} ms, {'within' if p99 <= 50 else 'over'} the 50 ms target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
