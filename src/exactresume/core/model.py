"""A MiniMind-compatible decoder-only transformer, and `load_model` for any weights we write.

RMSNorm, rotary position embeddings (theta 1e6), grouped-query attention with per-head RMSNorm on
queries and keys, a SwiGLU MLP and an `lm_head` tied to `embed_tokens`. State-dict keys are
MiniMind's own (`model.layers.{i}.self_attn.q_proj.weight`, ...), so checkpoints move both ways.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from exactresume.config import ModelConfig

# The tokens' logits are made this many bytes at a time by the fused head and loss (cache-sized).
LOGIT_CHUNK_BYTES = 4 << 20


class _RMSNormFunction(torch.autograd.Function):
    """weight * x / rms(x) in at least fp32, with its backward written out: half the kernels autograd runs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        inverse_rms = torch.rsqrt(wide.square().mean(-1, keepdim=True).add_(eps))
        normed = wide * inverse_rms
        ctx.save_for_backward(normed, inverse_rms, weight)
        ctx.input_dtype = x.dtype
        return (normed * weight).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        normed, inverse_rms, weight = ctx.saved_tensors
        grad = grad.to(normed.dtype)
        grad_weight = (grad * normed).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        grad_normed = grad * weight
        # d(x * r)/dx with r = rsqrt(mean(x^2) + eps) is r * (g - normed * mean(g * normed)).
        projection = (grad_normed * normed).mean(-1, keepdim=True)
        grad_x = torch.addcmul(grad_normed, normed, projection, value=-1).mul_(inverse_rms)
        return grad_x.to(ctx.input_dtype), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def _rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (length, head_dim), in the rotate-half layout."""
    inverse_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), inverse_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, heads, head_dim) by position; cos and signed_sin are (T, 1, head_dim).

    rotate_half(x) * sin == roll(x, half) * signed_sin, where signed_sin's first half is negated:
    one copy instead of a negation and a concatenation."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
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
        # RoPE while (B, T, nh, hs) is still contiguous; attention takes the transposed views.
        q = _apply_rope(self.q_norm(self.q_proj(x).view(batch, length, self.heads, self.head_dim)), cos, sin)
        k = _apply_rope(self.k_norm(self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),  # (B, nh, T, hs)
            is_causal=True,
            enable_gqa=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.resid_dropout(self.o_proj(out.transpose(1, 2).reshape(batch, length, -1)))


class _HeadCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of the logits hidden @ weight.T, made a chunk of tokens at a time.

    The (tokens, vocab) logits are a step's largest tensor. Each chunk's logits are turned into their
    gradient (softmax - one_hot) / tokens in place while still in cache, and both matrix products of
    the backward pass are done there too; backward() only scales the saved gradients. The logits never
    exist whole, and the passes over them drop from about nine to five.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        tokens, vocab = hidden.shape[0], weight.shape[0]
        chunk = max(16, LOGIT_CHUNK_BYTES // (4 * vocab))
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight)
        losses, buffer = hidden.new_empty(tokens), hidden.new_empty(min(chunk, tokens), vocab)
        for start in range(0, tokens, chunk):
            rows = slice(start, min(start + chunk, tokens))
            h, t = hidden[rows], targets[rows]
            logits = torch.mm(h, weight.t(), out=buffer[: len(t)])  # (chunk, vocab), memory reused
            picked = (torch.arange(len(t)), t)
            target_logits = logits[picked]
            top = logits.amax(-1, keepdim=True)
            probs = logits.sub_(top).exp_()
            total = probs.sum(-1, keepdim=True)
            losses[rows] = (total.log() + top).squeeze(1) - target_logits  # logsumexp - target logit
            probs.div_(total * tokens)
            probs[picked] -= 1.0 / tokens
            torch.mm(probs, weight, out=grad_hidden[rows])
            grad_weight.addmm_(probs.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return losses.mean()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None


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
        """cos and signed sin (see apply_rope), each (length, 1, head_dim)."""
        if self.rope_cos.shape[0] < length or self.rope_cos.device != device:
            table_length = max(length, min(self.config.max_position_embeddings, 4096))
            cos, sin = _rope_tables(self.config.head_dim, table_length, self.config.rope_theta)
            half = self.config.head_dim // 2
            signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
            self.rope_cos, self.rope_sin = cos[:, None].to(device), signed_sin[:, None].to(device)
        return self.rope_cos[:length], self.rope_sin[:length]

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final normed hidden states (B, T, hidden) for token ids (B, T)."""
        cos, sin = self._rope(input_ids.shape[1], input_ids.device)
        x = self.model.dropout(self.model.embed_tokens(input_ids))
        for block in self.model.layers:
            x = block(x, cos, sin)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; inputs and targets are (B, T) token ids."""
        hidden = self.hidden_states(inputs).flatten(0, 1)
        weight = self.lm_head.weight
        if (
            torch.is_grad_enabled()
            and not torch.is_autocast_enabled(hidden.device.type)
            and hidden.dtype == torch.float32
        ):
            return _HeadCrossEntropy.apply(hidden, weight, targets.flatten())
        return F.cross_entropy(F.linear(hidden, weight).float(), targets.flatten())


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
