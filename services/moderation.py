"""What one moderation call may hold, shared by the gateway that checks each input
and the HTTP door that counts them before it converts any."""

from __future__ import annotations

# Inputs one call may hold: texts or images.
MAX_INPUTS = 32
