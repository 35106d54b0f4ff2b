"""The denoising loop, the same for every model family: a job as a batch member
(``members``), the ``Denoiser`` a family implements (``denoiser``), the batch jobs
join at step boundaries (``running_batch``), a member's state into checkpoints and
back out at step boundaries (``checkpoint_capture``), and the loop every diffusers
family shares (``diffusers_denoiser``) with its parts: a member's run
(``diffusers_run``), which members share a network call (``step_groups``), a
compiled network's calls (``network_calls``), the noise schedulers kept on the host
(``noise_schedulers``) and the prompts' conditioning, cached (``prompts``). It knows
no model family (``gpu_worker.families``) and no job handling."""
