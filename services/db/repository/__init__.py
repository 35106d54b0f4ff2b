"""All of Darkroom's SQL, behind one small interface split by area. Every area
shares one connection pool; driver errors become ``services.errors`` exceptions
once, in ``database``."""

from __future__ import annotations

from services.db.attempt_records import Result, Standing, StartRequest, StepReport
from services.db.repository.adapters import Adapters
from services.db.repository.admission import Admission
from services.db.repository.attempts import Attempts
from services.db.repository.checkpoints import Checkpoints
from services.db.repository.credits import Credits, DayUsage, Settled
from services.db.repository.database import IDLE_IN_TRANSACTION_MS, PLANNER_LOCK, SCHEDULER_LOCK, Database
from services.db.repository.estimates import Estimates
from services.db.repository.jobs import Jobs
from services.db.repository.recovery import Recoveries
from services.db.repository.scheduling import Scheduling
from services.db.repository.tenants import Tenants
from services.db.repository.workers import Workers

__all__ = [
    "IDLE_IN_TRANSACTION_MS",
    "PLANNER_LOCK",
    "SCHEDULER_LOCK",
    "DayUsage",
    "Repository",
    "Result",
    "Settled",
    "Standing",
    "StartRequest",
    "StepReport",
]


class Repository:
    """``jobs``: what clients submit and read; ``attempts``: writes from the worker
    holding a job, fenced by attempt; ``workers``: the registry; ``scheduling``:
    the scheduler's passes; ``recovery``: stalled, expired and exhausted jobs;
    ``estimates``: learned durations; ``checkpoints``: denoising checkpoints and
    suspensions; ``tenants``: tenants and their API keys; ``admission``: submits
    within their tenants' limits; ``credits``: settling what ended jobs cost;
    ``adapters``: tenants' own LoRA adapters."""

    def __init__(
        self, database_url: str, *, pool_size: int = 10, application_name: str = "darkroom", pooled: bool = False
    ) -> None:
        self.db = Database(database_url, pool_size=pool_size, application_name=application_name, pooled=pooled)
        self.jobs = Jobs(self.db)
        self.attempts = Attempts(self.db)
        self.workers = Workers(self.db)
        self.scheduling = Scheduling(self.db)
        self.recovery = Recoveries(self.db)
        self.estimates = Estimates(self.db)
        self.checkpoints = Checkpoints(self.db)
        self.tenants = Tenants(self.db)
        self.admission = Admission(self.db)
        self.credits = Credits(self.db)
        self.adapters = Adapters(self.db)

    async def close(self) -> None:
        await self.db.close()
