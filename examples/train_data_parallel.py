"""Train the reference Llama model with lightning_par's data_parallel strategy from plain Python.

    python examples/train_data_parallel.py

Lightning starts the second process itself (it re-runs this script), exactly as with its own DDP.
"""

import lightning as L

import lightning_par  # noqa: F401 - importing registers "data_parallel" and the other strategy names
from lightning_par.data import TokenDataModule
from lightning_par.models import LlamaLM


def main() -> None:
    L.seed_everything(0)
    model = LlamaLM(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=128, learning_rate=2e-3,
                    warmup_steps=10)
    data = TokenDataModule(source="stdlib", seq_len=128, batch_size=8, max_bytes=2_000_000)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="data_parallel",  # or lightning_par.DataParallelStrategy(gradient_compression="bf16")
        max_steps=50,
        accumulate_grad_batches=2,  # the gradient all-reduce runs once per 2 micro-batches
        val_check_interval=25,
        limit_val_batches=5,
        log_every_n_steps=5,
    )
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
