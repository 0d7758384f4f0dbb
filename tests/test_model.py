"""The model: MiniMind's key names, tied head, and load_model for every file kind and dtype."""

from __future__ import annotations

import pytest
import torch

from exactresume.config import PRESETS, ModelConfig
from exactresume.core.model import MiniMindLM, infer_config
from exactresume.store.weights import save_weights
from exactresume.training.inference import load_model

LAYER_KEYS = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def minimind_keys(layers: int) -> set[str]:
    """MiniMind's state-dict names, written out from its model definition."""
    keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    return keys | {f"model.layers.{i}.{key}" for i in range(layers) for key in LAYER_KEYS}


def test_state_dict_keys_are_minimind_keys():
    model = MiniMindLM(ModelConfig())
    assert set(model.state_dict()) == minimind_keys(4)


def test_head_is_tied_to_embeddings():
    model = MiniMindLM(ModelConfig())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 1705344


def test_minimind_sizes_match_published_parameter_counts():
    # MiniMind's published sizes: about 26M and 64M parameters (embedding counted once).
    counts = {name: sum(p.numel() for p in MiniMindLM(config).parameters()) for name, config in PRESETS.items()}
    assert 25e6 < counts["minimind-26m"] < 28e6
    assert 60e6 < counts["minimind-64m"] < 70e6


def test_infer_config_reads_shape_off_tensors():
    config = ModelConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, vocab_size=500
    )
    assert infer_config(MiniMindLM(config).state_dict()) == config


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_load_model_expands_any_dtype_to_fp32(tmp_path, dtype):
    torch.manual_seed(0)
    model = MiniMindLM(ModelConfig(hidden_size=64, num_hidden_layers=2, vocab_size=300))
    path = tmp_path / "weights.pth"
    save_weights(path, {k: v.to(dtype) for k, v in model.state_dict().items()})
    loaded = load_model(path)
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(dtype).float()), name


def test_load_model_reads_plain_unsealed_minimind_files(tmp_path):
    # A MiniMind-written file: torch.save of a half-precision state dict with both tied keys.
    model = MiniMindLM(ModelConfig(hidden_size=64, num_hidden_layers=2, vocab_size=300))
    torch.save({k: v.half() for k, v in model.state_dict().items()}, tmp_path / "pretrain_64.pth")
    tokens = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        difference = (load_model(tmp_path / "pretrain_64.pth")(tokens) - model.eval()(tokens)).abs().max().item()
    assert 0 < difference < 1e-2


def test_load_model_reads_resume_file_with_its_config(tmp_path):
    from exactresume.store.access import save_resume
    from exactresume.training.run_identity import RunIdentity

    config = ModelConfig(hidden_size=64, num_hidden_layers=2, vocab_size=300, rope_theta=1e4)
    model = MiniMindLM(config)
    parts = {
        "config": RunIdentity({"model": config.to_dict()}),
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters()),
    }
    save_resume(tmp_path / "resume.pth", parts)
    state = torch.load(tmp_path / "resume.pth", weights_only=True)
    state.update(step=0, gen_state=torch.Generator().get_state(), rng={})
    torch.save(state, tmp_path / "complete.pth")
    assert load_model(tmp_path / "complete.pth").config == config


def test_fused_norm_and_head_loss_have_exact_gradients():
    from torch.autograd import gradcheck

    from exactresume.core.model import _HeadCrossEntropy, _RMSNormFunction

    x, weight = (
        torch.randn(3, 5, 8, dtype=torch.double, requires_grad=True),
        torch.randn(8, dtype=torch.double, requires_grad=True),
    )
    assert gradcheck(lambda a, b: _RMSNormFunction.apply(a, b, 1e-6), (x, weight))
    # 40 tokens over a 7-token vocabulary: several chunks of rows, the last one short.
    hidden, head = (
        torch.randn(40, 6, dtype=torch.double, requires_grad=True),
        torch.randn(7, 6, dtype=torch.double, requires_grad=True),
    )
    targets = torch.randint(0, 7, (40,))
    assert gradcheck(lambda a, b: _HeadCrossEntropy.apply(a, b, targets), (hidden, head))


def test_training_loss_matches_plain_cross_entropy():
    torch.manual_seed(0)
    model = MiniMindLM(ModelConfig(hidden_size=64, num_hidden_layers=2, vocab_size=300))
    inputs, targets = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    fused = model.loss(inputs, targets)
    fused.backward()
    fused_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    plain = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    plain.backward()
    assert abs(fused.item() - plain.item()) < 1e-5
    for name, p in model.named_parameters():
        assert torch.allclose(fused_grads[name], p.grad, atol=1e-6, rtol=1e-4), name
    with torch.no_grad():
        assert abs(model.loss(inputs, targets).item() - plain.item()) < 1e-5
