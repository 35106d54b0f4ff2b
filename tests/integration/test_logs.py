"""Structured logs from a real stack: every line any service writes about a job
carries the job's id (and its attempt where one is running)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.ops.embedded import EmbeddedPostgres
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import stub, wait_terminal

pytestmark = pytest.mark.integration


def test_every_line_about_a_job_names_it(tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path) -> None:
    stack = make_stack(tmp_path, postgres, models_dir, log_level="DEBUG")
    stack.start()
    try:
        client = stub(stack)
        job_ids = [
            client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt=f"job {i}", width=64, height=64, steps=2)).job_id
            for i in range(2)
        ]
        for job_id in job_ids:
            assert wait_terminal(client, job_id).status == pb.JOB_STATUS_SUCCEEDED
        streamed = list(client.StreamJob(pb.StreamJobRequest(job_id=job_ids[0]), timeout=30))
        assert streamed[-1].terminal.status == pb.JOB_STATUS_SUCCEEDED
    finally:
        stack.stop()

    about: dict[str, list[dict[str, object]]] = {job_id: [] for job_id in job_ids}
    for log in sorted(stack.log_dir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue  # not Darkroom's (grpc's C core writes its own lines to stderr)
            entry = json.loads(line)
            assert {"time", "level", "service", "logger", "message"} <= set(entry), line
            for job_id in job_ids:
                if job_id in str(entry["message"]):
                    about[job_id].append(entry)
                    named = entry.get("job_id") == job_id or job_id in entry.get("job_ids", [])  # type: ignore[operator]
                    assert named, f"{log.name}: a line about {job_id} does not name it: {line}"
    for job_id, entries in about.items():
        done = [e for e in entries if e["service"] == "sampler" and "done" in str(e["message"])]
        assert done, f"the sampler never said it finished {job_id}"
        assert all(e["attempt"] == 1 for e in done)
