"""Safe RMSNorm/LayerNorm: drop-in compatibility, fp64 gradcheck, and fp16/bf16 forward and
backward accuracy against an fp64 reference on inputs that break the plain formula."""
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


@pytest.mark.parametrize("dtype,value", [(torch.float16, 60000.0), (torch.bfloat16, 2.0**100), (torch.bfloat16, 2.0**-130)])
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
