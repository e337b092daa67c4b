"""A class-conditional diffusion transformer: diffusers' ``DiTTransformer2DModel`` (Peebles & Xie 2023, "Scalable
Diffusion Models with Transformers") trained to predict the noise of DDPM (Ho et al. 2020).

Needs ``diffusers`` (``pip install diffusers``). Batches come from
:class:`~lightning_par.data.images.SyntheticImageDataModule` with ``with_index: true``: each sample's timestep and
noise are drawn from a generator seeded by its index, so every layout trains on the same noisy images as one
process; so is the label dropout of classifier-free guidance (Ho & Salimans 2022: a dropped label becomes the null
class), which diffusers would draw from the global random stream, different on every rank. The timestep and the
label ride with the noisy image as one more input plane (timestep at pixel (0, 0),
label at (0, 1)): the model's input stays one tensor, which the pipeline cuts into micro-batches and the
tensor-parallel check runs on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_par.models.lightning_module import ContractModule, check_optimizer_hparams


class DiTDenoiser(ContractModule):
    """Noise prediction with a DiT; AdamW with warmup and cosine decay.

    Model contract: ``split_batch((images, labels, indices)) -> (inputs, noise)`` where ``inputs`` is the noisy
    image with the conditioning plane (B, channels + 1, H, W); ``forward(inputs)`` the predicted noise (B, channels,
    H, W); ``loss_fn``: mean squared error.
    """

    def __init__(self, image_size: int = 16, channels: int = 4, classes: int = 10, patch_size: int = 2,
                 heads: int = 4, head_dim: int = 16, depth: int = 4, diffusion_steps: int = 1000,
                 label_dropout: float = 0.1, seed: int = 0,
                 learning_rate: float = 1e-3, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 warmup_steps: int = 0, min_lr_ratio: float = 0.1, max_steps: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_optimizer_hparams(self.hparams)
        try:
            from diffusers import DiTTransformer2DModel
        except ImportError as missing:
            raise ImportError("DiTDenoiser needs diffusers: pip install diffusers") from missing
        self.model = DiTTransformer2DModel(num_attention_heads=heads, attention_head_dim=head_dim,
                                           in_channels=channels, out_channels=channels, num_layers=depth,
                                           sample_size=image_size, patch_size=patch_size, num_embeds_ada_norm=classes)
        for block in self.model.transformer_blocks:  # labels are dropped in split_batch, per sample
            block.norm1.emb.class_embedder.dropout_prob = 0.0
        # DDPM's linear schedule of the noise variance; alpha_bar[t] = prod(1 - beta) up to t.
        betas_t = torch.linspace(1e-4, 0.02, diffusion_steps, dtype=torch.float64)
        self.register_buffer("alpha_bar", torch.cumprod(1 - betas_t, 0).float(), persistent=False)
        self.example_input_array = torch.zeros(2, channels + 1, image_size, image_size)

    @property
    def tokens_per_sample(self) -> int:
        """The patches of an image (what throughput counts as tokens)."""
        return (self.hparams.image_size // self.hparams.patch_size) ** 2

    def split_batch(self, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 3):
            raise TypeError("DiTDenoiser expects batches of (images, labels, indices): "
                            "SyntheticImageDataModule(with_index=True)")
        images, labels, indices = batch
        steps, noise, dropped = [], [], []
        for index in indices.tolist():
            generator = torch.Generator().manual_seed(self.hparams.seed * 1_000_003 + index)
            steps.append(int(torch.randint(len(self.alpha_bar), (1,), generator=generator)))
            noise.append(torch.randn(images.shape[1:], generator=generator))
            dropped.append(bool(torch.rand((), generator=generator) < self.hparams.label_dropout))
        timesteps = torch.tensor(steps, device=images.device)
        labels = torch.where(torch.tensor(dropped, device=labels.device), self.hparams.classes, labels)
        noise_t = torch.stack(noise).to(images)
        alpha_bar = self.alpha_bar.to(images.device)[timesteps].view(-1, 1, 1, 1).to(images.dtype)
        noisy = alpha_bar.sqrt() * images + (1 - alpha_bar).sqrt() * noise_t
        condition = torch.zeros_like(noisy[:, :1])
        condition[:, 0, 0, 0] = timesteps.to(images.dtype)
        condition[:, 0, 0, 1] = labels.to(images.dtype)
        return torch.cat([noisy, condition], dim=1), noise_t

    @override
    def forward(self, inputs: Tensor) -> Tensor:
        noisy, condition = inputs[:, :-1], inputs[:, -1]
        timesteps = condition[:, 0, 0].round().long()
        labels = condition[:, 0, 1].round().long()
        return self.model(noisy, timestep=timesteps, class_labels=labels).sample

    def loss_fn(self, predicted: Tensor, noise: Tensor) -> Tensor:
        return F.mse_loss(predicted.float(), noise.float())


__all__ = ["DiTDenoiser"]
