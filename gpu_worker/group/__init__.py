"""Samplers that serve one parallel replica together (docs/parallel.md): the channel
over which the leader keeps its followers in step, and each side's engine. The
group's meshes and the network's split are the denoising loop's
(``gpu_worker.denoising.group_mesh``, ``parallel_network``)."""
