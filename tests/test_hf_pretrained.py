"""A local pretrained Hugging Face directory loads into every layout, each rank reading only its part, with the
weights ``from_pretrained`` gives (tiny models made here with ``save_pretrained``; nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
from installed import PYTHON, require
import torch
from harness import run_distributed
from hf_directories import FAMILIES, make_model_directory

transformers = require("transformers")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: make_model_directory(tmp_path_factory.mktemp(name), name) for name in FAMILIES}


def _strategy(layout: str):
    from lightning_par import Hybrid3DStrategy, PipelineParallelStrategy, TensorParallelStrategy, ZeroStrategy

    return {"zero3": lambda: ZeroStrategy(zero_stage=3),
            "tp2": lambda: TensorParallelStrategy(tensor_parallel_size=2),
            "pp2": lambda: PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2),
            "dp2xtp2": lambda: Hybrid3DStrategy(data_parallel_size=2, tensor_parallel_size=2)}[layout]()


def _load(rank: int, world_size: int, directories: list[str], layout: str) -> list[dict]:
    """Validate each pretrained model under ``layout`` (loading its weights), then train two steps; return the
    whole weights (rank 0) and the losses."""
    import lightning

    from lightning_par.data import TokenDataModule
    from lightning_par.models import HFCausalLM

    results = []
    for directory in directories:
        module = HFCausalLM(pretrained=directory, learning_rate=1e-3)
        data = TokenDataModule(source="synthetic", vocab_size=64, seq_len=16, batch_size=4, num_samples=32,
                               num_val_samples=8)
        trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=_strategy(layout), max_steps=2,
                                    limit_val_batches=1, logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        validated = trainer.validate(module, datamodule=data, verbose=False)[0]["val_loss"]
        weights = {name: tensor.clone() for name, tensor in trainer.strategy.consolidated_state_dict().items()}
        trainer.fit(module, datamodule=data)
        results.append({"weights": weights, "val_loss": validated,
                        "train_loss": float(trainer.callback_metrics["train_loss"])})
    return results


@pytest.mark.parametrize("layout", ["zero3", "tp2", "pp2", "dp2xtp2"])
def test_pretrained_weights_load_into_every_layout(pretrained: dict[str, Path], layout: str) -> None:
    """The weights every rank loaded, gathered, equal from_pretrained's, tied head included; the validation loss
    equals the unsplit model's, and fine-tuning runs."""
    world_size = 4 if layout == "dp2xtp2" else 2
    ranks = run_distributed(_load, world_size, [str(d) for d in pretrained.values()], layout)
    for name, result in zip(pretrained, ranks[0]):
        reference = transformers.AutoModelForCausalLM.from_pretrained(pretrained[name])
        gathered = {key.removeprefix("model."): tensor for key, tensor in result["weights"].items()}
        assert set(gathered) == set(reference.state_dict()), name
        for key, tensor in reference.state_dict().items():
            assert torch.equal(gathered[key], tensor), (name, key)
        assert torch.isfinite(torch.tensor(result["train_loss"])), name


def _fine_tune(rank: int, world_size: int, directory: str, layout: str, checkpoints: str) -> dict:
    """Two steps of fine-tuning under ``layout``, saving a sharded checkpoint; return the trained weights."""
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_par.data import TokenDataModule
    from lightning_par.models import HFCausalLM

    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=_strategy(layout), max_steps=2,
                                limit_val_batches=0, logger=False, enable_progress_bar=False,
                                enable_model_summary=False, num_sanity_val_steps=0,
                                callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last=True)])
    data = TokenDataModule(source="synthetic", vocab_size=64, seq_len=16, batch_size=4, num_samples=32)
    trainer.fit(HFCausalLM(pretrained=directory, learning_rate=1e-2), datamodule=data)
    return {name: tensor.clone() for name, tensor in trainer.strategy.consolidated_state_dict().items()}


