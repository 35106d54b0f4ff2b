"""The sampler: one process per GPU. Arranged by concern, each subpackage's
``__init__`` saying what it holds; read in this order:

- ``service``: ``main()`` and ``serve()``, the loops it runs and how it stops;
  ``servicer``: its gRPC server (suspend, cancel, a host's blobs).
- ``dispatch/``: its dispatches from its own JetStream subject, in batches
  (``consumer``); ``batch_choice`` (pure) picks which of them run together,
  ``device_batches`` starts the next beside the one on the device, ``acks``
  settles each.
- ``jobs/``: a batch from start to stored outcomes (``runner``; the batch on the
  device as it sees it: ``batch_sampling``), an edit's input (``edit_inputs``),
  its steps and previews (``progress``, ``previews``), why a running job must stop
  (``tracker``: cancel, timeout, drain, suspension), and what a job comes to
  (``outcomes``, ``failures``), written fenced by its attempt (``job_store``).
- ``engine``: runs a batch through its model family's ``Denoiser``, the model from
  ``models/`` (``model_cache``; ``residency`` decides evictions; ``model_store`` and
  ``prefetch`` with a model store).
- ``denoising/``: the loop, the same for every family: a job as a batch member
  (``members``), the ``Denoiser`` seam (``denoiser``), the batch jobs join at step
  boundaries (``running_batch``), a member's state in and out of checkpoints
  (``checkpoint_capture``), and the diffusers families' loop
  (``diffusers_denoiser``, with ``step_groups``, ``network_calls`` for a compiled
  network, ``noise_schedulers`` kept on the host and ``prompts`` caching the text
  embeddings).
- ``families/``: one module per model family behind that seam (``unet``, ``sd3``,
  ``flux``, ``wan``, ``upscale`` in the diffusers loop; ``sim``).
- ``checkpoints/``: a job's state at any step as bytes (``format``), out to the
  database (``writer``) and back in on any GPU.
- ``decoding/``: latents to images on the decoder service (``decoders``);
  ``local_decode`` on this sampler itself.
- ``busy``: how much of the time work waits it spends denoising (the GPU never
  waiting for the host).
- ``heartbeat``, ``plan_follower``: what it tells the scheduler, and the warm
  plan it follows.
- ``metrics``, ``spans``: its Prometheus metrics and trace spans.

No module imports another that imports it back, even under ``TYPE_CHECKING``, and
no subpackage another that imports it back (``tests/unit/test_sampler_layout.py``).
"""
