"""Open seats: room in the batch a sampler runs now. A sampler's running batch takes
a job of its join key (model and latent size; steps, guidance and seeds may differ)
in at its next step boundary, up to the model's ``max_batch`` images. The sampler
says so in its heartbeat (``OpenSeat.telemetry``, under ``"open_seats"``); the
scheduler reads it back (``OpenSeat.of``), places jobs onto the seats
(``scheduler.policy.seat_join``) and uses them up as a pass fills them. One type, so
the two sides cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from services.generation import JoinKey

_COUNTS = ("width", "height", "frames", "rows", "free_rows", "steps_left")


@dataclass(frozen=True)
class OpenSeat:
    key: JoinKey  # of the batch running now
    rows: int  # images in the batch now (those joining it included)
    free_rows: int  # images it can still take before the model's max_batch
    steps_left: int  # the most steps any member still has: when it ends if none joins

    def takes(self, key: JoinKey, images: int) -> bool:
        return self.key == key and 0 < images <= self.free_rows

    def joined(self, images: int, steps: int) -> OpenSeat:
        """The seat once a job of ``images`` images and ``steps`` steps joins."""
        return replace(
            self,
            rows=self.rows + images,
            free_rows=self.free_rows - images,
            steps_left=max(self.steps_left, steps),
        )

    def telemetry(self) -> dict[str, Any]:
        """As a sampler's heartbeat carries it."""
        return {
            "model": self.key.model,
            "width": self.key.width,
            "height": self.key.height,
            "frames": self.key.frames,
            "rows": self.rows,
            "free_rows": self.free_rows,
            "steps_left": self.steps_left,
        }

    @classmethod
    def of(cls, entry: object) -> OpenSeat | None:
        """A heartbeat's entry read back; None for one that is not what a sampler
        sends (a sampler of another version must not stop a scheduling pass, and no
        seat only costs a job the join), or one with no room left."""
        if not isinstance(entry, dict) or not isinstance(model := entry.get("model"), str) or not model:
            return None
        counts = [n for name in _COUNTS if isinstance(n := entry.get(name), int) and not isinstance(n, bool)]
        if len(counts) < len(_COUNTS):
            return None
        width, height, frames, rows, free_rows, steps_left = counts
        if min(width, height, frames, rows, free_rows, steps_left) < 1:
            return None  # no room, or a batch with nothing left to run
        return cls(JoinKey(model, width, height, frames), rows, free_rows, steps_left)
