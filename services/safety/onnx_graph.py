"""An ONNX convolutional classifier run as a torch module, on any device torch has:
so that the image filter scores on the decoder's GPU, beside the VAE, without
onnxruntime's CUDA build (a separate package, which cannot sit beside the CPU one).

The file is read straight from protobuf's wire format (the few fields a graph of
tensors, nodes and attributes needs), so the ``onnx`` package is not needed. The
operators are the ones open_nsfw's graph uses (opset 9); any other, or an attribute
of theirs this does not run, is refused by name as the network is built (as its
process starts), never met halfway through a job."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.errors import DarkroomError

OPERATORS = frozenset({"Add", "AveragePool", "Conv", "MatMul", "MaxPool", "Relu", "Reshape", "Softmax", "Transpose"})
# TensorProto.DataType values this reads.
_FLOAT, _INT64 = 1, 7


class OnnxFormatError(DarkroomError):
    """The file is not an ONNX graph this module can run."""


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    tensors: dict[str, np.ndarray]
    input: str
    output: str


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field of one message."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 2:
            length, i = _varint(buf, i)
            value, i = buf[i : i + length], i + length
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            raise OnnxFormatError(f"unsupported protobuf wire type {wire}")
        if i > len(buf):
            raise OnnxFormatError("truncated")
        yield number, wire, value


def _ints(wire: int, value: Any) -> list[int]:
    """A repeated int64 field's values, packed or not."""
    if wire == 0:
        return [_signed(value)]
    out, i = [], 0
    while i < len(value):
        v, i = _varint(value, i)
        out.append(_signed(v))
    return out


def _tensor(buf: memoryview) -> tuple[str, np.ndarray]:
    name, dims, dtype, raw, floats, int64s = "", [], 0, b"", [], []
    for number, wire, value in _fields(buf):
        if number == 1:
            dims += _ints(wire, value)
        elif number == 2:
            dtype = value
        elif number == 4:
            floats += list(struct.unpack(f"<{len(value) // 4}f", value)) if wire == 2 else [value]
        elif number == 7:
            int64s += _ints(wire, value)
        elif number == 8:
            name = bytes(value).decode()
        elif number == 9:
            raw = bytes(value)
    if dtype == _FLOAT:
        array = np.frombuffer(raw, dtype="<f4") if raw else np.asarray(floats, dtype=np.float32)
    elif dtype == _INT64:
        array = np.frombuffer(raw, dtype="<i8") if raw else np.asarray(int64s, dtype=np.int64)
    else:
        raise OnnxFormatError(f"tensor {name!r}: data type {dtype} is not float32 or int64")
    return name, array.reshape(dims).copy()


def _attribute(buf: memoryview) -> tuple[str, Any]:
    name, value_of = "", None
    ints: list[int] = []
    for number, wire, value in _fields(buf):
        if number == 1:
            name = bytes(value).decode()
        elif number == 2:
            value_of = struct.unpack("<f", value)[0]
        elif number == 3:
            value_of = _signed(value)
        elif number == 4:
            value_of = bytes(value).decode()
        elif number == 8:
            ints += _ints(wire, value)
    return name, tuple(ints) if value_of is None else value_of


def _node(buf: memoryview) -> Node:
    op, inputs, outputs, attributes = "", [], [], {}
    for number, _, value in _fields(buf):
        if number == 1:
            inputs.append(bytes(value).decode())
        elif number == 2:
            outputs.append(bytes(value).decode())
        elif number == 4:
            op = bytes(value).decode()
        elif number == 5:
            key, attribute = _attribute(value)
            attributes[key] = attribute
    if op not in OPERATORS:
        raise OnnxFormatError(f"operator {op!r} is not one this runs ({', '.join(sorted(OPERATORS))})")
    return Node(op, tuple(inputs), tuple(outputs), attributes)


def _value_name(buf: memoryview) -> str:
    return next(bytes(value).decode() for number, _, value in _fields(buf) if number == 1)


def read_graph(path: Path) -> Graph:
    """The graph of an ONNX file: its nodes in order, its weights, its one input and
    output. OnnxFormatError, naming the file, for anything else."""
    try:
        return _read_graph(path)
    except OnnxFormatError as exc:
        raise OnnxFormatError(f"{path}: {exc}") from exc
    except (IndexError, ValueError, UnicodeDecodeError, struct.error, StopIteration) as exc:
        raise OnnxFormatError(f"{path}: not an ONNX file ({type(exc).__name__}: {exc})") from exc


