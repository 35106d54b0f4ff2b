"""A job's denoising state at a step boundary as it leaves the GPU: as bytes any
GPU of its kind resumes from (``format``), and stored as the sampler hands them
over (``writer``). How a running member's state goes into them and back out is the
loop's (``gpu_worker.denoising.checkpoint_capture``)."""
