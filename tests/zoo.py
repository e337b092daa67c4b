"""A zoo of tiny language models (random weights, no download) that the model-parallel layouts must train
exactly as one process does, or refuse before the first step.

Each entry builds a LightningModule that meets the model contract (``split_batch``, ``forward``,
``loss_fn``) with SGD + momentum, whose update is linear in the gradient so that rounding differences in a
collective stay rounding-sized, at a learning rate at which every model is well conditioned (weights
perturbed by 1e-7 stay within 5e-6 of the unperturbed run after 20 steps; OLMo 2 is not at 0.1). Dropout
is off: its masks come from each layout's own random stream, so no layout could match one process.
Together the architectures cover tied heads, fused q/k/v and gate/up projections, GPT-2's ``Conv1D``,
learned positions, parallel residuals, q/k norms per head and over the whole width, soft-capping, attention
biases, MoE with shared experts and multi-head latent attention, plus a hand-written nanoGPT and three
models of plain torch blocks: ``nn.MultiheadAttention`` (left whole by tensor parallel), projections no
naming rule recognises (refused by tensor parallel), and projections directly in the block (split from an
explicit map).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
SEQ_LEN = 16


class SGDModule(pl.LightningModule):
    """The model contract around a network whose forward returns logits (or an output whose first item is)."""

    def split_batch(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[:, :-1], batch[:, 1:]

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = self.split_batch(batch)
        loss = self.loss_fn(self(inputs), targets)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        inputs, targets = self.split_batch(batch)
        self.log("val_loss", self.loss_fn(self(inputs), targets), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.03, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class HuggingFaceLM(SGDModule):
    """Any ``AutoModelForCausalLM`` built from a config dict; nothing here knows which family it is."""

    def __init__(self, config: dict, attention: str = "sdpa") -> None:
        super().__init__()
        import transformers

        model_config = transformers.AutoConfig.for_model(**config)
        self.model = transformers.AutoModelForCausalLM.from_config(model_config, attn_implementation=attention)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=inputs).logits


class Seq2SeqLM(SGDModule):
    """Any ``AutoModelForSeq2SeqLM`` built from a config dict, trained on one tensor: the encoder reads the inputs and
    the decoder, fed the same inputs, predicts each next token."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        import transformers

        model_config = transformers.AutoConfig.for_model(**config)
        self.model = transformers.AutoModelForSeq2SeqLM.from_config(model_config)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=inputs, decoder_input_ids=inputs).logits


# ------------------------------------------------------------------------------------------ nanoGPT
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)  # fused q, k, v
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Karpathy's nanoGPT: learned positions, fused c_attn, SDPA, weight-tied head."""

    def __init__(self, vocab_size: int = VOCAB, block_size: int = SEQ_LEN, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 32) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class NanoGPT(SGDModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.model = GPT(**kwargs)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)


# ------------------------------------------------------------------------------------------- litgpt
class LitGPTLM(SGDModule):
    """litgpt's ``GPT`` (Lightning's own LLM library) from a ``litgpt.Config``: fused q/k/v of all query groups
    ([q | k | v], sliced by the config's global head counts), ``attn.proj``, ``mlp.fc_1``/``fc_2``/``proj``; names
    no rule knows, so tensor parallel pairs its layers by what the blocks compute."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        from litgpt import Config
        from litgpt.model import GPT as LitGPT

        self.model = LitGPT(Config(**config))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)


_LITGPT_COMMON = dict(block_size=SEQ_LEN, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32)
LITGPT_CONFIGS: dict[str, dict] = {
    # LLaMA-style: RMSNorm, SwiGLU (fc_1, fc_2 -> proj), grouped queries (2 groups of 2), full rotary, untied
    "litgpt_llama": dict(_LITGPT_COMMON, n_query_groups=2, bias=False, norm_class_name="RMSNorm",
                         mlp_class_name="LLaMAMLP", intermediate_size=48, rotary_percentage=1.0,
                         parallel_residual=False),
    # Pythia-style: LayerNorm, GELU MLP (fc -> proj), biases, parallel residual, a quarter of each head rotary
    "litgpt_pythia": dict(_LITGPT_COMMON, bias=True, norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP",
                          intermediate_size=64, rotary_percentage=0.25, parallel_residual=True),
}


# ------------------------------------------------------------------------------------ torch-native blocks
class TorchBlock(nn.Module):
    """Pre-norm block on ``nn.MultiheadAttention`` (which computes with its projections' weights directly, so
    tensor parallel leaves it whole) and an MLP named ``mlp_names``."""

    def __init__(self, dim: int, heads: int, mlp_names: tuple[str, str]) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2, self.mlp = nn.LayerNorm(dim), nn.Module()
        self.names = mlp_names
        self.mlp.add_module(mlp_names[0], nn.Linear(dim, 2 * dim))
        self.mlp.add_module(mlp_names[1], nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # True: may not attend
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        up, down = (getattr(self.mlp, n) for n in self.names)
        return x + down(F.gelu(up(self.norm2(x))))


class FlatBlock(nn.Module):
    """Every projection directly in the block, no attention or MLP module, named so no rule recognises them: it
    trains under tensor parallel from an explicit map (:data:`PLANS`)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.fc_a, self.fc_b = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, -1, 8).transpose(1, 2) for p in (self.q, self.k, self.v))  # heads of 8
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.o(y)
        return x + self.fc_b(F.silu(self.fc_a(self.norm2(x))))


