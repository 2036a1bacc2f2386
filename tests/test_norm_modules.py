"""Safe RMSNorm/LayerNorm: drop-in compatibility, fp64 gradcheck, and fp16/bf16 forward and
backward accuracy against an fp64 reference on inputs that break the plain formula."""
import math

import pytest
import torch

from lowp.norms import LayerNorm, RMSNorm
from lowp.norms.module_check import module_scores, reference_norm
from lowp.ulp import ulp_error


@pytest.mark.parametrize("cls,torch_cls", [(RMSNorm, torch.nn.RMSNorm), (LayerNorm, torch.nn.LayerNorm)])
def test_state_dict_and_arguments_match_torch(cls, torch_cls):
    ours, theirs = cls((4, 8), eps=1e-6), torch_cls((4, 8), eps=1e-6)
    assert isinstance(ours, torch_cls)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 4, 8)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    plain = cls(8, elementwise_affine=False)
    assert plain.weight is None
    torch.testing.assert_close(plain(x[0]), torch_cls(8, elementwise_affine=False)(x[0]), rtol=1e-5, atol=1e-5)


def test_layernorm_without_bias_and_rms_default_eps():
    ln = LayerNorm(8, bias=False)
    assert ln.bias is None and "bias" not in ln.state_dict()
    x = torch.randn(5, 8)
    torch.testing.assert_close(ln(x), torch.nn.LayerNorm(8, bias=False)(x), rtol=1e-5, atol=1e-5)
    rms = RMSNorm(8)  # eps=None: finfo(x.dtype).eps, as torch
    torch.testing.assert_close(rms(x), torch.nn.RMSNorm(8)(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
def test_gradcheck_float64(cls):
    torch.manual_seed(0)
    m = cls((3, 4), eps=1e-3).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    params = tuple(m.parameters())
    assert torch.autograd.gradcheck(lambda x, *p: m(x), (x, *params))


def test_bad_input_shape_and_dtype():
    with pytest.raises(ValueError, match="input"):
        RMSNorm(8)(torch.randn(3, 7))
    with pytest.raises(TypeError, match="input"):
        LayerNorm(8)(torch.ones(3, 8, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("center", [False, True])
def test_hard_inputs_forward_within_2_ulp_and_backward_accurate(dtype, center):
    scores = module_scores(dtype, center)
    for s in scores:
        assert s.max_ulp <= 2, s
        assert s.grad_finite, s
        assert s.grad_error <= 2 * torch.finfo(dtype).eps, s
    # fp16 zero rows with eps = 1e-12 have a true gradient of 1e6 > 65504: nothing to compare there
    assert sum(s.grad_rows for s in scores) >= 150


def test_layernorm_near_fp16_max():
    """fp16 values near 65504 (torch 2.13's own LayerNorm is off by hundreds of ulps here, see docs)."""
    x = (65504 * (1 - torch.rand(16, 256, generator=torch.Generator().manual_seed(3)) * 0.01)).half()
    _, ref = reference_norm(x, torch.ones(256), torch.zeros(256), 1e-5, True)
    assert ulp_error(LayerNorm(256).half()(x).double(), ref.detach(), torch.float16).max() <= 2


@pytest.mark.parametrize("dtype,value", [(torch.float16, 60000.0), (torch.bfloat16, 2.0**100),
                                         (torch.bfloat16, 2.0**-130)])
def test_layernorm_constant_rows_with_tiny_eps_give_the_bias(dtype, value):
    """Variance 0 and eps = 1e-12: after scaling eps must not underflow to 0 (0 * inf = NaN)."""
    ln = LayerNorm(64, eps=1e-12).to(dtype)
    with torch.no_grad():
        ln.bias.fill_(0.25)
    x = torch.full((3, 64), value, dtype=dtype, requires_grad=True)
    y = ln(x)
    assert torch.equal(y, torch.full_like(y, 0.25))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_float32_rows_beyond_the_square_range():
    """fp32 rows whose squares overflow or underflow fp32: torch 2.13 returns 0 for [1e30, 1e30]."""
    x = torch.tensor([[1e30, 1e30], [1e-40, 1e-40], [3e38, -3e38]])
    y = RMSNorm(2, eps=0.0)(x)
    assert torch.allclose(y, torch.sign(x), rtol=1e-6, atol=0)
    x = torch.tensor([[1e30, -1e30], [1e-40, -1e-40], [3e38, -3e38]])  # equal values would be 0/0
    z = LayerNorm(2, eps=0.0)(x)
    assert torch.allclose(z, torch.sign(x), rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_matches_cpu_on_hard_rows(dtype):
    """The native path on CUDA (not run on the CPU-only CI) gives the CPU's results within 1 ulp."""
    from lowp.norms import vector_norm
    from lowp.norms.module_check import hard_rows

    for rows in hard_rows(dtype).values():
        x = rows.to(dtype)
        for module in (RMSNorm(256, eps=1e-12), LayerNorm(256, eps=1e-12)):
            module = module.to(dtype)
            cpu = module(x).double()
            gpu = module.cuda()(x.cuda()).double().cpu()
            assert (ulp_error(gpu, cpu, dtype) <= 1).all()
        assert (ulp_error(vector_norm(x.cuda()).double().cpu(), vector_norm(x).double(), dtype) <= 1).all()


def _constant_row_values(dtype: torch.dtype) -> torch.Tensor:
    """Values across the whole range of ``dtype``, both signs, subnormals to the maximum: every
    finite value of a 16-bit format; for fp32/fp64 every binade with 3 random significands each."""
    info = torch.finfo(dtype)
    if info.bits == 16:
        bits = torch.arange(0, 2**15, dtype=torch.int32).to(torch.int16)
        v = bits.view(dtype)
        v = v[torch.isfinite(v) & (v != 0)]
    else:
        g = torch.Generator().manual_seed(5)
        mant = {torch.float32: 23, torch.float64: 52}[dtype]
        lowest = math.frexp(info.smallest_normal)[1] - 1 - mant  # exponent of the smallest subnormal
        e = torch.arange(lowest, math.frexp(info.max)[1], dtype=torch.float64).repeat_interleave(3)
        frac = 1 + torch.randint(0, 2**min(mant, 52), e.shape, generator=g).double() / 2**min(mant, 52)
        v = torch.cat([torch.ldexp(frac, e).to(dtype), torch.tensor([info.max, info.max / 2], dtype=dtype)])
        v = v[v != 0]
    return torch.cat([v, -v])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_layernorm_rows_of_equal_values_give_exactly_the_bias_over_the_whole_range(dtype):
    """x - mean(x) = 0 exactly, so the output is the bias and the gradient of sum(y) is 0, for every
    magnitude (the plain mean of 1.7e38 * 7 overflowed fp32 and gave NaN; see docs/norms.md)."""
    values = _constant_row_values(dtype)
    ln = LayerNorm(7).to(dtype)
    with torch.no_grad():
        ln.bias.copy_(torch.linspace(-1, 1, 7, dtype=dtype))
    x = values.unsqueeze(-1).expand(-1, 7).contiguous().requires_grad_()
    y = ln(x)
    assert torch.equal(y, ln.bias.detach().expand_as(y))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert torch.equal(ln.weight.grad, torch.zeros_like(ln.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_equal_rows_near_max_have_the_fp64_gradient(dtype):
    """Random weight and upstream gradient on rows of max/2 and max: dx = r (g' - mean g') with
    r = 1/sqrt(eps), as the fp64 formula gives."""
    v = torch.finfo(dtype).max
    x = torch.tensor([[v / 2] * 16, [v] * 16, [-v] * 16], dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    ln = LayerNorm(16).to(dtype)
    with torch.no_grad():
        ln.weight.copy_(torch.rand(16, generator=gen) + 0.5)
    xg = x.clone().requires_grad_()
    gy = torch.randn(3, 16, generator=gen).to(dtype)
    ln(xg).backward(gy)
    x64, ref = reference_norm(x, ln.weight, ln.bias, 1e-5, True)
    ref.backward(gy.double())
    err = (xg.grad.double() - x64.grad).abs().amax(-1) / x64.grad.abs().amax(-1)
    assert (err <= 2 * torch.finfo(dtype).eps).all(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_random_rows_near_max_match_fp64(dtype):
    """Rows near max/2 and near max, same sign or mixed. bf16 (fp32 opmath): forward within 2 ulp,
    gradient within 2 eps of the row's largest true gradient (the hard-row table's tolerances).
    fp32 computes in fp32, so both errors scale with the condition number max|x| / std(x) of
    centering: within 4 eps times it (documented in docs/norms.md)."""
    gen = torch.Generator().manual_seed(6)
    info = torch.finfo(dtype)
    u = torch.rand(12, 64, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(12, 64, generator=gen) < 0.5, -1.0, 1.0).double()
    rows = torch.cat([info.max / 2 * (1 + u[:4] * 2**-10), info.max * (1 - u[4:8] * 0.01),
                      info.max * (1 - u[8:] * 0.5) * sign[8:]])
    x = rows.to(dtype)
    ln = LayerNorm(64).to(dtype)
    with torch.no_grad():
        ln.weight.copy_(torch.rand(64, generator=gen) + 0.5)
        ln.bias.copy_(torch.randn(64, generator=gen) * 0.1)
    xg = x.clone().requires_grad_()
    y = ln(xg)
    gy = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(gy)
    x64, ref = reference_norm(x, ln.weight, ln.bias, 1e-5, True)
    ref.backward(gy.double())
    assert torch.isfinite(y).all() and torch.isfinite(xg.grad).all()
    grad_err = (xg.grad.double() - x64.grad).abs().amax(-1) / x64.grad.abs().amax(-1)
    if dtype == torch.bfloat16:
        assert ulp_error(y.detach().double(), ref.detach(), dtype).max() <= 2
        assert (grad_err <= 2 * info.eps).all(), grad_err
    else:
        kappa = x64.detach().abs().amax(-1) / x64.detach().std(-1, unbiased=False)
        assert ((y.detach().double() - ref.detach()).abs().amax(-1) <= 4 * info.eps * kappa).all()
        assert (grad_err <= 4 * info.eps * kappa).all(), grad_err / kappa
