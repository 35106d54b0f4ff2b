"""A batch on the device that jobs join at a step boundary and leave as each one
finishes: continuous batching. Shared by the event loop, which offers members (jobs
already RUNNING, their prompts encoded and inputs made), and the sampling thread,
which takes them in at its next step boundary and hands each member's result out
as it leaves, so that its latents go to decode at once while the rest go on.

The room is counted in images: the members in the loop and those waiting to join
stay within the model's ``max_batch``. Closing is atomic with taking, so a member
offered as the loop ends either joins or is refused, never lost.

It has room to offer, and its first members' time runs, only once it ``begin``s
denoising: loading its model (a store download may take minutes) is the
operator's time, and a joiner sent then would wait behind the load."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from gpu_worker.denoising.members import BatchMember, MemberResult
from services.generation import JoinKey
from services.seats import OpenSeat

# Members that left at one step boundary, with what each came out with.
Cohort = list[tuple[BatchMember, MemberResult]]


class BatchJoins(Protocol):
    """What the denoising loop asks of a running batch at each step boundary (a
    group's followers are sent their leader's: ``gpu_worker.group.channel``)."""

    def joining(self) -> list[BatchMember]: ...

    def close(self) -> list[BatchMember]: ...

    def stepped(self, members: Sequence[BatchMember], steps_left: int) -> None: ...

    def leave(self, cohort: Cohort) -> None: ...


class RunningBatch:
    def __init__(
        self, key: JoinKey, max_rows: int, members: Sequence[BatchMember], on_leave: Callable[[Cohort], None]
    ) -> None:
        self.key = key
        self.max_rows = max_rows
        self._on_leave = on_leave
        self._lock = threading.Lock()
        self._rows = sum(m.params.num_images for m in members)
        self._waiting: list[BatchMember] = []
        self._closed = False
        self._steps_left = max((m.params.steps for m in members), default=0)
        self._first = [id(m) for m in members]
        self._began = False
        # Per member (by identity): when it came in, and the images of each step it ran in.
        self._joined_at: dict[int, float] = {}
        self._rows_run: dict[int, list[int]] = {}

    # -- the event loop --------------------------------------------------------------

    def offer(self, members: Sequence[BatchMember]) -> int | None:
        """The images already in the batch if ``members`` (all of them) will join it
        at its next step boundary; None once the batch has ended, or when they do
        not fit."""
        rows = sum(m.params.num_images for m in members)
        with self._lock:
            fits = self._rows + rows <= self.max_rows
            if self._closed or not fits or any(m.params.join_key != self.key for m in members):
                return None
            before = self._rows
            self._waiting.extend(members)
            self._rows += rows
            self._steps_left = max(self._steps_left, *(m.params.steps for m in members))
            return before

    def seats(self) -> OpenSeat | None:
        """Its room now, or None when it has none (or has not begun, or has ended)."""
        with self._lock:
            if not self._began or self._closed or self._rows >= self.max_rows:
                return None
            return OpenSeat(self.key, self._rows, self.max_rows - self._rows, self._steps_left)

    # -- the sampling thread -----------------------------------------------------------

    def begin(self) -> None:
        """Its model is loaded and its first step begins: its first members' time
        starts now, and it has room to offer."""
        now = time.perf_counter()
        with self._lock:
            self._began = True
            self._joined_at.update((member, now) for member in self._first)

    def joining(self) -> list[BatchMember]:
        """The members offered since the last boundary: they join now."""
        with self._lock:
            return self._take_waiting()

    def _take_waiting(self) -> list[BatchMember]:
        """Under the lock: the members waiting to join, in from now on."""
        taken, self._waiting = self._waiting, []
        now = time.perf_counter()
        self._joined_at.update((id(m), now) for m in taken)
        return taken

    def stepped(self, members: Sequence[BatchMember], steps_left: int) -> None:
        """A step of ``members`` begins (the most steps any has left: ``steps_left``)."""
        rows = sum(m.params.num_images for m in members)
        with self._lock:
            self._steps_left = steps_left
            for m in members:
                self._rows_run.setdefault(id(m), []).append(rows)

    def ran(self, member: BatchMember) -> tuple[float, int]:
        """When ``member`` came in (``time.perf_counter``; now if it never did: the
        batch never began), and the images of its batch over the steps it ran, on
        average (its own if it ran none)."""
        with self._lock:
            rows = self._rows_run.get(id(member)) or [member.params.num_images]
            return self._joined_at.get(id(member), time.perf_counter()), round(sum(rows) / len(rows))

    def leave(self, cohort: Cohort) -> None:
        """Members that left at this boundary: their room frees, their results go out."""
        if not cohort:
            return
        with self._lock:
            self._rows -= sum(m.params.num_images for m, _ in cohort)
        self._on_leave(cohort)

    def close(self) -> list[BatchMember]:
        """The loop has no member left: what was offered meanwhile (the loop goes on
        with it), or nothing, and the batch has ended (later offers are refused)."""
        with self._lock:
            if self._waiting:
                return self._take_waiting()
            self._closed = True
            return []

    def shut(self) -> list[BatchMember]:
        """The batch failed as a whole: it takes no one more; the members offered
        that never came in."""
        with self._lock:
            self._closed = True
            taken, self._waiting = self._waiting, []
            return taken
