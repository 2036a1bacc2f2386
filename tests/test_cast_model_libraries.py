"""cast_model on models of other libraries: Hugging Face's Llama keeps its RMSNorm layers and
rotary embedding in fp32 and still runs forward and backward in bf16, and a lowp optimizer
trains it."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lowp.optim import AdamW
from lowp.optim.convert import cast_model, is_norm_layer


pytestmark = pytest.mark.usefixtures("one_thread")


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def _norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]


def test_llama_rmsnorm_is_recognised_and_kept_in_fp32():
    model = cast_model(_llama(), torch.bfloat16)
    norms = _norms(model)
    assert len(norms) == 5 and all(is_norm_layer(m) for _, m in norms)
    assert all(m.weight.dtype == torch.float32 for _, m in norms)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_kept_llama_forward_is_dtype_safe_and_close_to_fp32():
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    reference = _llama()(ids, labels=ids)
    model = cast_model(_llama(), torch.bfloat16)
    out = model(ids, labels=ids)          # an fp32 RMSNorm output would make the next bf16 Linear raise
    assert out.logits.dtype == torch.bfloat16
    assert abs(float(out.loss) - float(reference.loss)) < 0.02 * float(reference.loss)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in model.parameters() if p.requires_grad)


def test_without_the_hooks_the_fp32_llama_norm_breaks_the_bf16_forward():
    """What the dtype-safe hooks fix: keeping the norms in fp32 through ``keep_types`` alone."""
    model = _llama()
    norm_type = type(_norms(model)[0][1])
    cast_model(model, torch.bfloat16, keep_types=(), keep_norms=False)
    for _, m in _norms(model):
        m.float()
    ids = torch.randint(0, 64, (2, 12))
    with pytest.raises(RuntimeError):
        model(ids)
    assert norm_type.__name__ == "LlamaRMSNorm"


def test_lowp_adamw_trains_a_bf16_llama():
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    model = cast_model(_llama(), torch.bfloat16).train()
    opt = AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = model(ids, labels=ids).loss
        first = float(loss) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.8 * first
    assert all(p.dtype == torch.float32 for _, m in _norms(model) for p in m.parameters())
    kinds = {("compensation" in opt.state[p]) for p in model.parameters()}
    assert kinds == {True, False}     # bf16 weights compensated, fp32 norm weights updated plainly


@pytest.mark.parametrize("name", ["LlamaRMSNorm", "T5LayerNorm", "FusedLayerNorm", "FusedRMSNorm", "LayerNorm2d",
                                  "MixedFusedLayerNorm", "Qwen2RMSNorm", "GemmaRMSNorm", "BatchNorm1d",
                                  "InstanceNorm2d"])
def test_norm_class_names_of_common_libraries_are_recognised(name):
    assert is_norm_layer(type(name, (nn.Module,), {})())


@pytest.mark.parametrize("name", ["Linear", "Normalizer", "NormalLinear", "RotaryEmbedding", "Attention"])
def test_other_class_names_are_not_norms(name):
    assert not is_norm_layer(type(name, (nn.Module,), {})())
