"""A run's health: the fault monitor (``fault_monitor.py``: heartbeats, the rank that died or hangs, bounded exit), bad
steps skipped alike on every rank (``bad_steps.py``), stragglers (``stragglers.py``) and torchft's fault tolerance
across replica groups (``fault_tolerance.py``); docs/checkpoints.md and docs/multinode.md."""
