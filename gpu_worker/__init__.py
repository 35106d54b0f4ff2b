"""The sampler: one process per GPU. Read in this order:

- ``service``: ``main()`` and ``serve()``, the loops it runs and how it stops.
- ``consumer``: its dispatches from its own JetStream subject, in batches;
  ``batch_choice`` (pure) picks which of them run together; ``acks`` settles each.
- ``runner``: a batch from start to stored outcomes; ``engine`` runs it through
  its model family's ``Denoiser`` (``denoising``; ``diffusers_denoiser`` and
  ``unet_denoiser`` for the diffusers families, with ``noise_schedulers`` kept on
  the host and ``network_calls`` for a compiled network; ``sim_denoiser`` for
  the sim family), the model from ``model_cache`` (``residency`` decides
  evictions, ``prompts`` caches the text embeddings).
- ``checkpoint_capture``, ``checkpoint_format``, ``checkpoint_writer``: a job's
  state at any step, out to the database and back in on any GPU.
- ``decoders``: latents to images on the decoder service; ``local_decode`` on
  this sampler itself.
- ``outcomes``, ``job_store``, ``failures``, ``progress``: what a job comes to,
  written fenced by its attempt.
- ``tracker``: why a running job must stop (cancel, timeout, drain, suspension).
- ``busy``: how much of the time work waits it spends denoising (the GPU never
  waiting for the host).
- ``heartbeat``, ``plan_follower``: what it tells the scheduler, and the warm
  plan it follows.
- ``metrics``, ``spans``: its Prometheus metrics and trace spans.
"""
