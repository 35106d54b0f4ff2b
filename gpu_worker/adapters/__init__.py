"""LoRA adapters held hot on the sampler's device and applied per row of a network
call: each member of a batch with its own adapters and scales (``mixed_lora``), in
slots of a fixed budget (``slots``)."""
