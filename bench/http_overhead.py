"""What the HTTP API adds to a job: the same small job, one at a time (light load),
through the gRPC API (SubmitJob, then StreamJob to its images) and through the
HTTP API (a POST of its JSON on a kept-alive connection, its image inline; and the
same through OpenAI's SDK, whose own client-side cost is part of what a user of it
sees), in turn, on one stack; prints each path's median and p90 seconds and the
HTTP paths' median overhead in milliseconds.

    python bench/http_overhead.py [--rounds 200] [--warmup 10]
    python bench/http_overhead.py --smoke    # CI's check that it still runs: one warm-up, 3 rounds

Nothing here is a test; it prints a table for docs/benchmarks.md."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL, PROMPT, SIZE, STEPS = "tiny", "a lighthouse", 64, 1
SMOKE = {"rounds": 3, "warmup": 1}  # p90 needs two rounds at least


def main(argv: list[str] | None = None) -> int:
    import httpx
    import openai

    from services.config.sections import Settings
    from services.ops.stack import LocalStack
    from services.rpc.client import collect_stream
    from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
    from tests.helpers import stub

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10, help="untimed jobs each way first")
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    data = Path(tempfile.mkdtemp(prefix="darkroom-http-"))
    settings = Settings.from_env(
        {
            "DARKROOM_DATA_DIR": str(data),
            "DARKROOM_GATEWAY_PORT": "0",
            "DARKROOM_HTTP_PORT": "0",
            "DARKROOM_LOG_LEVEL": "WARNING",
        }
    )
    stack = LocalStack(settings, cpu_workers=1, decoders=1, durable=False, http=True)
    stack.start()
    grpc_s: list[float] = []
    http_s: list[float] = []
    sdk_s: list[float] = []
    answer_ms: list[float] = []  # the HTTP API's own time after the job, from its Server-Timing
    gateway_ms: list[float] = []  # its calls to the gateway (submit, then the job's stream), from the same
    try:
        client = stub(stack)
        sdk = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="bench", max_retries=0)
        size = f"{SIZE}x{SIZE}"

        def by_grpc(seed: int) -> None:
            request = pb.SubmitJobRequest(model=MODEL, prompt=PROMPT, width=SIZE, height=SIZE, steps=STEPS, seed=seed)
            reply = client.SubmitJob(request)
            job, images = collect_stream(client.StreamJob(pb.StreamJobRequest(job_id=reply.job_id)))
            assert job.status == pb.JOB_STATUS_SUCCEEDED and images

        http = httpx.Client(base_url=stack.http_url)

        def by_http(seed: int) -> None:
            body = {"model": MODEL, "prompt": PROMPT, "size": size, "steps": STEPS, "seed": seed}
            made = http.post("/v1/images/generations", json=body)
            assert made.status_code == 200 and made.json()["data"][0]["b64_json"]
            timing = dict(part.split(";dur=") for part in made.headers["Server-Timing"].split(", "))
            answer_ms.append(float(timing["answer"]))
            gateway_ms.append(float(timing["submit"]) + float(timing["job"]))

        def by_sdk(seed: int) -> None:
            extra = {"steps": STEPS, "seed": seed}
            made = sdk.images.generate(model=MODEL, prompt=PROMPT, size=size, extra_body=extra)
            assert made.data and made.data[0].b64_json

        for i in range(args.warmup):  # warm every path up
            by_grpc(i)
            by_http(i)
            by_sdk(i)
        for i in range(args.rounds):
            for path, into in ((by_grpc, grpc_s), (by_http, http_s), (by_sdk, sdk_s)):
                started = time.perf_counter()
                path(1000 + i)
                into.append(time.perf_counter() - started)
    finally:
        stack.stop()

    def p90(xs: list[float]) -> float:
        return statistics.quantiles(xs, n=10)[-1]

    print(f"{args.rounds} jobs each way, alternating: {MODEL}, {SIZE}x{SIZE}, {STEPS} step")
    print()
    print("| path | median s | p90 s |")
    print("|---|---|---|")
    print(f"| gRPC (SubmitJob + StreamJob) | {statistics.median(grpc_s):.4f} | {p90(grpc_s):.4f} |")
    print(f"| HTTP (POST, JSON) | {statistics.median(http_s):.4f} | {p90(http_s):.4f} |")
    print(f"| HTTP (openai SDK images.generate) | {statistics.median(sdk_s):.4f} | {p90(sdk_s):.4f} |")
    print()
    print(f"http_overhead_ms={1000 * (statistics.median(http_s) - statistics.median(grpc_s)):.2f}")
    print(f"sdk_overhead_ms={1000 * (statistics.median(sdk_s) - statistics.median(grpc_s)):.2f}")
    print(f"http_answer_ms={statistics.median(answer_ms):.2f}  (the HTTP API's own time after the job)")
    print(f"http_gateway_ms={statistics.median(gateway_ms):.2f}  (its calls to the gateway, from its Server-Timing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
