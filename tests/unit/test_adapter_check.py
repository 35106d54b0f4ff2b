"""How the gateway reads the end of an uploaded adapter's check, run in a process of
its own (a stand-in for it here): what the check found; the check's refusal, and a
reader that crashed on the file (twice), the file's fault (INVALID_ARGUMENT naming
`file`), a reader that crashed once looked at again;
a check killed otherwise or ended without an answer (the kernel short of memory, a
broken install) nobody's fault, to be retried; a check past its deadline killed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.adapter_files import Checked, check, check_framing
from services.errors import InvalidArgument, ResourceExhausted

STAND_IN = "tests.integration.children.adapter_check"


def run(tmp_path: Path, request: dict[str, Any], timeout_s: float = 60.0) -> Checked:
    return asyncio.run(check(request, tmp_path, timeout_s, module=STAND_IN))


def test_what_the_check_found_and_what_it_refused(tmp_path: Path) -> None:
    found = run(tmp_path, {"answer": {"rank": 4, "layers": 10, "skipped": ["text_encoder"]}})
    assert found == Checked(4, 10, ("text_encoder",))
    with pytest.raises(InvalidArgument, match="rank is 32") as refused:
        run(tmp_path, {"answer": {"error": "the adapter's rank is 32"}, "exit": 1})
    assert [v.field for v in refused.value.violations] == ["file"]


def test_a_reader_that_crashed_on_the_file_is_the_files_fault(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="SIGSEGV"):
        run(tmp_path, {"signal": "SIGSEGV"})


def test_a_reader_that_crashed_once_is_looked_at_again(tmp_path: Path) -> None:
    """A crash the file does not cause again (a reader's own) is not the file's."""
    found = run(tmp_path, {"crash_once": "SIGSEGV", "answer": {"rank": 4, "layers": 10, "skipped": []}})
    assert found == Checked(4, 10, ())
    assert (tmp_path / "check.crashed").exists()  # it did crash the first time


@pytest.mark.parametrize("end", [{"signal": "SIGKILL"}, {"exit": 1}])
def test_a_check_that_could_not_run_to_its_end_is_retried(tmp_path: Path, end: dict[str, Any]) -> None:
    with pytest.raises(ResourceExhausted) as busy:
        run(tmp_path, end)
    assert busy.value.retry_after_s is not None


def test_a_check_past_its_deadline_is_killed_and_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="longer than 1s"):
        run(tmp_path, {"signal": "SIGSTOP"}, timeout_s=1.0)


def framed(header: bytes, data: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + data


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "no header"),
        (b"\xff" * 64, "no header"),
        (framed(b"[1, 2]"), "no JSON object"),
        (framed(b"{not json}"), "no JSON object"),
        (framed(b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', b"\0" * 8), "past the file's end"),
        (framed(b'{"w": {"dtype": "F32", "shape": [4]}}'), "tensor 'w'"),
    ],
)
def test_what_is_not_framed_as_safetensors_is_refused_before_any_check_runs(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = tmp_path / "adapter.safetensors"
    path.write_bytes(content)
    with pytest.raises(InvalidArgument, match=why) as refused:
        check_framing(path)
    assert [v.field for v in refused.value.violations] == ["file"]


def test_a_safetensors_file_passes_its_framing(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "adapter.safetensors"
    save_file({"unet.a.lora_A.weight": torch.zeros(4, 8)}, path, metadata={"format": "pt"})
    check_framing(path)
