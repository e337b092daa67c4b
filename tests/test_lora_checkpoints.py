"""A LoRA run's checkpoints hold its adapters, their optimizer states and a reference to the base model directory,
not the base; they resume bit for bit, reshard into another layout, and export as peft's adapter directory or as the
merged model, from tp2, pp2 and zero3 alike. One launch of two ranks runs every case in turn."""

from __future__ import annotations

from pathlib import Path

import lightning
import pytest
from installed import require
import torch
from harness import run_distributed
from hf_directories import make_model_directory, write_corpus

transformers = require("transformers")
peft = require("peft")

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2, microbatches=2),
           "zero3": dict(data_parallel_size=2, zero_stage=3)}
LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-checkpoints")
    return {"base": str(make_model_directory(root / "base", "llama-tied")),
            "other": str(make_model_directory(root / "other", "llama-tied", seed=1)),  # same shapes, other weights
            "corpus": str(write_corpus(root / "corpus", repeats=12)["jsonl"]), "root": str(root)}


class ModelStateBytes(lightning.Callback):
    """This rank's bytes of parameters, gradients and optimizer states, by parameter name, at the last step's
    optimizer step (after its backward, states from the steps before)."""

    def __init__(self) -> None:
        self.parameters: dict[str, int] = {}
        self.gradients: dict[str, int] = {}
        self.states: dict[str, int] = {}

    def on_before_optimizer_step(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.tensor import DTensor

        def nbytes(tensor: torch.Tensor) -> int:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            return local.numel() * local.element_size()

        names = {id(p): n for n, p in module.named_parameters()}
        self.parameters = {n: nbytes(p) for n, p in module.named_parameters()}
        self.gradients = {n: nbytes(p.grad) for n, p in module.named_parameters() if p.grad is not None}
        self.states = {names[id(p)]: sum(nbytes(v) for k, v in state.items() if k != "step")
                       for p, state in optimizer.state.items()}


def _fit(world_size: int, workspace: dict[str, str], layout: str, directory: str, *, steps: int,
         resume: str | None = None, base: str | None = None) -> dict:
    """``steps`` AdamW steps of LoRA on the tiny Llama under ``layout``, a checkpoint every 3 steps in ``directory``;
    the losses, and on rank 0 the whole trained weights."""
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_par import Hybrid3DStrategy
    from lightning_par.data import TextDataModule
    from lightning_par.models import HFCausalLM
    from parity import RecordLoss

    recorder, measured = RecordLoss(), ModelStateBytes()
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=Hybrid3DStrategy(**LAYOUTS[layout]),
                                max_steps=steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
                                enable_model_summary=False, num_sanity_val_steps=0,
                                callbacks=[recorder, measured, ModelCheckpoint(dirpath=directory, every_n_train_steps=3,
                                                                     save_top_k=-1)])
    module = HFCausalLM(pretrained=base or workspace["base"], learning_rate=1e-2, warmup_steps=1, max_steps=6,
                        lora=LORA)
    data = TextDataModule(train_files=workspace["corpus"], tokenizer=workspace["base"], seq_len=16,
                          batch_size=4 // (2 if layout == "zero3" else 1), val_fraction=0.0)
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    return {"losses": recorder.losses, "weights": trainer.strategy.consolidated_state_dict(),
            "bytes": (measured.parameters, measured.gradients, measured.states)}


def _every_case(rank: int, world_size: int, workspace: dict[str, str]) -> dict:
    from lightning_par.checkpoint.validation import CheckpointError

    root = Path(workspace["root"])
    runs = {layout: _fit(world_size, workspace, layout, str(root / layout), steps=6) for layout in LAYOUTS}
    step3 = str(root / "tp2" / "epoch=0-step=3.ckpt")
    resumed = _fit(world_size, workspace, "tp2", str(root / "resumed"), steps=6, resume=step3)
    resharded = _fit(world_size, workspace, "pp2", str(root / "resharded"), steps=6, resume=step3)
    try:
        _fit(world_size, workspace, "tp2", str(root / "other-base"), steps=6, resume=step3, base=workspace["other"])
        refused = None
    except CheckpointError as error:
        refused = str(error)
    return {"runs": runs, "resumed": resumed, "resharded": resharded, "refused": refused}


@pytest.fixture(scope="module")
def per_rank(workspace: dict[str, str]) -> list[dict]:
    return run_distributed(_every_case, 2, workspace, timeout=540)


@pytest.fixture(scope="module")
def cases(per_rank: list[dict]) -> dict:
    return per_rank[0]


def test_model_states_per_rank_are_the_frozen_base_and_the_adapters(per_rank: list[dict],
                                                                    workspace: dict[str, str]) -> None:
    """Under zero3 (dp2) each rank holds its FSDP2 shard (dim 0 cut in two, as torch.chunk cuts it) of every weight,
    frozen or not, but gradients and AdamW's two fp32 states for its shard of the adapters only: what LoRA saves."""
    shapes = {name: tuple(t.shape) for name, t in per_rank[0]["runs"]["zero3"]["weights"].items()}
    for rank, result in enumerate(per_rank):
        parameters, gradients, states = result["runs"]["zero3"]["bytes"]

        def shard(name: str) -> int:  # fp32 bytes of this rank's part of a parameter
            rows = torch.empty(shapes[name][0]).chunk(2)
            return 4 * (rows[rank].numel() if rank < len(rows) else 0) * int(torch.tensor(shapes[name][1:]).prod())

        adapters = [name for name in parameters if "lora_" in name]
        assert parameters == {name: shard(name) for name in parameters}
        assert gradients == {name: shard(name) for name in adapters}
        assert states == {name: 2 * shard(name) for name in adapters}
        base = sum(parameters.values()) - sum(parameters[n] for n in adapters)
        trained = sum(parameters[n] for n in adapters)
        print(f"rank {rank}: frozen base {base} B, adapters {trained} B + gradients {sum(gradients.values())} B + AdamW "
              f"{sum(states.values())} B; full fine-tuning would hold {4 * (base + trained)} B")


def _trained_model(workspace: dict[str, str], weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The trained run's model rebuilt with peft and transformers alone: the base read by from_pretrained, LoRA put
    on by get_peft_model, every adapter set from the run's weights."""
    base = transformers.AutoModelForCausalLM.from_pretrained(workspace["base"])
    model = peft.get_peft_model(base, peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"],
                                                      target_modules=LORA["target_modules"]))
    adapters = {name.removeprefix("model."): t for name, t in weights.items() if "lora_" in name}
    result = model.load_state_dict(adapters, strict=False)
    assert not result.unexpected_keys and len(adapters) == 4 * 2 * 2  # 4 targets x 2 blocks x (A, B)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adapters_export_for_peft_and_merged(cases: dict, workspace: dict[str, str], tmp_path: Path,
                                             layout: str) -> None:
    """lightning-par-export --format peft gives what PeftModel.from_pretrained reads, and --format hf --merge what
    AutoModelForCausalLM.from_pretrained reads; both compute the trained model's logits."""
    from lightning_par.cli.export import main as export

    checkpoint = str(Path(workspace["root"]) / layout / "epoch=0-step=6.ckpt")
    expected = _logits(_trained_model(workspace, cases["runs"][layout]["weights"]))
    export([checkpoint, str(tmp_path / "adapter"), "--format", "peft"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(workspace["base"]),
                                             tmp_path / "adapter")
    export([checkpoint, str(tmp_path / "merged"), "--format", "hf", "--merge"])
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    for model in (adapted.eval(), merged.eval()):
        error = float((_logits(model) - expected).abs().max())
        print(f"{layout} {type(model).__name__}: logits within {error:.1e}")
        assert error <= LOGITS_ATOL
    assert float((expected - _logits(transformers.AutoModelForCausalLM.from_pretrained(workspace["base"])))
                 .abs().max()) > 1e-3  # the adapters trained: the check above can tell them from the base


def test_a_checkpoint_holds_the_adapters_and_the_base_reference(cases: dict, workspace: dict[str, str]) -> None:
    """Only the adapters and their two AdamW states: smaller than the base by the ratio of their parameter counts;
    the base is named by path and fingerprint."""
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_par.checkpoint.format import FROZEN_BASE_KEY, read_metadata
    from lightning_par.checkpoint.huggingface import directory_fingerprint

    checkpoint = Path(workspace["root"]) / "tp2" / "epoch=0-step=6.ckpt"
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    tensors = {name: entry.size.numel() for name, entry in metadata.items() if hasattr(entry, "size")}
    model = {name: n for name, n in tensors.items() if name.startswith("state_dict.")}
    states = {name: n for name, n in tensors.items() if name.startswith("optimizer_0.state.") and n > 1}
    adapters = sum(t.numel() for name, t in cases["runs"]["tp2"]["weights"].items() if "lora_" in name)
    base = sum(t.numel() for t in transformers.AutoModelForCausalLM.from_pretrained(workspace["base"]).parameters())
    assert all("lora_" in name for name in model) and sum(model.values()) == adapters
    assert sum(states.values()) == 2 * adapters  # exp_avg and exp_avg_sq: nothing for the frozen base
    on_disk = sum(p.stat().st_size for p in checkpoint.iterdir() if p.suffix == ".distcp")
    print(f"adapter checkpoint: {sum(model.values())} of {base} parameters ({sum(model.values()) / base:.3f}), "
          f"{on_disk} bytes of tensors")
    assert sum(model.values()) / base == pytest.approx(adapters / base)
    assert read_metadata(checkpoint / "meta.pt")[FROZEN_BASE_KEY] == {
        "directory": str(Path(workspace["base"]).resolve()), "sha256": directory_fingerprint(workspace["base"])}


def test_resume_is_exact_and_reshards(cases: dict) -> None:
    """Resumed at step 3 under tp2: steps 4-6 and the trained weights bit for bit as the run that did not stop. The
    same checkpoint resumed under pp2 (tensor-parallel shards of the adapters read whole into pipeline stages) continues
    the same training, within rounding (the same data order: a data-parallel size of 1 in both)."""
    whole, resumed, resharded = cases["runs"]["tp2"], cases["resumed"], cases["resharded"]
    assert resumed["losses"] == whole["losses"][3:]
    for name, tensor in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), name
    assert resharded["losses"] == pytest.approx(whole["losses"][3:], rel=1e-5)
    for name, tensor in whole["weights"].items():
        torch.testing.assert_close(resharded["weights"][name], tensor, rtol=0, atol=1e-5)


def test_a_checkpoint_refuses_another_base(cases: dict, workspace: dict[str, str]) -> None:
    """Adapters resumed onto a base whose files differ are refused on every rank, naming both directories."""
    assert cases["refused"] is not None
    assert workspace["base"] in cases["refused"] or str(Path(workspace["base"]).resolve()) in cases["refused"]
    assert "differ" in cases["refused"] and workspace["other"] in cases["refused"]
