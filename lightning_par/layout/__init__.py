"""What a layout is, in pure Python (no torch.distributed, nothing else of the package): its sizes and knobs
(``config.py``), its dimensions and the mesh order (``dimensions.py``), the pipeline schedules (``schedules.py``) and
ZeRO-3's units (``zero_units.py``). Shared by the strategies, ``parallel/`` and the planner (docs/architecture.md)."""
