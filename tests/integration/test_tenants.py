"""Tenants and keys made with the `darkroom` command, used through the running
stack's gateway: a job belongs to the tenant whose key submitted it, another
tenant reads, streams and cancels it as a job that does not exist, a tenant's
lane bounds the lanes it may ask for, idempotency keys are per tenant, ListJobs
pages through the caller's own jobs, GetStats shows the fleet to admin keys only,
and a revoked key is refused within a second."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest

from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.helpers import cli_here, metrics_text, stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration


def darkroom(stack: LocalStack, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DARKROOM_DATABASE_URL": stack.settings.kernel.database_url}
    done = cli_here(env, *args)
    if check:
        assert done.returncode == 0, done.stderr
    if args[:2] == ("tenants", "create") and done.returncode == 0:
        # The gateway closes within a second of the first tenant; until then a key is
        # not looked at (the call is anonymous), so the caller waits for it, as a
        # process of its own used to by starting.
        wait_closed(stack, timeout=10)
    return done


def wait_closed(stack: LocalStack, *, timeout: float) -> None:
    """Until the gateway refuses a call without a key."""
    client = stub(stack)
    wait_for(
        lambda: outcome_of(lambda: client.ListModels(pb.ListModelsRequest())),
        lambda code: code == grpc.StatusCode.UNAUTHENTICATED,
        timeout=timeout,
        what="the gateway to close",
    )


def as_key(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def job(**fields: Any) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(
        **{"model": "tiny", "prompt": "a tenant's cat", "width": 64, "height": 64, "steps": 2, **fields}
    )


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def outcome_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    """The call's status code: OK where it is answered."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def details_of(call) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def quota_refusal(call) -> tuple[Any, Any]:  # type: ignore[no-untyped-def]
    """The QuotaFailure and RetryInfo of a call refused with RESOURCE_EXHAUSTED."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(err.value)
    assert status is not None
    details = {d.type_url.rsplit("/", 1)[-1]: d for d in status.details}
    quota, retry = error_details_pb2.QuotaFailure(), error_details_pb2.RetryInfo()
    details["google.rpc.QuotaFailure"].Unpack(quota)
    details["google.rpc.RetryInfo"].Unpack(retry)
    return quota, retry


@pytest.fixture(scope="module")
def keys(stack: LocalStack) -> Iterator[dict[str, str]]:
    """Tenants ``cats`` (free lane) and ``dogs`` (paid lane), a key for each and an
    admin key for dogs, made with the CLI once the open gateway has taken a job."""
    client = stub(stack)
    # No tenants yet: the gateway is open, for local use, as before.
    assert client.SubmitJob(job()).job_id
    darkroom(stack, "tenants", "create", "cats", "--lane", "free", "--max-jobs", "50")
    darkroom(stack, "tenants", "create", "dogs", "--lane", "paid")
    made = {
        name: darkroom(stack, "keys", "create", tenant, *extra).stdout.strip().splitlines()[-1]
        for name, tenant, extra in (("cats", "cats", ()), ("dogs", "dogs", ()), ("dogs-admin", "dogs", ("--admin",)))
    }
    yield made


def test_keys_are_shown_once_and_stored_as_digests(stack: LocalStack, keys: dict[str, str]) -> None:
    listed = darkroom(stack, "keys", "list", "dogs").stdout
    key_ids = [line.split()[1].rstrip(":") for line in listed.splitlines()]
    assert len(key_ids) == 2 and "admin" in listed
    for key in keys.values():
        assert key.startswith("drk_") and key not in listed
    assert all(keys["dogs"] not in line for line in darkroom(stack, "tenants", "show", "dogs").stdout.splitlines())
    refused = darkroom(stack, "tenants", "create", "birds", "--lane", "gold", check=False)
    assert refused.returncode == 2 and "unknown lane 'gold'" in refused.stderr
    assert "birds" not in darkroom(stack, "tenants", "list").stdout


def test_a_closed_gateway_wants_a_key(stack: LocalStack, keys: dict[str, str]) -> None:
    client = stub(stack)
    # Tenants exist now: the gateway closes within a second of their creation.
    wait_closed(stack, timeout=5)
    for metadata in (None, as_key("drk_0000_made-up"), as_key(keys["cats"] + "x"), [("authorization", keys["cats"])]):
        assert code_of(lambda m=metadata: client.SubmitJob(job(), metadata=m)) == grpc.StatusCode.UNAUTHENTICATED
    assert client.SubmitJob(job(), metadata=as_key(keys["cats"])).job_id


def test_another_tenants_job_is_not_found(stack: LocalStack, keys: dict[str, str]) -> None:
    client = stub(stack)
    cats, dogs = as_key(keys["cats"]), as_key(keys["dogs"])
    mine = client.SubmitJob(job(), metadata=cats).job_id
    missing = "00000000-0000-0000-0000-000000000000"
    for job_id in (mine, missing):
        expected = (grpc.StatusCode.NOT_FOUND, f"job {job_id} not found")
        assert details_of(lambda j=job_id: client.GetJob(pb.GetJobRequest(job_id=j), metadata=dogs)) == expected
        assert (
            details_of(lambda j=job_id: list(client.StreamJob(pb.StreamJobRequest(job_id=j), metadata=dogs)))
            == expected
        )
        assert details_of(lambda j=job_id: client.CancelJob(pb.CancelJobRequest(job_id=j), metadata=dogs)) == expected
    # Untouched by the other tenant's cancel: it runs to the end for its owner.
    assert wait_terminal(client, mine, metadata=cats).status == pb.JOB_STATUS_SUCCEEDED


def test_the_tenants_lane_bounds_the_request(stack: LocalStack, keys: dict[str, str]) -> None:
    client = stub(stack)
    cats, dogs = as_key(keys["cats"]), as_key(keys["dogs"])
    code, details = details_of(lambda: client.SubmitJob(job(lane="paid"), metadata=cats))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "'paid'" in details
    own = client.GetJob(pb.GetJobRequest(job_id=client.SubmitJob(job(), metadata=dogs).job_id), metadata=dogs)
    lower = client.SubmitJob(job(lane="free"), metadata=dogs).job_id
    assert own.lane == "paid"
    assert client.GetJob(pb.GetJobRequest(job_id=lower), metadata=dogs).lane == "free"


def test_idempotency_keys_are_per_tenant(stack: LocalStack, keys: dict[str, str]) -> None:
    client = stub(stack)
    cats, dogs = as_key(keys["cats"]), as_key(keys["dogs"])
    first = client.SubmitJob(job(idempotency_key="same"), metadata=cats)
    other = client.SubmitJob(job(idempotency_key="same"), metadata=dogs)
    again = client.SubmitJob(job(idempotency_key="same"), metadata=cats)
    assert other.job_id != first.job_id and not other.deduplicated
    assert again.job_id == first.job_id and again.deduplicated


def test_list_jobs_pages_through_the_callers_own(stack: LocalStack, keys: dict[str, str]) -> None:
    client = stub(stack)
    admin = as_key(keys["dogs-admin"])  # a tenant of its own jobs only, admin or not
    dogs = {client.SubmitJob(job(), metadata=admin).job_id for _ in range(5)}
    seen: list[pb.Job] = []
    token = ""
    while True:
        page = client.ListJobs(pb.ListJobsRequest(page_size=2, page_token=token), metadata=admin)
        assert len(page.jobs) <= 2
        seen += page.jobs
        token = page.next_page_token
        if not token:
            break
    created = [(j.timings.created_time.ToDatetime(), j.job_id) for j in seen]
    assert created == sorted(created, reverse=True)
    assert dogs <= {j.job_id for j in seen}
    cats = {j.job_id for j in client.ListJobs(pb.ListJobsRequest(page_size=200), metadata=as_key(keys["cats"])).jobs}
    assert cats and not cats & {j.job_id for j in seen}
    done = wait_terminal(client, sorted(dogs)[0], metadata=admin)
    succeeded = client.ListJobs(pb.ListJobsRequest(statuses=[done.status], page_size=200), metadata=admin).jobs
    assert done.job_id in {j.job_id for j in succeeded}
    assert {j.status for j in succeeded} == {done.status}
    code = code_of(lambda: client.ListJobs(pb.ListJobsRequest(page_token="not a token"), metadata=admin))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_stats_show_the_fleet_to_admin_keys_only(stack: LocalStack, keys: dict[str, str]) -> None:
    client = stub(stack)
    tenant = client.GetStats(pb.GetStatsRequest(), metadata=as_key(keys["cats"]))
    admin = client.GetStats(pb.GetStatsRequest(), metadata=as_key(keys["dogs-admin"]))
    assert (tenant.usage.tenant, tenant.usage.lane) == ("cats", "free")
    assert not tenant.workers and not tenant.HasField("totals")
    assert admin.usage.tenant == "dogs" and admin.workers and admin.totals.requests > 0


def test_a_revoked_key_is_refused_within_a_second(stack: LocalStack, keys: dict[str, str]) -> None:
    client = stub(stack)
    doomed = darkroom(stack, "keys", "create", "cats").stdout.strip().splitlines()[-1]
    key_id = doomed.split("_")[1]
    assert client.GetStats(pb.GetStatsRequest(), metadata=as_key(doomed)).usage.tenant == "cats"
    darkroom(stack, "keys", "revoke", key_id)
    revoked_at = time.monotonic()

    def refused() -> bool:
        try:
            client.GetStats(pb.GetStatsRequest(), metadata=as_key(doomed), timeout=5)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNAUTHENTICATED
        return False

    wait_for(refused, bool, timeout=5, what="the revoked key to be refused")
    assert time.monotonic() - revoked_at < 1.0
    assert client.GetStats(pb.GetStatsRequest(), metadata=as_key(keys["cats"])).usage.tenant == "cats"


def test_a_tenant_over_its_rate_is_told_which_limit_and_when(stack: LocalStack, keys: dict[str, str]) -> None:
    darkroom(stack, "tenants", "create", "birds", "--lane", "free", "--rate", "0.01")
    birds = as_key(darkroom(stack, "keys", "create", "birds").stdout.strip().splitlines()[-1])
    client = stub(stack)
    assert client.SubmitJob(job(), metadata=birds).job_id  # the bucket holds one
    quota, retry = quota_refusal(lambda: client.SubmitJob(job(prompt="one too many"), metadata=birds))
    assert quota.violations[0].subject == "tenant:birds" and "rate" in quota.violations[0].description
    assert 90 <= retry.retry_delay.seconds <= 100
    listed = client.ListJobs(pb.ListJobsRequest(), metadata=birds).jobs
    assert [j.prompt for j in listed] == ["a tenant's cat"]  # nothing of the refused one stored


def test_credits_are_reserved_at_submit_settled_at_the_end_and_refused_when_short(
    stack: LocalStack, keys: dict[str, str]
) -> None:
    darkroom(stack, "tenants", "create", "owls", "--lane", "free", "--credits", "1000", "--daily-credits", "1000")
    owls = as_key(darkroom(stack, "keys", "create", "owls").stdout.strip().splitlines()[-1])
    client = stub(stack)
    job_id = client.SubmitJob(job(prompt="an owl"), metadata=owls).job_id
    assert wait_terminal(client, job_id, timeout=120, metadata=owls).status == pb.JOB_STATUS_SUCCEEDED
    settled = wait_for(
        lambda: client.GetJob(pb.GetJobRequest(job_id=job_id), metadata=owls),
        lambda j: j.HasField("credits_charged"),
        timeout=30,
        what="the job's settlement",
    )
    assert settled.credits_reserved > 0 and settled.gpu_seconds > 0
    assert settled.credits_charged == pytest.approx(settled.gpu_seconds)  # tiny's price is 1
    usage = client.GetStats(pb.GetStatsRequest(), metadata=owls).usage
    assert usage.credits == pytest.approx(1000 - settled.credits_charged)
    assert usage.daily_credits == 1000
    assert usage.gpu_seconds_today == pytest.approx(settled.gpu_seconds)
    assert usage.credits_today == pytest.approx(settled.credits_charged)

    # Out of credits, with today's daily credits given already: refused until
    # the next UTC day, and nothing stored.
    darkroom(stack, "tenants", "update", "owls", "--credits", "0")
    quota, retry = quota_refusal(lambda: client.SubmitJob(job(prompt="a hungry owl"), metadata=owls))
    assert quota.violations[0].subject == "tenant:owls" and "credits" in quota.violations[0].description
    now = datetime.now(UTC)
    midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), tzinfo=UTC)
    assert abs(retry.retry_delay.seconds - (midnight - now).total_seconds()) < 10
    assert [j.prompt for j in client.ListJobs(pb.ListJobsRequest(), metadata=owls).jobs] == ["an owl"]

    # Per tenant in the metrics: its submits at the gateway, its usage where settled.
    gateway = metric_samples(stack, "gateway")
    assert gateway[("darkroom_tenant_submits_total", (("result", "accepted"), ("tenant", "owls")))] == 1
    assert gateway[("darkroom_tenant_submits_total", (("result", "refused"), ("tenant", "owls")))] == 1
    assert gateway[("darkroom_tenant_refusals_total", (("reason", "credits"), ("tenant", "owls")))] == 1
    scheduler = metric_samples(stack, "scheduler")
    gpu_seconds = scheduler[("darkroom_tenant_gpu_seconds_total", (("tenant", "owls"),))]
    assert gpu_seconds == pytest.approx(settled.gpu_seconds)

    # Credits added to the balance: let in again (and, this tiny job run and settled
    # or not, charged no more than it used).
    darkroom(stack, "tenants", "update", "owls", "--add-credits", "500")
    assert client.SubmitJob(job(prompt="a fed owl"), metadata=owls).job_id
    shown = darkroom(stack, "tenants", "show", "owls").stdout
    balance = float(shown.split("credits ", 1)[1].split(" ", 1)[0])
    assert 490 < balance <= 500
    # Its ledger, oldest last: what it was made with, the first job's charge, the two
    # adjustments (then the second job's charge, once it is settled).
    entries = [line.split()[2:4] for line in shown.splitlines() if line.startswith("credits ")]
    assert [kind for kind, _ in entries][-4:] == ["adjust", "adjust", "charge", "initial"]
    assert ["adjust", "+500"] in entries


def metric_samples(stack: LocalStack, service: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    port = stack.services[service].env["DARKROOM_METRICS_PORT"]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics_text(f"127.0.0.1:{port}"))
        for s in family.samples
    }


def test_admin_actions_are_recorded_with_who_did_what(stack: LocalStack, keys: dict[str, str]) -> None:
    fresh = darkroom(stack, "keys", "create", "cats", "--admin").stdout.strip().splitlines()[-1]
    key_id = fresh.split("_")[1]
    darkroom(stack, "keys", "revoke", key_id)
    darkroom(stack, "tenants", "update", "cats", "--rate", "100")
    shown = darkroom(stack, "tenants", "show", "cats").stdout
    actions = [line.split(" ", 1)[1] for line in shown.splitlines() if not line.startswith(("tenant ", "key "))]
    actor = actions[0].split(":", 1)[0]
    assert "@" in actor and all(line.startswith(f"{actor}: ") for line in actions)
    # Newest first: the update, the revocation, the admin key, ..., the tenant made.
    assert [line.split(": ", 1)[1] for line in actions[:3]] == [
        "tenants update: rate_per_s=100.0",
        f"keys revoke key {key_id}",
        f"keys create key {key_id}: role=admin",
    ]
    assert actions[-1] == f"{actor}: tenants create: lane=free, credits=None, daily_credits=None, max_jobs=50, " + (
        "rate_per_s=None, weight=1.0, expand_prompts=False, output_policy=None, max_adapters=None, max_adapter_mb=None"
    )
    assert fresh not in shown and keys["cats"] not in shown


def test_a_tenants_output_policy_overrides_its_lanes_from_its_next_submit(
    stack: LocalStack, keys: dict[str, str]
) -> None:
    """Decided at submit and stored on the job: the free lane's (block) until the
    tenant has its own, and its lane's again once that is cleared."""
    darkroom(stack, "tenants", "create", "moths", "--lane", "free")
    moths = as_key(darkroom(stack, "keys", "create", "moths").stdout.strip().splitlines()[-1])
    client = stub(stack)

    def policy() -> str:
        job_id = client.SubmitJob(job(prompt="a moth"), metadata=moths).job_id
        client.CancelJob(pb.CancelJobRequest(job_id=job_id), metadata=moths)  # only its policy matters
        return client.GetJob(pb.GetJobRequest(job_id=job_id), metadata=moths).output_policy

    assert policy() == "block"
    assert darkroom(stack, "tenants", "update", "moths", "--output-policy", "hide", check=False).returncode == 2
    shown = darkroom(stack, "tenants", "update", "moths", "--output-policy", "blur").stdout
    assert "output policy blur" in shown
    wait_for(policy, lambda p: p == "blur", timeout=5, what="the tenant's own policy at submit")
    darkroom(stack, "tenants", "update", "moths", "--output-policy", "lane")
    wait_for(policy, lambda p: p == "block", timeout=5, what="the lane's policy again")