@pytest.mark.parametrize("layout", ["tp2", "pp2", "zero3"])
def test_export_round_trips_through_from_pretrained(pretrained: dict[str, Path], tmp_path: Path,
                                                    layout: str) -> None:
    """A sharded checkpoint of a fine-tune under ``layout`` -> ``lightning-par-export --format hf`` -> a directory
    ``from_pretrained`` loads, with the trained weights (tied head included) and the trained model's logits."""
    import subprocess

    source = pretrained["llama-tied"]
    trained = run_distributed(_fine_tune, 2, str(source), layout, str(tmp_path / "ckpt"))[0]
    exported = tmp_path / "exported"
    command = [PYTHON, "-m", "lightning_par.cli.export", str(tmp_path / "ckpt" / "last.ckpt"), str(exported),
               "--format", "hf"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = transformers.AutoModelForCausalLM.from_pretrained(source)
    reference.load_state_dict({name.removeprefix("model."): tensor for name, tensor in trained.items()})
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert not torch.equal(reference.model.embed_tokens.weight,
                           transformers.AutoModelForCausalLM.from_pretrained(source).model.embed_tokens.weight)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=0, atol=1e-5)


def test_flops_per_token_counts_the_whole_model_on_every_stage() -> None:
    """The MFU monitor's FLOPs come from the whole model, also on a pipeline rank that holds only some blocks."""
    from lightning_par.models import HFCausalLM

    module = HFCausalLM(config=FAMILIES["qwen2"])
    module.configure_model()
    whole = module.flops_per_token(16)
    config = module.model_config
    parameters = sum(p.numel() for p in module.model.parameters())
    assert whole == 6 * (parameters - config.vocab_size * config.hidden_size) + 12 * 2 * 32 * 16
    del module.model.model.layers[1]  # what a first pipeline stage of two keeps
    assert module.flops_per_token(16) == whole