class TorchNetwork(nn.Module):
    def __init__(self, block: str, vocab: int = VOCAB, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            FlatBlock(dim, heads) if block == "flat" else
            TorchBlock(dim, heads, ("fc1", "fc2") if block == "mha" else ("lin_in", "lin_out"))
            for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class TorchLM(SGDModule):
    def __init__(self, block: str) -> None:
        super().__init__()
        self.model = TorchNetwork(block)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)


# ------------------------------------------------------------------------------------- hybrid layer lists
class SharedTransformer(nn.Module):
    """Attention (SDPA) and an MLP that several layers call (Zamba's shared transformer block, Glorioso et al. 2024):
    one module at every position that references it, with a low-rank adapter per position on its input (Zamba2's),
    kept in a list of two identical entries inside it."""

    def __init__(self, dim: int, heads: int, positions: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)
        self.adapters = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4, bias=False), nn.Linear(4, dim, bias=False))
                                      for _ in range(positions))

    def forward(self, x: torch.Tensor, position: int) -> torch.Tensor:
        B, T, _ = x.shape
        x = x + self.adapters[position](x)
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.o_proj(y)
        h = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class SharedAttentionLayer(nn.Module):
    """A layer that runs the shared block at its position and adds it through a projection of its own."""

    def __init__(self, shared: SharedTransformer, dim: int, position: int) -> None:
        super().__init__()
        self.position = position
        self.norm = nn.RMSNorm(dim)
        self.shared = shared
        self.linear = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.shared(self.norm(x), self.position))


