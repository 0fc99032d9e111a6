"""Tiny models and artifacts with random rotations, built in-test (test helper, not a test)."""

from __future__ import annotations

import torch

from oscar.stats.artifact import identity_artifact

SMALL = dict(sink=4, recent=16, page_size=4)  # tiny windows so short prompts reach the INT2 history


def tiny_config(arch: str):
    """A 2-layer config of `arch` ("llama", "qwen3", or else GLM-4 MoE) with 2 KV heads."""
    from transformers import Glm4MoeConfig, LlamaConfig, Qwen3Config

    common = dict(vocab_size=96, hidden_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":  # q/k norm, explicit head_dim
        return Qwen3Config(head_dim=16, **common)
    return Glm4MoeConfig(head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                         first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                         **common)  # partial RoPE, qkv bias, a dense then an MoE layer


_MODELS: dict = {}


def tiny_model(arch: str):
    """The random tiny model of `arch` (seed 0, built once per process), on stock SDPA."""
    from transformers import AutoModelForCausalLM

    if arch not in _MODELS:
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa").eval()
        _MODELS[arch] = m
    m = _MODELS[arch]
    m.set_attn_implementation("sdpa")  # the DynamicCache reference runs on stock SDPA
    return m


def random_artifact(config, seed=0, mean=True):
    """Random orthogonal rotations and key means: exercises every rotation term of the cache."""
    art = identity_artifact(config, variant="random-test")
    g = torch.Generator().manual_seed(seed)
    H, D = art.num_kv_heads, art.head_dim
    for l in range(art.num_layers):
        art.rot_k[l] = torch.linalg.qr(torch.randn(H, D, D, generator=g))[0]
        art.rot_v[l] = torch.linalg.qr(torch.randn(H, D, D, generator=g))[0]
    if mean:
        art.k_mean = [0.3 * torch.randn(H, D, generator=g) for _ in range(art.num_layers)]
    return art


def rotated_artifact(config, quant, seed=1, scaled=False):
    """An artifact of `quant` with, per layer and KV head, a random orthogonal Q: keys rotated by Q, values by Q with
    its columns reversed, key clip 0.9 (per part when keys are split), and key means (0.1 N(0, 1)). scaled: keys by
    Q diag(d), queries by the dual Q diag(1/d), d uniform in [0.3, 2.3) (the `scaled` variant's form)."""
    a = identity_artifact(config, quant)
    g = torch.Generator().manual_seed(seed)
    a.rot_q = [] if scaled else None
    for l in range(a.num_layers):
        q, _ = torch.linalg.qr(torch.randn(a.num_kv_heads, a.head_dim, a.head_dim, generator=g))
        a.rot_k[l], a.rot_v[l] = q, q.flip(-1)
        if scaled:
            d = torch.rand(a.num_kv_heads, 1, a.head_dim, generator=g) * 2 + 0.3
            a.rot_k[l], a.rot_q = q * d, a.rot_q + [q / d]
        a.clip_k[l] = torch.full((a.num_kv_heads, 2) if quant.key_split else (a.num_kv_heads,), 0.9)
    a.k_mean = [torch.randn(a.num_kv_heads, a.head_dim, generator=g) * 0.1 for _ in range(a.num_layers)]
    return a
