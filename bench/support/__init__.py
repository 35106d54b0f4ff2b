"""What the benchmarks in ``bench/`` use that is not a benchmark itself: the stack a
bench runs (``stack_run``), the load generator ``controlplane`` runs as its own
process (``loadgen``), and the fake samplers' host and the timed scheduler that
``fleet_load`` runs in place of the real processes (``fleet_host``,
``fleet_scheduler``). Their benchmarks' ``--smoke`` runs exercise them in CI."""
