"""Checkpoints: the format (``format.py``: sharded DCP directories and full files, atomic, async), their validation
before loading (``validation.py``), reading without pickled code (``safe_dcp.py``), Hugging Face directories in and
out (``huggingface.py``) and LoRA adapters through peft (``adapters.py``); docs/checkpoints.md."""
