"""Parallel shapes as the registry reads them, which family takes which mode, the
shapes a group serves, and which of a host's devices form groups: pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_worker.group.engines import tiles_video
from services.errors import ModelError
from services.generation import JobShape
from services.models.parallel import Parallelism, shapes_of, splits_heads
from services.models.parallel_miniatures import twins, write_registry
from services.models.registry import ModelRegistry
from services.ops.gpu_groups import GroupPlanError, group_name, plan_groups


def registry_of(tmp_path: Path, body: str) -> ModelRegistry:
    path = tmp_path / "registry.toml"
    path.write_text("[models.m]\n" + body + "\n")
    return ModelRegistry.load(path)


@pytest.mark.parametrize(
    ("body", "shape"),
    [
        ('family = "flux"\nsource = "builtin:tiny-flux"\nsize_step = 16\nparallel = { sequence = 2 }', "sequence=2"),
        ('family = "tiny"\nsource = "builtin:tiny"\nparallel = { cfg = 2 }', "cfg=2"),
        (
            'family = "wan"\nsource = "builtin:tiny-wan"\nsize_step = 16\nmax_frames = 9\ndefault_frames = 9\n'
            "frames_step = 4\ndefault_fps = 8\nparallel = { sequence = 2, cfg = 2 }",
            "sequence=2,cfg=2",
        ),
        (
            'family = "flux"\nsource = "builtin:tiny-flux"\nsize_step = 16\nparallel = { tensor = 2, sequence = 2 }',
            "sequence=2,tensor=2",
        ),
        ('family = "tiny"\nsource = "builtin:tiny"\ncompile = true\nparallel = { tensor = 2 }', "tensor=2"),
        ('family = "tiny"\nsource = "builtin:tiny"\nadapter_slots = 4\nparallel = { tensor = 2 }', "tensor=2"),
        ('family = "tiny"\nsource = "builtin:tiny"', "single"),
    ],
)
def test_the_registry_reads_a_parallel_shape(tmp_path: Path, body: str, shape: str) -> None:
    read = registry_of(tmp_path, body).get("m").parallel
    assert read.describe() == shape and Parallelism.parse(shape) == read


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (
            'family = "sd3"\nsource = "builtin:tiny-sd3"\nsize_step = 16\nparallel = { sequence = 2 }',
            "parallel.sequence",
        ),
        ('family = "flux"\nsource = "builtin:tiny-flux"\nsize_step = 16\nparallel = { cfg = 2 }', "parallel.cfg"),
        ('family = "sd_x4_upscaler"\nsource = "builtin:tiny-upscaler"\nparallel = { tensor = 2 }', "parallel.tensor"),
        (
            'family = "sd3"\nsource = "builtin:tiny-sd3"\nsize_step = 16\nparallel = { tensor = 2, sequence = 2 }',
            "parallel.sequence",
        ),
        ('family = "tiny"\nsource = "builtin:tiny"\nfuse_qkv = true\nparallel = { tensor = 2 }', "fuse_qkv"),
        ('family = "tiny"\nsource = "builtin:tiny"\nquantize = "int8"\nparallel = { tensor = 2 }', "quantize"),
        ('family = "tiny"\nsource = "builtin:tiny"\nparallel = { cfg = 3 }', "1 or 2"),
        ('family = "tiny"\nsource = "builtin:tiny"\nparallel = { cfg = true }', "whole number"),
        ('family = "tiny"\nsource = "builtin:tiny"\nparallel = { pipeline = 2 }', "unknown modes"),
        ('family = "tiny"\nsource = "builtin:tiny"\nparallel = 2', "a table"),
        ('family = "flux"\nsource = "builtin:tiny-flux"\nsize_step = 16\nparallel = { sequence = 16 }', "1..8"),
        (
            'family = "flux"\nsource = "builtin:tiny-flux"\nsize_step = 16\ncompile = true\ncuda_graphs = true\n'
            "parallel = { sequence = 2 }",
            "cuda_graphs",
        ),
    ],
)
def test_a_shape_that_cannot_be_served_is_refused_by_name(tmp_path: Path, body: str, named: str) -> None:
    with pytest.raises(ModelError, match=f"model 'm': .*{named}"):
        registry_of(tmp_path, body)


@pytest.mark.parametrize(
    ("family", "shape", "adapter_slots", "by_heads"),
    [
        ("flux", Parallelism(tensor=2), 0, True),
        ("qwen_image", Parallelism(cfg=2, tensor=2), 0, True),
        ("flux", Parallelism(tensor=2), 8, False),  # an adapter wraps a whole projection
        ("flux", Parallelism(sequence=2, tensor=2), 0, False),  # Ulysses would split the heads again
        ("wan", Parallelism(tensor=2), 0, False),  # no plan
        ("flux", Parallelism(sequence=2), 0, False),  # nothing sharded
    ],
)
def test_a_sharded_model_is_split_by_heads_where_its_plan_can_run(
    family: str, shape: Parallelism, adapter_slots: int, by_heads: bool
) -> None:
    assert splits_heads(family, shape, adapter_slots) is by_heads


def test_a_group_serves_every_shape_of_its_size() -> None:
    assert shapes_of(2) == [Parallelism(sequence=2), Parallelism(tensor=2), Parallelism(cfg=2)]
    assert shapes_of(4) == [
        Parallelism(sequence=4),
        Parallelism(tensor=4),
        Parallelism(sequence=2, cfg=2),
        Parallelism(cfg=2, tensor=2),
        Parallelism(sequence=2, tensor=2),
    ]
    assert shapes_of(3) == [Parallelism(sequence=3), Parallelism(tensor=3)]
    # Every shape the registry takes (cfg 1 or 2, any sequence and tensor) of each size, once.
    for size in range(2, 9):
        every = {
            Parallelism(sequence=size // (cfg * tensor), cfg=cfg, tensor=tensor)
            for cfg in (1, 2)
            for tensor in range(1, size + 1)
            if size % (cfg * tensor) == 0
        }
        assert len(shapes_of(size)) == len(set(shapes_of(size))) and set(shapes_of(size)) == every, size


WANS = ("tiny-wan", "tiny-wan22")


def test_the_miniatures_twins_load_and_split_no_more_than_their_two_heads(tmp_path: Path) -> None:
    registry = ModelRegistry.load(write_registry(tmp_path / "r.toml", 4))
    grouped = {name: registry.get(name).parallel for name in twins(4)}
    assert grouped == {
        "tiny-wan-sequence2-cfg2": Parallelism(sequence=2, cfg=2),
        "tiny-wan22-sequence2-cfg2": Parallelism(sequence=2, cfg=2),
        "tiny-qwen-image-sequence2-cfg2": Parallelism(sequence=2, cfg=2),
        **{f"{base}-tensor4": Parallelism(tensor=4) for base in (*WANS, "tiny", "tiny-flux", "tiny-qwen-image")},
        **{f"{base}-cfg2-tensor2": Parallelism(cfg=2, tensor=2) for base in (*WANS, "tiny", "tiny-qwen-image")},
        **{
            f"{base}-sequence2-tensor2": Parallelism(sequence=2, tensor=2)
            for base in (*WANS, "tiny-flux", "tiny-qwen-image")
        },
    }


@pytest.mark.parametrize(
    ("spec", "devices", "sizes", "groups"),
    [
        ("auto", 8, {1, 4}, [(4, 5, 6, 7)]),  # a host of 8 keeps four single
        ("auto", 8, {1, 2, 4}, [(4, 5, 6, 7)]),
        ("auto", 2, {1, 2}, [(0, 1)]),
        ("auto", 1, {1, 2}, []),  # too few devices for any
        ("auto", 8, {1}, []),  # no parallel model
        ("auto", 4, {8, 2}, [(2, 3)]),  # the largest that fits
        ("off", 8, {4}, []),
        ("0-1,4-7", 8, {4}, [(0, 1), (4, 5, 6, 7)]),
    ],
)
def test_a_host_forms_the_groups_its_setting_says(
    spec: str, devices: int, sizes: set[int], groups: list[tuple[int, ...]]
) -> None:
    assert plan_groups(spec, devices, sizes) == groups


@pytest.mark.parametrize(
    ("spec", "named"),
    [("0-8", "names device 8"), ("0-1,1-2", "overlaps"), ("2-1", "not a range"), ("x", "not a range")],
)
def test_groups_that_cannot_be_formed_are_refused_by_name(spec: str, named: str) -> None:
    with pytest.raises(GroupPlanError, match=f"DARKROOM_GPU_GROUPS: .*{named}"):
        plan_groups(spec, 8, {2})


def test_a_group_s_worker_id_names_its_devices() -> None:
    assert group_name("gpu", (4, 5, 6, 7)) == "gpus4-7"


def test_auto_picks_the_best_connected_devices() -> None:
    """Eight cards as two NVLink islands (0-3 and 4-7) under one PCIe switch each:
    a group of four is an island; of two, a pair of one island, the highest-numbered."""

    def distance(a: int, b: int) -> int:
        return 0 if a // 4 == b // 4 else 50

    assert plan_groups("auto", 8, {4}, distance) == [(4, 5, 6, 7)]
    assert plan_groups("auto", 8, {2}, distance) == [(6, 7)]
    # Only 1-2 and 5-6 share a switch (10); the rest across the host bridge (30).
    pcie = {frozenset({1, 2}): 10, frozenset({5, 6}): 10}
    assert plan_groups("auto", 8, {2}, lambda a, b: pcie.get(frozenset({a, b}), 30)) == [(5, 6)]


@pytest.mark.parametrize(
    ("width", "height", "frames", "kept"),
    [(1280, 720, 81, True), (1280, 720, 1, False), (832, 480, 81, False), (1024, 1024, 17, True)],
)
def test_a_group_decodes_itself_only_the_videos_that_tile(width: int, height: int, frames: int, kept: bool) -> None:
    """Below the tiling size a video decodes frame chunk by frame chunk, each on the
    last, which does not split across ranks: a decoder service takes it."""
    shape = JobShape("wan", width, height, 30, 5.0, 1, frames)
    assert tiles_video(shape, tile_above_pixels=832 * 480) is kept