class ConvLayer(nn.Module):
    """Mixes the tokens through a gated causal depthwise convolution along the sequence (LFM2's short convolution,
    Mamba's conv1d), then an MLP: no attention."""

    def __init__(self, dim: int, kernel: int = 3) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.in_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, padding=kernel - 1)
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        a, gate = self.in_proj(self.norm1(x)).chunk(2, dim=-1)
        mixed = self.conv(a.transpose(1, 2))[..., :T].transpose(1, 2)  # position t sees t - 2 .. t
        x = x + self.out_proj(mixed * F.silu(gate))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class HybridNetwork(nn.Module):
    """A layer list of two classes, convolution and attention layers interleaved (as Jamba, Zamba and LFM2 do), whose
    attention layers call one shared block."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        shared = SharedTransformer(dim, heads, positions=layers // 2)
        self.layers = nn.ModuleList(SharedAttentionLayer(shared, dim, i // 2) if i % 2 else ConvLayer(dim)
                                    for i in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class HybridLM(SGDModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.model = HybridNetwork(**kwargs)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)


# Explicit model maps (the strategy's ``model_map`` argument, as in YAML) for models no rule recognises.
PLANS: dict[str, dict] = {
    "flat_block": {"blocks": "model.blocks", "embedding": "model.embed", "final_norm": "model.norm",
                   "head": "model.head",
                   "styles": {"model.blocks.*.q": "colwise", "model.blocks.*.k": "colwise",
                              "model.blocks.*.v": "colwise", "model.blocks.*.o": "rowwise",
                              "model.blocks.*.fc_a": "colwise", "model.blocks.*.fc_b": "rowwise",
                              "model.blocks.*.norm1": "sequence", "model.blocks.*.norm2": "sequence",
                              "model.embed": "vocab", "model.head": "colwise", "model.norm": "sequence"}},
}


# --------------------------------------------------------------------------------- the architectures
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, use_cache=False,
               max_position_embeddings=SEQ_LEN)
ARCHITECTURES: dict[str, dict] = {
    # untied, Llama naming: the reference point
    "llama": dict(model_type="llama", intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=False),
    # tied head, attention biases (q/k/v)
    "qwen2": dict(model_type="qwen2", intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=True),
    # q/k norms per head, tied head
    "qwen3": dict(model_type="qwen3", intermediate_size=64, num_key_value_heads=2, head_dim=8,
                  tie_word_embeddings=True),
    # final-logit and attention soft-capping, embedding scaling, tied head, sliding window (eager attention:
    # transformers' SDPA path has no soft-capping)
    "gemma2": dict(model_type="gemma2", intermediate_size=64, num_key_value_heads=2, head_dim=8,
                   final_logit_softcapping=3.0, attn_logit_softcapping=5.0, sliding_window=8,
                   tie_word_embeddings=True),
    # q/k norms per head, embedding scaling, tied head, local and global attention layers
    "gemma3_text": dict(model_type="gemma3_text", intermediate_size=64, num_key_value_heads=2, head_dim=8,
                        sliding_window=8, tie_word_embeddings=True),
    # GPT-2: Conv1D (transposed weights), fused c_attn, learned positions, tied head
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=SEQ_LEN, n_inner=64,
                 vocab_size=VOCAB, tie_word_embeddings=True, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0),
    # GPT-NeoX: fused query_key_value (per head), parallel residual, final_layer_norm, partial rotary
    "gpt_neox": dict(model_type="gpt_neox", intermediate_size=64, rotary_pct=0.5, use_parallel_residual=True,
                     tie_word_embeddings=False),
    # Phi-3: fused qkv_proj and gate_up_proj
    "phi3": dict(model_type="phi3", intermediate_size=64, num_key_value_heads=4, tie_word_embeddings=False,
                 pad_token_id=0),
    # OLMo 2: q/k norms over the whole projection width
    "olmo2": dict(model_type="olmo2", intermediate_size=64, num_key_value_heads=4, tie_word_embeddings=False,
                  pad_token_id=0),
    # Phi-2: parallel residual, dense/fc1/fc2 naming, final_layernorm, partial rotary, biases
    "phi": dict(model_type="phi", intermediate_size=64, partial_rotary_factor=0.5, tie_word_embeddings=False),
    # Qwen2-MoE: routed experts plus a gated shared expert
    "qwen2_moe": dict(model_type="qwen2_moe", intermediate_size=64, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      num_key_value_heads=2, tie_word_embeddings=False),
    # DeepSeek-V3: multi-head latent attention, a dense first block, MoE with a shared expert
    "deepseek_v3": dict(model_type="deepseek_v3", intermediate_size=64, moe_intermediate_size=16,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                        qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4, tie_word_embeddings=False),
}


# Families checked in the layouts their traits meet (TRAIT_CELLS), not in every layout of the zoo.
TRAIT_FAMILIES: dict[str, dict] = {
    # experts in fused 3-D weights with [experts, out] biases, a router with a bias, per-head attention sinks (eager
    # attention: transformers has no SDPA path for sinks), sliding-window and full layers
    "gpt_oss": dict(model_type="gpt_oss", intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                    num_key_value_heads=2, head_dim=8, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False),
    # experts called on every token once per expert, expert by expert, after a sigmoid router; a shared expert;
    # chunked attention and a NoPE layer
    "llama4_text": dict(model_type="llama4_text", intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
                        num_experts_per_tok=1, interleave_moe_layer_step=2, num_key_value_heads=2,
                        attention_chunk_size=8, no_rope_layers=[1, 0], tie_word_embeddings=False),
    # experts' weights in a child, [experts x ffn, hidden]; fused Wqkv with clipping
    "dbrx": dict(model_type="dbrx", d_model=32, n_heads=4, n_layers=2, max_seq_len=SEQ_LEN, vocab_size=VOCAB,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2), tie_word_embeddings=False,
                 use_cache=False),
    # sampled routing in training (sparsemixer: Gumbel draws)
    "phimoe": dict(model_type="phimoe", intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                   num_key_value_heads=2, tie_word_embeddings=False),
    # a softmax top-k router module of its own (Qwen3-MoE's transformers 5 layout), q/k norms
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                      num_experts_per_tok=2, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False),
    # a dense first block, grouped sigmoid routing with a correction bias, shared experts
    "glm4_moe": dict(model_type="glm4_moe", intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                     num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                     num_key_value_heads=2, head_dim=8, tie_word_embeddings=False),
    # sliding-window and full layers, q/k norms, no norm before attention (EXAONE 4); SDPA and eager
    "exaone4": dict(model_type="exaone4", intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False),
}
# Hybrid layer lists: attention layers among recurrent or convolution layers, and a block several layers share.
HYBRID_FAMILIES: dict[str, dict] = {
    # Mamba2 layers and hybrid layers that call one shared transformer block (its parameters tied across the
    # layers, with per-position adapters inside it) on the layer's input concatenated with the embedding; tied head
    "zamba2": dict(model_type="zamba2", num_hidden_layers=4, intermediate_size=64, num_key_value_heads=4,
                   mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, mamba_ngroups=1, adapter_rank=8,
                   layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_mem_blocks=1,
                   tie_word_embeddings=True),  # (transformers ties the shared block only along with the head)
    # Mamba layers and attention layers of two classes, an MoE feed-forward in every other layer; a
    # base_model_tp_plan for the attention layers
    "jamba": dict(model_type="jamba", num_hidden_layers=4, intermediate_size=64, num_key_value_heads=2,
                  attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=4, tie_word_embeddings=False),
    # gated short convolutions and attention layers (one class, two operators)
    "lfm2": dict(model_type="lfm2", num_hidden_layers=4, intermediate_size=64, num_key_value_heads=2,
                 layer_types=["conv", "full_attention", "conv", "full_attention"], tie_word_embeddings=False),
}
# Encoder-decoders whose shared embedding, encoder and decoder embed_tokens and head are one tensor of four names.
SEQ2SEQ_FAMILIES: dict[str, dict] = {
    "bart": dict(model_type="bart", vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                 max_position_embeddings=SEQ_LEN, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                 tie_word_embeddings=True, use_cache=False),
    "t5": dict(model_type="t5", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
               num_heads=4, dropout_rate=0.0, tie_word_embeddings=True, use_cache=False),
}
TRAIT_FAMILIES["exaone4_eager"] = TRAIT_FAMILIES["exaone4"]
EAGER = ("gemma2", "gpt_oss", "exaone4_eager")  # models built with eager attention

# The layouts (tests/test_zoo.py: LAYOUTS) each family is held to.
TRAIT_CELLS: dict[str, tuple[str, ...]] = {
    "ep2-zero3": ("gpt_oss", "llama4_text", "dbrx", "phimoe"),
    "ep2xtp2-sp": ("qwen3_moe", "glm4_moe", "llama4_text"),
    "cp2xtp2-sp": ("exaone4", "exaone4_eager", "gpt_oss"),
    "tp2": ("phimoe", "gpt_oss"),  # tensor parallel routes every token on every rank: the same draws
}

TORCH_MODELS = {"mha": "mha", "custom_names": "custom", "flat_block": "flat"}


def make_model(name: str) -> pl.LightningModule:
    if name == "nanogpt":
        return NanoGPT()
    if name in TORCH_MODELS:
        return TorchLM(TORCH_MODELS[name])
    if name in LITGPT_CONFIGS:
        return LitGPTLM(**LITGPT_CONFIGS[name])
    if name in SEQ2SEQ_FAMILIES:
        return Seq2SeqLM(SEQ2SEQ_FAMILIES[name])
    config = dict(ARCHITECTURES.get(name) or TRAIT_FAMILIES.get(name) or HYBRID_FAMILIES[name])
    if config["model_type"] not in ("gpt2", "dbrx"):  # those two name their sizes their own way
        config = {**_COMMON, **config}
    return HuggingFaceLM(config, attention="eager" if name in EAGER else "sdpa")


# litgpt is a test dependency installed without its own pins (README), skipped where it is missing.
LITGPT_MODELS = tuple(LITGPT_CONFIGS)  # litgpt is installed by the README's test command: missing, these fail
MODELS = (*ARCHITECTURES, "nanogpt", *TORCH_MODELS, *LITGPT_MODELS)
MOE_MODELS = ("qwen2_moe", "deepseek_v3")  # the ones with experts to split


def factory(name: str) -> Any:
    """A picklable zero-argument constructor of zoo model ``name``."""
    return functools.partial(make_model, name)
