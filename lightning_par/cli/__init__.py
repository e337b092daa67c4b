"""The commands: ``lightning-par`` (``main.py``: fit, validate, test, predict, ``check``, ``verify``, ``plan``,
``prepare``; its LightningCLI in ``lightning_cli.py``), ``lightning-par-export`` (``export.py``), and what each runs.
Nothing of the package below this one imports it (docs/architecture.md)."""
