"""A vision transformer classifier (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words"), in plain PyTorch.

The layout follows timm's ``VisionTransformer``, the ViT most people train: a convolutional patch embedding
(``patch_embed.proj``), a class token and learned positions, pre-norm blocks whose attention fuses q/k/v in one
projection (``attn.qkv``, sliced as ``[3, heads, head_dim]``) followed by ``attn.proj``, an MLP ``mlp.fc1`` /
``mlp.fc2``, a final ``norm`` and a ``head`` on the class token. Nothing in the strategies knows these names: tensor
parallel pairs the projections by what the blocks compute (docs/models.md), pipeline parallel runs the patch
embedding on the first stage and the head on the last (docs/pipeline_parallel.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_par.models.lightning_module import ContractModule, check_optimizer_hparams


class PatchEmbedding(nn.Module):
    """Non-overlapping ``patch x patch`` patches of a (B, C, H, W) image, each projected to ``dim``: (B, N, dim)."""

    def __init__(self, channels: int, dim: int, patch: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)

    def forward(self, images: Tensor) -> Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)  # every patch attends to every patch
        return self.proj(y.transpose(1, 2).reshape(B, N, -1))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """(B, C, H, W) images -> (B, classes) logits, read off the class token."""

    def __init__(self, image_size: int, patch_size: int, channels: int, classes: int, dim: int, depth: int,
                 heads: int, mlp_ratio: float) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size={image_size} must be a multiple of patch_size={patch_size}")
        if dim % heads:
            raise ValueError(f"dim={dim} must be a multiple of heads={heads}")
        patches = (image_size // patch_size) ** 2
        self.patch_embed = PatchEmbedding(channels, dim, patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class ViTClassifier(ContractModule):
    """Image classification with :class:`VisionTransformer`, trained with AdamW, warmup and cosine decay.

    Model contract: ``split_batch((images, labels)) -> (images, labels)``; ``forward(images) -> logits`` (B, classes);
    ``loss_fn(logits, labels)``: mean cross-entropy.
    """

    def __init__(self, image_size: int = 32, patch_size: int = 4, channels: int = 3, classes: int = 10,
                 dim: int = 64, depth: int = 4, heads: int = 4, mlp_ratio: float = 4.0, learning_rate: float = 1e-3,
                 weight_decay: float = 0.05, betas: tuple[float, float] = (0.9, 0.999), warmup_steps: int = 0,
                 min_lr_ratio: float = 0.1, max_steps: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_optimizer_hparams(self.hparams)
        self.model = VisionTransformer(image_size, patch_size, channels, classes, dim, depth, heads, mlp_ratio)
        self.example_input_array = torch.zeros(2, channels, image_size, image_size)

    @property
    def tokens_per_sample(self) -> int:
        """The patches of an image and the class token (what throughput counts as tokens)."""
        return (self.hparams.image_size // self.hparams.patch_size) ** 2 + 1

    def split_batch(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(f"ViTClassifier expects batches of (images, labels), got {type(batch).__name__}")
        return batch[0], batch[1]

    @override
    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def loss_fn(self, logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits.float(), labels)


__all__ = ["ViTClassifier", "VisionTransformer"]