def _read_graph(path: Path) -> Graph:
    model = memoryview(path.read_bytes())
    graph = next((value for number, _, value in _fields(model) if number == 7), None)
    if graph is None:
        raise OnnxFormatError("no graph")
    nodes, tensors, inputs, outputs = [], {}, [], []
    for number, _, value in _fields(graph):
        if number == 1:
            nodes.append(_node(value))
        elif number == 5:
            name, array = _tensor(value)
            tensors[name] = array
        elif number == 11:
            inputs.append(_value_name(value))
        elif number == 12:
            outputs.append(_value_name(value))
    inputs = [name for name in inputs if name not in tensors]  # older files list weights as inputs
    if len(inputs) != 1 or len(outputs) != 1:
        raise OnnxFormatError(f"{len(inputs)} inputs and {len(outputs)} outputs, not one of each")
    return Graph(tuple(nodes), tensors, inputs[0], outputs[0])


def _pads(attributes: dict[str, Any]) -> tuple[int, int, int, int]:
    """ONNX's (top, left, bottom, right) as F.pad's (left, right, top, bottom)."""
    top, left, bottom, right = attributes.get("pads", (0, 0, 0, 0))
    return (left, right, top, bottom)


class OnnxNetwork(torch.nn.Module):
    """The graph's nodes run in the file's order, its weights as buffers (moved with
    ``.to(device)``)."""

    def __init__(self, graph: Graph) -> None:
        super().__init__()
        self.nodes = graph.nodes
        self.input, self.output = graph.input, graph.output
        # Integer tensors are shapes: kept on the host, so a Reshape reads no device.
        self._shapes = {
            name: tuple(int(d) for d in a.reshape(-1)) for name, a in graph.tensors.items() if a.dtype.kind == "i"
        }
        weights = [name for name in graph.tensors if name not in self._shapes]
        self._slots = {name: f"w{n}" for n, name in enumerate(weights)}
        for name in weights:
            self.register_buffer(self._slots[name], torch.from_numpy(graph.tensors[name]))
        for node in self.nodes:
            self._check(node)

    def _check(self, node: Node) -> None:
        """What of a node's attributes this runs, refused as the file is read."""
        a = node.attributes
        if node.op in ("AveragePool", "Conv", "MaxPool") and a.get("auto_pad", "NOTSET") != "NOTSET":
            raise OnnxFormatError(f"{node.op}: auto_pad {a['auto_pad']!r} is not supported")
        if node.op in ("AveragePool", "MaxPool") and a.get("ceil_mode", 0):
            raise OnnxFormatError(f"{node.op}: ceil_mode is not supported")
        if node.op == "AveragePool" and any(_pads(a)):
            raise OnnxFormatError("AveragePool with padding is not supported")
        if node.op == "Reshape" and node.inputs[1] not in self._shapes:
            raise OnnxFormatError(f"Reshape to {node.inputs[1]!r}: only a constant shape is supported")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values: dict[str, torch.Tensor] = {self.input: x}

        def get(name: str) -> torch.Tensor:
            slot = self._slots.get(name)
            return getattr(self, slot) if slot is not None else values[name]

        for node in self.nodes:
            if node.op == "Reshape":
                x, shape = get(node.inputs[0]), self._shapes[node.inputs[1]]
                # ONNX's 0: that dimension of the input, as it is.
                values[node.outputs[0]] = x.reshape([x.shape[i] if d == 0 else d for i, d in enumerate(shape)])
            else:
                values[node.outputs[0]] = self._run(node, [get(name) for name in node.inputs])
        return values[self.output]

    @staticmethod
    def _run(node: Node, args: list[torch.Tensor]) -> torch.Tensor:
        a = node.attributes
        if node.op == "Conv":
            stride, dilation = a.get("strides", (1, 1)), a.get("dilations", (1, 1))
            left, right, top, bottom = _pads(a)
            x = args[0]
            if (left, top) != (right, bottom):
                x, padding = F.pad(x, (left, right, top, bottom)), (0, 0)
            else:
                padding = (top, left)
            bias = args[2] if len(args) > 2 else None
            return F.conv2d(x, args[1], bias, stride, padding, dilation, a.get("group", 1))
        if node.op == "MaxPool":
            x = F.pad(args[0], _pads(a), value=float("-inf"))
            return F.max_pool2d(x, a["kernel_shape"], a.get("strides", a["kernel_shape"]))
        if node.op == "AveragePool":
            return F.avg_pool2d(args[0], a["kernel_shape"], a.get("strides", a["kernel_shape"]))
        if node.op == "Relu":
            return F.relu(args[0])
        if node.op == "Add":
            return args[0] + args[1]
        if node.op == "MatMul":
            return args[0] @ args[1]
        if node.op == "Transpose":
            return args[0].permute(*a["perm"])
        # Softmax before opset 13: over everything from ``axis`` on, as one row.
        x = args[0]
        axis = a.get("axis", 1) % x.dim()
        return F.softmax(x.flatten(axis), dim=-1).reshape(x.shape)
