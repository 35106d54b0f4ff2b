"""The sampler's dispatches, from its own JetStream subject to settled: taken in
batches (``consumer``), grouped by what may run together (``batch_choice``, pure),
started and handed to the runner a batch at a time so that the device never waits
(``device_batches``), and each acked, naked or terminated once its job's outcome
is durable (``acks``)."""
