"""The supervisor's decisions: how long to wait before a restart, and when a child
is hung."""

from __future__ import annotations

from services.ops.supervisor import STARTUP_GRACE_S, RestartPolicy, hung


def test_restart_delay_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy(backoff_s=0.5, backoff_max_s=4.0)
    assert [policy.delay(n) for n in range(7)] == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_silent_child_is_hung_after_the_timeout() -> None:
    assert not hung(now=114.9, started_at=0.0, alive_at=100.0, hang_after_s=15.0)
    assert hung(now=115.1, started_at=0.0, alive_at=100.0, hang_after_s=15.0)


def test_starting_child_gets_the_start_up_grace() -> None:
    # Never alive since this start (alive_at is from before it): judged only after the grace.
    assert not hung(now=STARTUP_GRACE_S - 1, started_at=0.0, alive_at=-5.0, hang_after_s=15.0)
    assert not hung(now=STARTUP_GRACE_S - 1, started_at=0.0, alive_at=None, hang_after_s=15.0)
    assert hung(now=STARTUP_GRACE_S + 1, started_at=0.0, alive_at=None, hang_after_s=15.0)
