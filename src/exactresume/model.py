"""A MiniMind-compatible decoder-only transformer, and `load_model` for any weights we write.

RMSNorm, rotary position embeddings (theta 1e6), grouped-query attention with per-head RMSNorm on
queries and keys, a SwiGLU MLP and an `lm_head` tied to `embed_tokens`. State-dict keys are
MiniMind's own (`model.layers.{i}.self_attn.q_proj.weight`, ...), so checkpoints move both ways.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).type_as(x)


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (length, head_dim), in the rotate-half layout."""
    inverse_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), inverse_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, head_dim) by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.dropout = config.dropout
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, length, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, nh, T, hs)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_dropout(self.o_proj(out.transpose(1, 2).reshape(batch, length, -1)))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The `model.` prefix of MiniMind's keys: embeddings, blocks, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MiniMindLM(nn.Module):
    """Decoder with a tied language-model head: token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.model.embed_tokens.weight = self.lm_head.weight
        # Derived from the config, so not part of the state dict (MiniMind's keys have none).
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def _rope(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope_cos.shape[0] < length or self.rope_cos.device != device:
            table_length = max(length, min(self.config.max_position_embeddings, 4096))
            cos, sin = rope_tables(self.config.head_dim, table_length, self.config.rope_theta)
            self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        return self.rope_cos[:length], self.rope_sin[:length]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        cos, sin = self._rope(input_ids.shape[1], input_ids.device)
        x = self.model.dropout(self.model.embed_tokens(input_ids))
        for block in self.model.layers:
            x = block(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; inputs and targets are (B, T) token ids."""
        logits = self(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def infer_config(state_dict: dict[str, torch.Tensor], base: ModelConfig | None = None) -> ModelConfig:
    """Read a MiniMind model's shape off its tensors (rope_theta and eps come from `base`)."""
    base = base or ModelConfig()
    vocab_size, hidden_size = state_dict["model.embed_tokens.weight"].shape
    layer_ids = {int(m.group(1)) for key in state_dict if (m := re.match(r"model\.layers\.(\d+)\.", key))}
    head_dim = state_dict["model.layers.0.self_attn.q_norm.weight"].shape[0]
    return replace(
        base,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=len(layer_ids),
        num_attention_heads=state_dict["model.layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
        num_key_value_heads=state_dict["model.layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
        intermediate_size=state_dict["model.layers.0.mlp.gate_proj.weight"].shape[0],
    )


def model_from_state_dict(state_dict: dict[str, torch.Tensor], config: ModelConfig | None = None) -> MiniMindLM:
    """Build a model for `state_dict` and load it, expanding fp16/bf16 tensors to fp32."""
    config = config or infer_config(state_dict)
    model = MiniMindLM(config)
    weights = {key: value.float() for key, value in state_dict.items()}
    # A file may store the tied matrix under one key only (safetensors refuses shared tensors).
    weights.setdefault("lm_head.weight", weights.get("model.embed_tokens.weight"))
    weights.setdefault("model.embed_tokens.weight", weights["lm_head.weight"])
    model.load_state_dict(weights)
    return model.eval()


def load_model(path: str | Path) -> MiniMindLM:
    """Load a weights file or a resume file (fp32, fp16 or bf16) as an fp32 model in eval mode."""
    from .weights import read_weights  # weights.py knows every file format; imported late to keep this file standalone

    state_dict, config = read_weights(Path(path))
    return model_from_state_dict(state_dict, config)
