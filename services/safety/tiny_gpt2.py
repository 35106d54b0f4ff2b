"""A tiny GPT-2 with random weights and a byte-level BPE tokenizer, built here, for
the model expander's tests and benchmark (``builtin:tiny-gpt2``).

It exists, as the tiny diffusion model does (``services.models.tiny``), so that the
real loading path runs on a machine with no network to model hubs: it is saved
as a transformers directory and read back with ``AutoModelForCausalLM`` and
``AutoTokenizer``, as SmolLM2-135M's directory would be. Its tokenizer is trained
on the shipped vocabulary, so that most phrases are a token or two a word, as they
are for a real model's; any text still tokenizes (every byte is a token). Its
weights are random: its choice among the vocabulary's phrases is arbitrary, but
seeded, which is all a test needs."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

TINY_GPT2_MARKER = "darkroom_tiny_gpt2.json"
EOS = "<|endoftext|>"


def build_tiny_gpt2(path: Path, *, seed: int = 0) -> Path:
    """Builds the model and its tokenizer as a transformers directory at ``path``; the
    same files for the same seed (the tokenizer's training is deterministic)."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Tokenizer

    from services.safety.vocabulary import SEPARATOR, Vocabulary

    phrases = Vocabulary.shipped().phrases
    bpe = ByteLevelBPETokenizer()
    # Phrases as they follow a prompt: after ", ", so that words are learnt with
    # their leading space, as GPT-2's are.
    bpe.train_from_iterator(
        [SEPARATOR + p for p in phrases], vocab_size=1024, min_frequency=1, special_tokens=[EOS], show_progress=False
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file, merges_file = bpe.save_model(tmp)
        tokenizer = GPT2Tokenizer(vocab_file, merges_file, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    tokenizer.model_max_length = 256
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=256,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    (path / TINY_GPT2_MARKER).write_text(json.dumps({"seed": seed, "note": "random weights: its choice is arbitrary"}))
    return path
