"""The fleet compile cache's key: every part of what makes a compilation valid moves
it, nothing else does, and it is the same in any process (tests/integration/
test_compile_cache.py runs the cache itself against a real store)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import torch

from services.models import speed
from services.models.compile_cache import CompileKey, compile_key, content_digest

REPO = Path(__file__).resolve().parents[2]
KEY = compile_key("content", torch.device("cpu"), speed.SpeedOptions(compile=True), "inductor", (64, 64, [1, 2]))


def test_every_part_of_the_key_moves_its_digest() -> None:
    for f in fields(CompileKey):
        assert replace(KEY, **{f.name: getattr(KEY, f.name) + "x"}).digest() != KEY.digest(), f.name
    for other in (speed.SpeedOptions(), speed.SpeedOptions(compile=True, channels_last=True)):
        assert compile_key("content", torch.device("cpu"), other, "inductor", (64, 64, [1, 2])) != KEY, other


def test_the_digest_is_the_same_in_every_process() -> None:
    code = (
        "import torch; from services.models import speed; from services.models.compile_cache import compile_key; "
        "print(compile_key('content', torch.device('cpu'), speed.SpeedOptions(compile=True), 'inductor', "
        "(64, 64, [1, 2])).digest())"
    )
    for seed in ("0", "123"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == KEY.digest()


def test_a_models_content_is_its_files_and_its_configs_bytes(tmp_path: Path) -> None:
    (tmp_path / "unet").mkdir()
    config, weights = tmp_path / "unet" / "config.json", tmp_path / "unet" / "weights.safetensors"
    config.write_text('{"layers": 2}')
    weights.write_bytes(b"\0" * 100)
    before = content_digest(tmp_path)
    os.utime(weights, (1, 1))
    assert content_digest(tmp_path) == before  # when it was copied is not what it is
    config.write_text('{"layers": 3}')
    changed_config = content_digest(tmp_path)
    weights.write_bytes(b"\0" * 101)
    assert len({before, changed_config, content_digest(tmp_path)}) == 3
