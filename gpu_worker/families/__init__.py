"""The model families, one module each behind the one ``Denoiser`` seam
(``gpu_worker.denoising.denoiser``): ``unet`` (SD 1.5, SDXL, tiny), ``sd3`` (SD 3
and 3.5), ``flux`` (Flux.1), ``wan`` (Wan 2.1 video) and ``upscale`` (the x4
upscaler) in the diffusers loop (``gpu_worker.denoising.diffusers_denoiser``), and
``sim`` (the simulated family, which only sleeps). A family imports no other."""