def test_dict_batches_take_labels_and_right_padding_and_refuse_left_padding() -> None:
    """Padding takes no loss; padding the model would attend to (before real tokens) is refused, not trained on."""
    from lightning_par.models import HFCausalLM

    module = HFCausalLM(config=FAMILIES["qwen2"])
    ids = torch.arange(10).reshape(2, 5)
    right = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    inputs, targets = module.split_batch({"input_ids": ids, "attention_mask": right})
    assert torch.equal(inputs, ids[:, :-1])
    assert targets.tolist() == [[1, 2, 3, 4], [6, 7, -100, -100]]
    labels = ids.masked_fill(ids == 3, -100)
    assert module.split_batch({"input_ids": ids, "labels": labels})[1].tolist() == [[1, 2, -100, 4], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="padding only at the end of a sequence"):
        module.split_batch({"input_ids": ids, "attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])})


# ~150 MB of fp32 weights in many tensors of at most 4 MB: a rank holding the whole model is plain to see.
LARGE = dict(model_type="llama", vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
MIB = 2**20


def _memory_status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (RssAnon: memory the process allocated, resident now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _load_peak(rank: int, world_size: int, directory: str, layout: str) -> dict:
    """How far this rank's allocated memory rises while the pretrained weights are read into the shards the layout
    allocated (``load``), and from set-up to the first batch (``set_up``: the layout applied, the tensor-parallel
    styles checked, the shards allocated, the weights read), and its share of the parameters. Allocated = anonymous
    resident memory, sampled by a thread: the safetensors are memory-mapped, and their pages are the kernel's page
    cache, shared by the ranks, not memory a rank holds."""
    import threading

    import lightning
    from torch.distributed.tensor import DTensor

    from lightning_par.data import TokenDataModule
    from lightning_par.models import HFCausalLM

    class LoadMemory(lightning.Callback):
        """Samples allocated memory from set-up (the model still on the meta device) to the first batch, the
        peak of each phase apart: "set-up" until the load starts, then "load"."""

        def setup(self, trainer, pl_module, stage):
            self.start = {"set-up": _memory_status("RssAnon")}
            self.peaks, self.phase, self.sampling = {}, "set-up", True

            def sample() -> None:
                while self.sampling:
                    phase = self.phase  # read first: a sample taken as the phase changes counts for the earlier one
                    self.peaks[phase] = max(self.peaks.get(phase, 0), _memory_status("RssAnon"))

            self.sampler = threading.Thread(target=sample, daemon=True)
            self.sampler.start()

        def on_validation_start(self, trainer, pl_module):  # before HFCausalLM's own hook, which loads
            self.start["load"] = _memory_status("RssAnon")
            self.phase = "load"

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            if batch_idx == 0:
                self.sampling = False
                self.sampler.join()
                self.share = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                                 for p in pl_module.parameters())

    memory = LoadMemory()
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=_strategy(layout), logger=False,
                                limit_val_batches=1, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[memory])
    trainer.validate(HFCausalLM(pretrained=directory),
                     datamodule=TokenDataModule(source="synthetic", vocab_size=LARGE["vocab_size"], seq_len=8,
                                                batch_size=2, num_samples=8, num_val_samples=8), verbose=False)
    peaks, start = memory.peaks, memory.start
    return {"load": peaks.get("load", start["load"]) - start["load"], "share": memory.share,
            "set_up": max(peaks.values()) - start["set-up"]}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="measures memory through Linux's /proc")
@pytest.mark.parametrize("layout", ["tp2", "zero3", "pp2"])
def test_loading_reads_into_the_shards_without_holding_the_model(tmp_path: Path, layout: str) -> None:
    """Measured: each rank holds about half of the weights (allocated when the layout is applied), reading the
    safetensors into them raises its allocated memory by at most one tensor (the slice DCP reads through) plus
    16 MiB, where a rank that read the whole model would add all 144 MiB, and from set-up to the first batch it
    grows by at most its share, one tensor and 48 MiB of everything else set-up allocates; under tensor parallel,
    plus the tensor-parallel check's replica: one block in float64, its gradients and their copy (its embedding and head
    are cut to a few rows); under pipeline parallel, plus the pipeline check's: two blocks in float64 and their
    gradients (measured: 88 MiB more than without the check); under ZeRO-3, plus the units check's: two blocks in
    float32 and their gradients (measured: about 30 MiB more than without the check)."""
    arguments = dict(LARGE)
    config = transformers.AutoConfig.for_model(arguments.pop("model_type"), **arguments)
    model = transformers.AutoModelForCausalLM.from_config(config)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    replica = {"tp2": 3 * 8 * block, "pp2": 2 * 2 * 8 * block, "zero3": 2 * 2 * 4 * block}[layout]
    model.save_pretrained(tmp_path)
    del model
    for rank, result in enumerate(run_distributed(_load_peak, 2, str(tmp_path), layout)):
        print(f"{layout} rank {rank}: holds {result['share'] / MIB:.0f} of {whole / MIB:.0f} MiB; loading raised its "
              f"allocated memory by {result['load'] / MIB:.1f} MiB, set-up and loading by {result['set_up'] / MIB:.0f} "
              f"MiB (largest tensor {largest / MIB:.0f} MiB)")
        assert 0.4 * whole < result["share"] < 0.6 * whole
        assert result["load"] <= largest + 16 * MIB
        assert result["set_up"] <= result["share"] + largest + replica + 48 * MIB


def test_weights_of_another_float_precision_are_converted(tmp_path: Path) -> None:
    """bf16 safetensors into fp32 parameters: converted as from_pretrained(dtype=float32) converts them."""
    from lightning_par.models import HFCausalLM

    source = make_model_directory(tmp_path / "fp32", "qwen2", tokenizer=False)
    transformers.AutoModelForCausalLM.from_pretrained(source).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    module = HFCausalLM(pretrained=str(tmp_path / "bf16"))
    module.configure_model()
    module.load_pretrained()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    for name, tensor in reference.state_dict().items():
        assert module.model.state_dict()[name].dtype == torch.float32
        assert torch.equal(module.model.state_dict()[name], tensor), name
