"""The scheduler: decisions over a fleet snapshot, and the passes around them.

- Pure policy, the clock passed in, shared with the simulator: ``snapshot``
  (the facts), ``views`` and ``policy`` (the facts with the learned durations,
  ``estimates``, ``costs``), ``placement``, ``preemption``, ``warm_planner``
  with ``forecast``, ``recovery``, ``admission`` (the gateway's estimated wait);
  ``driver`` is the one way a snapshot becomes decisions.
- I/O: ``facts`` reads a snapshot from the database's records; ``passes`` reads,
  decides and writes; ``suspend_requests`` carries preemption out; ``learning``
  folds run times into the stored estimates; ``service`` runs the loops.
- ``reports``, ``metrics``, ``job_gauges``, ``spans``: what its decisions say to
  people, Prometheus and traces.
- ``simulator/``: the same driver over simulated GPUs, for ``bench/placement.py``.
"""
