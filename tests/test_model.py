"""Tests of the reference Llama-style model (pure nn.Module and LightningModule), CPU only."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_par.models import LlamaConfig, LlamaLM, Transformer, llama_flops_per_token
from lightning_par.models.llama import apply_rotary, rope_tables

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32)


def tiny(**overrides) -> Transformer:
    return Transformer(LlamaConfig(**{**TINY, **overrides}))


def tokens(B: int = 2, T: int = 16, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_llama_module_does_not_import_lightning():
    # A fresh interpreter where Lightning cannot be imported: the pure model builds and runs without it.
    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys; sys.modules['lightning'] = None; import torch; "
        "from lightning_par.models import LlamaConfig, Transformer; "
        "print(Transformer(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4))(torch.zeros(1, 4).long()).shape)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.split() == ['torch.Size([1,', '4,', '64])'], result.stderr


def test_config_defaults_resolve():
    cfg = LlamaConfig()
    assert cfg.head_dim == 32
    assert cfg.resolved_n_kv_heads == 4
    assert cfg.resolved_ffn_hidden_size == 352  # int(8 * 128 / 3) = 341, rounded up to a multiple of 32
    assert LlamaConfig(ffn_hidden_size=100).resolved_ffn_hidden_size == 100


def test_forward_shapes():
    model = tiny()
    logits = model(tokens())
    assert logits.shape == (2, 16, 64)
    assert torch.isfinite(logits).all()


def test_causality():
    model = tiny()
    x = tokens()
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 64
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_grouped_query_attention():
    model = tiny(n_kv_heads=2)
    attn = model.layers["0"].attention
    assert attn.k_proj.weight.shape == (2 * 8, 32)  # 2 kv heads of head_dim 8
    assert attn.q_proj.weight.shape == (4 * 8, 32)
    logits = model(tokens())
    assert logits.shape == (2, 16, 64)
    logits.sum().backward()
    assert attn.k_proj.weight.grad is not None


def test_gqa_matches_mha_with_repeated_kv_heads():
    # GQA with kv heads copied into an MHA model must give identical outputs (query head h uses kv
    # head h // n_rep).
    torch.manual_seed(0)
    gqa = tiny(n_kv_heads=2)
    mha = tiny()
    sd = gqa.state_dict()
    for name, p in mha.named_parameters():
        src = sd[name]
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            src = src.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
        with torch.no_grad():
            p.copy_(src)
    x = tokens()
    torch.testing.assert_close(gqa(x), mha(x))


def test_attention_head_count_follows_projection_width():
    # Tensor parallel shards q/k/v column-wise; simulate rank 0 of 2 by keeping the first half of the
    # heads: attention must run on 2 local heads without knowing about the sharding.
    model = tiny(n_kv_heads=2)
    attn = model.layers["0"].attention
    local = torch.nn.Module()
    local.head_dim = attn.head_dim
    for name, rows in (("q_proj", 16), ("k_proj", 8), ("v_proj", 8)):
        lin = torch.nn.Linear(32, rows, bias=False)
        lin.weight.data.copy_(getattr(attn, name).weight[:rows])
        setattr(local, name, lin)
    local.o_proj = torch.nn.Identity()
    h = torch.randn(2, 16, 32)
    cos, sin = model.rope(16)
    out = type(attn).forward(local, h, cos, sin)
    assert out.shape == (2, 16, 16)  # 2 local heads x head_dim 8, before the row-parallel o_proj
    reference = copy.deepcopy(attn)
    reference.o_proj = torch.nn.Identity()
    torch.testing.assert_close(out, reference(h, cos, sin)[..., :16])


def test_tied_embeddings_share_one_tensor():
    tied, untied = tiny(tie_embeddings=True), tiny()
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert untied.num_parameters() - tied.num_parameters() == 64 * 32
    # The shared table is the output projection too, so it is kept when excluding the embedding.
    assert tied.num_parameters(exclude_embedding=True) == tied.num_parameters()
    assert untied.num_parameters(exclude_embedding=True) == untied.num_parameters() - 64 * 32
    assert llama_flops_per_token(tied.config) == llama_flops_per_token(untied.config)


def test_flops_per_token_hand_count():
    cfg = LlamaConfig(vocab_size=10, dim=8, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden_size=12, max_seq_len=5)
    # per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192; mlp 3*8*12 = 288 -> 480; 3 layers = 1440;
    # lm_head 8*10 = 80 -> N = 1520. Attention: 12 * 3 * 8 * 5 = 1440.
    assert llama_flops_per_token(cfg) == 6 * 1520 + 1440
    assert llama_flops_per_token(cfg, seq_len=7) == 6 * 1520 + 12 * 3 * 8 * 7
    model = Transformer(cfg)
    assert model.flops_per_token() == 6 * 1520 + 1440
    # N is exactly the non-embedding parameters minus the norm gains.
    n_norm = (2 * 3 + 1) * 8
    assert model.num_parameters(exclude_embedding=True) - n_norm == 1520


def test_init_deterministic_and_scaled():
    torch.manual_seed(123)
    a = tiny()
    torch.manual_seed(123)
    b = tiny()
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    # Scaled init on the residual-stream outputs; unit norm gains.
    big = Transformer(LlamaConfig(dim=256, n_layers=8, n_heads=4))
    out_std = 0.02 / math.sqrt(2 * 8)
    assert big.layers["3"].attention.o_proj.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert big.layers["3"].mlp.down_proj.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert big.layers["3"].mlp.up_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(big.norm.weight, torch.ones(256))


@pytest.mark.parametrize("tie", [False, True])
def test_meta_device_then_initialize_matches_eager(tie):
    # Asserted: after the same seed, initialize() gives bit-identical parameters and rotary tables
    # whether the module was built eagerly or on the meta device and materialised with to_empty.
    eager = tiny(tie_embeddings=tie)
    torch.manual_seed(7)
    eager.initialize()

    with torch.device("meta"):
        lazy = tiny(tie_embeddings=tie)
    assert lazy.embed_tokens.weight.is_meta
    lazy.to_empty(device="cpu")
    torch.manual_seed(7)
    lazy.initialize()

    assert (lazy.lm_head.weight is lazy.embed_tokens.weight) == tie
    for (name, pa), pb in zip(eager.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(pa, pb), name
    torch.testing.assert_close(lazy.rope_cos, eager.rope_cos, rtol=0, atol=0)
    torch.testing.assert_close(lazy.rope_sin, eager.rope_sin, rtol=0, atol=0)
    x = tokens()
    torch.testing.assert_close(lazy(x), eager(x), rtol=0, atol=0)


def test_rope_buffers_not_in_state_dict():
    model = tiny()
    assert not any("rope" in k for k in model.state_dict())
    assert model.rope_cos.shape == (32, 4)


def test_rotary_positions_select_the_same_angles():
    model = tiny()
    cos_full, sin_full = model.rope(16)
    cos_part, sin_part = model.rope(4, positions=torch.arange(4, 8))
    torch.testing.assert_close(cos_part, cos_full[4:8], rtol=0, atol=0)
    torch.testing.assert_close(sin_part, sin_full[4:8], rtol=0, atol=0)

    q = torch.randn(2, 16, 4, 8)  # (B, T, H, D)
    full = apply_rotary(q, cos_full, sin_full)
    part = apply_rotary(q[:, 4:8], cos_part, sin_part)
    torch.testing.assert_close(part, full[:, 4:8], rtol=0, atol=0)

    # The table agrees with the closed form, and rotation preserves norms.
    cos_ref, sin_ref = rope_tables(8, torch.arange(4, 8).double(), 10000.0)
    torch.testing.assert_close(cos_part, cos_ref.float())
    torch.testing.assert_close(full.norm(dim=-1), q.norm(dim=-1))


def test_rotary_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(8, torch.arange(12))
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    rq = apply_rotary(q.expand(1, 12, 1, 8), cos, sin)[0, :, 0]  # (T, D)
    rk = apply_rotary(k.expand(1, 12, 1, 8), cos, sin)[0, :, 0]
    scores = rq @ rk.T  # (T, T)
    torch.testing.assert_close(scores[5, 2], scores[9, 6])
    torch.testing.assert_close(scores[3, 3], scores[10, 10])


def test_forward_with_batched_and_offset_positions():
    model = tiny()
    x = tokens()
    base = model(x)
    torch.testing.assert_close(model(x, positions=torch.arange(16)), base, rtol=0, atol=0)
    torch.testing.assert_close(model(x, positions=torch.arange(16).expand(2, 16)), base, rtol=0, atol=0)
    # Shifting every position leaves attention unchanged (rotary is relative), up to rounding.
    torch.testing.assert_close(model(x, positions=torch.arange(16) + 5), base, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(T=33))


def test_pipeline_style_stages_compose_to_the_full_model():
    torch.manual_seed(0)
    full = tiny(n_layers=4)
    first, last = tiny(n_layers=4), tiny(n_layers=4)
    first.load_state_dict(full.state_dict())
    last.load_state_dict(full.state_dict())
    # Stage 0: embedding + layers 0, 1. Stage 1: layers 2, 3 + norm + head.
    del first.layers["2"], first.layers["3"]
    first.norm = None
    first.lm_head = None
    del last.layers["0"], last.layers["1"]
    last.embed_tokens = None
    assert list(last.layers.keys()) == ["2", "3"]
    assert "layers.2.attention.q_proj.weight" in last.state_dict()

    x = tokens()
    hidden = first(x)
    assert hidden.shape == (2, 16, 32)
    torch.testing.assert_close(last(hidden), full(x), rtol=0, atol=0)
    assert first.num_parameters() + last.num_parameters() == full.num_parameters()
    first.initialize()  # still works with pieces missing
    last.initialize()


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(dim=130, n_heads=4), "130"),
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads (3)"),
        (dict(dim=12, n_heads=4), "head_dim"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(n_layers=-1), "-1"),
        (dict(ffn_hidden_size=0), "ffn_hidden_size"),
        (dict(norm_eps=0.0), "norm_eps"),
    ],
)
def test_config_validation(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        LlamaConfig(**kwargs).validate()
    assert fragment in str(info.value)
    with pytest.raises(ValueError):
        Transformer(LlamaConfig(**kwargs))


def test_lightning_module_rejects_bad_config():
    with pytest.raises(ValueError, match="n_heads"):
        LlamaLM(dim=30, n_heads=4)


def test_lightning_module_contract_and_training_loss_decreases():
    torch.manual_seed(0)
    lm = LlamaLM(vocab_size=16, dim=32, n_layers=2, n_heads=4, max_seq_len=32)
    assert lm.hparams.dim == 32
    pattern = torch.arange(8).repeat(5)[:33]
    batch = torch.stack([pattern, (pattern + 3) % 8])  # (B=2, T+1=33)
    inputs, targets = lm.split_batch(batch)
    assert inputs.shape == targets.shape == (2, 32)
    assert torch.equal(targets[:, :-1], inputs[:, 1:])

    optimizer = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = lm.loss_fn(lm(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(16), rel=0.1)  # small init -> near-uniform predictions
    assert losses[-1] < 0.5 * losses[0], losses


def test_loss_fn_is_mean_cross_entropy_in_fp32():
    lm = LlamaLM(vocab_size=16, dim=32, n_layers=1, n_heads=4, max_seq_len=32)
    logits = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    targets = torch.randint(0, 16, (2, 5))
    loss = lm.loss_fn(logits, targets)
    assert loss.dtype == torch.float32
    ref = -torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(loss, ref)


def test_configure_optimizers_groups_and_schedule():
    lm = LlamaLM(vocab_size=16, dim=32, n_layers=2, n_heads=4, max_seq_len=32,
                 learning_rate=1e-3, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    config = lm.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    no_decay_ids = {id(p) for p in no_decay["params"]}
    model = lm.model
    assert id(model.norm.weight) in no_decay_ids
    assert id(model.layers["0"].attention_norm.weight) in no_decay_ids
    assert id(model.layers["1"].mlp_norm.weight) in no_decay_ids
    assert all(p.dim() >= 2 for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(lm.parameters()))

    # Warmup, then cosine to min_lr_ratio at max_steps.
    schedule = scheduler.lr_lambdas[0]
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.55)
    assert schedule(110) == pytest.approx(0.1)
    assert schedule(500) == pytest.approx(0.1)

    # Detached from a Trainer and no max_steps: constant after warmup.
    constant = LlamaLM(vocab_size=16, dim=32, n_layers=1, n_heads=4, max_seq_len=32)
    schedule = constant.configure_optimizers()["lr_scheduler"]["scheduler"].lr_lambdas[0]
    assert schedule(0) == 1.0 and schedule(10_000) == 1.0


def test_lightning_module_flops_delegates():
    lm = LlamaLM(vocab_size=16, dim=32, n_layers=2, n_heads=4, max_seq_len=32)
    assert lm.flops_per_token(8) == llama_flops_per_token(lm.model.config, 8)
    assert lm.flops_per_token() == lm.model.flops_per_token(32)
