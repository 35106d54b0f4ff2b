import gc

gc.disable()  # while it imports: services.ops.lifecycle.imports_done turns it back on

from scheduler.service import main  # noqa: E402

main()
