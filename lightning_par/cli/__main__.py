"""``python -m lightning_par.cli``: the ``lightning-par`` command (as ``srun`` or ``torchrun -m`` start it)."""

from lightning_par.cli.main import main

main()
