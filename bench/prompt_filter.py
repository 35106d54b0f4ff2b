"""What the prompt filter costs a submit: the filter alone (microseconds per check of
short prompts, of 2,000-character prompts, and of the worst case the filter has,
2,000 characters spelled out letter by letter), and SubmitJob's latency through a
gateway with the filter on and with it off.

    python bench/prompt_filter.py [--checks 5000] [--submits 300]
    python bench/prompt_filter.py --smoke    # CI's check that it still runs: few checks, few submits

The submits go to a gateway in this process (``create_server``: a real gRPC
socket) over a PostgreSQL that the script starts, each submit a job stored, the
gateway's filter turned on and off between them (in turn, each first every other
round), so that nothing but the filter differs. No sampler runs: the queue grows,
under both alike. The client runs on the gateway's own event loop, so what the
filter takes is in the figure once.
Nothing here is a test; it prints tables for docs/benchmarks.md."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOKE = {"checks": 200, "submits": 10}
SHORT = (
    "a lighthouse on a cliff at dusk, oil painting",
    "a red fox in a snowy forest, cinematic lighting",
    "portrait of an old fisherman, dramatic light, 85mm",
    "a cyberpunk city street at night, neon reflections, rain",
    "masterpiece, best quality, 8k, 1girl, solo, school uniform, cherry blossoms",
    "an astronaut riding a horse on mars, photorealistic",
    "a bowl of ramen, studio photo, shallow depth of field",
    "watercolor of a quiet harbour with sailing boats",
    "isometric voxel castle, pastel colours",
    "a cat wearing a tiny wizard hat, digital art",
)
VOCABULARY = (
    "masterpiece best quality highly detailed sharp focus volumetric fog golden hour cinematic lighting "
    "a red fox in a snowy forest by the river under a full moon trending on artstation unreal engine "
    "(ultra realistic:1.2) portrait of a knight in ornate armour matte painting concept art 8k 35mm film grain "
    "bokeh soft light rim light octane render intricate ornaments baroque cathedral interior"
).split()
CHARS = 2000


def long_prompt(rng: random.Random) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) <= CHARS:
        words.append(rng.choice(VOCABULARY) + ("," if rng.random() < 0.25 else ""))
    return " ".join(words)[:CHARS]


def spelled_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(CHARS // 2))[:CHARS]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def time_checks(prompts: list[str], checks: int) -> list[float]:
    """Microseconds per check, each prompt in turn."""
    from services.safety.prompt_filter import PromptFilter

    words = PromptFilter.shipped()
    for prompt in prompts:  # warm
        words.check(prompt)
    times = []
    for i in range(checks):
        prompt = prompts[i % len(prompts)]
        started = time.perf_counter()
        words.check(prompt)
        times.append((time.perf_counter() - started) * 1e6)
    return times


async def time_submits(database_url: str, prompts: dict[str, str], submits: int) -> dict[tuple[str, str], list[float]]:
    """Milliseconds per SubmitJob, by (filter on or off, prompt kind): one gateway,
    its filter turned on and off between submits, so that nothing else differs."""
    import grpc

    from gateway.service import create_server
    from services.config.sections import GatewaySettings, KernelSettings
    from services.db.repository import Repository
    from services.models.registry import ModelRegistry
    from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
    from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc

    repo = Repository(database_url, pool_size=4)
    server, servicer = create_server(
        KernelSettings(database_url=database_url), GatewaySettings(port=0), repo, ModelRegistry.load()
    )
    words = servicer.prompt_filter
    assert words is not None, "the prompt filter is on by default"
    await server.grpc.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = image_generation_pb2_grpc.ImageGenerationStub(channel)
    times: dict[tuple[str, str], list[float]] = {(s, k): [] for s in ("on", "off") for k in prompts}
    try:
        for i in range(-5, submits):  # five rounds untimed (i < 0): connections, caches
            for kind, prompt in prompts.items():
                # Each in turn first: the first of a pair may pay for what the other then finds warm.
                for state in ("on", "off") if i % 2 else ("off", "on"):
                    servicer.prompt_filter = words if state == "on" else None
                    request = pb.SubmitJobRequest(model="tiny", prompt=prompt, width=64, height=64, steps=1, seed=i + 5)
                    started = time.perf_counter()
                    await stub.SubmitJob(request, timeout=30)
                    if i >= 0:
                        times[(state, kind)].append((time.perf_counter() - started) * 1e3)
    finally:
        await channel.close()
        await server.grpc.stop(0)
        await servicer.close()
        await repo.close()
    return times


def filter_table(rng: random.Random, checks: int) -> None:
    kinds = {
        "short": list(SHORT),
        f"{CHARS:,} characters": [long_prompt(rng) for _ in range(10)],
        f"{CHARS:,} characters, spelled out letter by letter (the worst case)": [
            spelled_prompt(rng) for _ in range(10)
        ],
    }
    print(f"{checks} checks of each kind, one after another, on one core")
    print()
    print("| prompts | characters, mean | p50 µs | p99 µs |")
    print("|---|---|---|---|")
    for kind, prompts in kinds.items():
        times = time_checks(prompts, checks)
        mean_chars = statistics.mean(len(p) for p in prompts)
        print(f"| {kind} | {mean_chars:.0f} | {percentile(times, 50):.1f} | {percentile(times, 99):.1f} |")


def submit_table(rng: random.Random, submits: int) -> None:
    from services.db.migrate import upgrade
    from services.ops.embedded import EmbeddedPostgres
    from services.ops.postgres_as_root import discard_clusters_of

    data = Path(tempfile.mkdtemp(prefix="darkroom-prompt-filter-"))
    pg = EmbeddedPostgres(data / "pg", durable=False)
    pg.start()
    prompts = {"short": SHORT[0], f"{CHARS:,} characters": long_prompt(rng)}
    try:
        url = pg.url_of("postgres")
        upgrade(url)
        times = asyncio.run(time_submits(url, prompts, submits))
    finally:
        pg.stop()
        pg.discard()
        discard_clusters_of(data)
    print(f"{submits} SubmitJob calls per row, the gateway's filter on and off in turn")
    print()
    print("| prompt | filter | p50 ms | p99 ms |")
    print("|---|---|---|---|")
    for kind in prompts:
        for state in ("on", "off"):
            xs = times[(state, kind)]
            print(f"| {kind} | {state} | {percentile(xs, 50):.3f} | {percentile(xs, 99):.3f} |")
    print()
    for kind in prompts:
        added = percentile(times[("on", kind)], 50) - percentile(times[("off", kind)], 50)
        print(f"added_p50_ms[{kind}]={added:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=5000, help="filter checks per kind of prompt")
    parser.add_argument("--submits", type=int, default=300, help="timed submits per gateway and kind of prompt")
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    rng = random.Random(33)
    filter_table(rng, args.checks)
    print()
    submit_table(rng, args.submits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
