"""lowp.optim.convert: keeping modules in fp32, moving fp32 masters into bf16 + compensation
without loss, and exporting the full-precision weights."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import lowp.optim as lo
from lowp.optim.convert import cast_model, full_precision_state_dict, full_precision_weights, load_full_precision


pytestmark = pytest.mark.usefixtures("one_thread")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.rotary_emb = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 2)


def test_cast_model_keeps_norm_layers_and_named_modules_in_fp32():
    net = cast_model(_Net(), torch.bfloat16)
    assert net.fc.weight.dtype == net.head.bias.dtype == torch.bfloat16
    assert net.norm.weight.dtype == net.rotary_emb.weight.dtype == torch.float32
    everything = cast_model(_Net(), torch.float16, keep_types=(), keep_names=())
    assert all(p.dtype == torch.float16 for p in everything.parameters())
    with pytest.raises(ValueError, match="dtype"):
        cast_model(_Net(), torch.int8)


@pytest.mark.parametrize("mode", ["kahan", "exact", "exact8", "nearest"])
def test_fp32_checkpoint_moves_into_bf16_and_back(mode):
    torch.manual_seed(0)
    fp32 = _Net()
    torch_opt = torch.optim.AdamW(fp32.parameters(), lr=1e-2)
    for p in fp32.parameters():
        p.grad = torch.randn_like(p)
    torch_opt.step()
    masters = [p.detach().clone() for p in fp32.parameters()]

    low = cast_model(_Net(), torch.bfloat16, keep_types=(), keep_names=())
    opt = lo.AdamW(low.parameters(), lr=1e-2, mode=mode, state_dtype=torch.float32)
    load_full_precision(opt, masters, torch_opt.state_dict())
    held = full_precision_weights(opt)
    for m, h, p in zip(masters, held, low.parameters()):
        if mode == "exact8":   # the nearest pair (ties away), whose bf16 half is rn of the pair, not of m
            assert torch.equal(h.view(torch.int32), (m.view(torch.int32) + 0x80) & ~0xFF)
            assert torch.equal(p.float(), ((h.view(torch.int32) + 0x8000) & ~0xFFFF).view(torch.float32))
            continue
        assert torch.equal(p.float(), m.bfloat16().float())                # visible weight: rn(master)
        if mode == "exact":
            assert torch.equal(h, m)                                       # nothing lost at all
        elif mode == "kahan":
            assert float((h - m).abs().max()) <= float(m.abs().max()) * 2.0 ** -16   # 16-bit significand pair
            # k = m - rn(m) is exact in fp32 and rounded once to bf16: a 2**-8 relative residual
            assert float((h - m).norm()) <= 2.0 ** -8 * float((p.detach().float() - m).norm())
    first = next(iter(low.parameters()))
    assert opt.state[first]["step"] == 1
    assert torch.equal(opt.state[first]["exp_avg"], torch_opt.state[next(iter(fp32.parameters()))]["exp_avg"])
    sd = full_precision_state_dict(low, opt)
    assert sd["fc.weight"].dtype == torch.float32 and torch.equal(sd["fc.weight"], held[0])
    with pytest.raises(ValueError, match="weights"):
        load_full_precision(opt, masters[:1])


def test_auto_mode_is_chosen_per_tensor_kahan_for_bf16_plain_for_fp32():
    net = cast_model(_Net(), torch.bfloat16)
    opt = lo.AdamW(net.parameters(), lr=1e-3)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert "compensation" in opt.state[net.fc.weight] and opt.state[net.fc.weight]["exp_avg"].dtype == torch.bfloat16
    assert "compensation" not in opt.state[net.norm.weight]
    assert opt.state[net.norm.weight]["exp_avg"].dtype == torch.float32


def test_load_full_precision_checks_every_weight_before_writing_any():
    net = cast_model(_Net(), torch.bfloat16)
    opt = lo.AdamW(net.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in net.parameters()]
    masters = [torch.randn(p.shape) for p in net.parameters()]
    with pytest.raises(ValueError, match=r"weights\[1\]"):
        load_full_precision(opt, [masters[0], torch.zeros(3), *masters[2:]])
    with pytest.raises(TypeError, match=r"weights\[0\]"):
        load_full_precision(opt, [[1.0], *masters[1:]])
    with pytest.raises(ValueError, match="torch_state"):
        load_full_precision(opt, masters, {"exp_avg": 1})
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))   # nothing was written
    assert not opt.state
