import gc

gc.disable()  # while it imports: services.ops.lifecycle.imports_done turns it back on

from vae_worker.service import main  # noqa: E402

main()
