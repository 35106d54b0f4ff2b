"""Open seats: room in the batch a sampler runs now. A sampler admits a job of its
running batch's join key (model and latent size; steps, guidance and seeds may
differ) at the batch's next step boundary, up to the model's ``max_batch``
images, so such a job waits for no held work there. Its heartbeat says which
batch has room for how many images (``scheduler.facts`` reads it); placement
counts on these seats (``scheduler.policy.seat_join``) and uses them up as a pass
places jobs onto them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.generation import JoinKey


@dataclass(frozen=True)
class OpenSeat:
    key: JoinKey  # of the batch running now
    rows: int  # images in the batch now
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
