"""Running Darkroom's processes: the ``darkroom`` command, the local stack, the
supervisor, embedded PostgreSQL and NATS, and the host every service runs in."""

# Each service by the name it goes by (in logs, metrics, child names and the CLI),
# and the package that runs it: gpu_worker/ is the sampler, vae_worker/ the decoder.
SERVICE_MODULES = {
    "gateway": "gateway",
    "http": "http_api",
    "scheduler": "scheduler",
    "sampler": "gpu_worker",
    "decoder": "vae_worker",
}
