"""Bad tensors given to ``lowp.quantize``, ``lowp.norms.vector_norm`` and the norm modules fail
with one error that names the argument: ``TypeError`` for a dtype that is not floating (integer,
bool, complex), ``ValueError`` for a meta tensor (no values), a sparse or a nested tensor. And
``LayerNorm(0)`` / ``RMSNorm(0)`` give what torch's modules give on a ``(3, 0)`` input."""
from __future__ import annotations

import pytest
import torch

import lowp
from lowp.norms import LayerNorm, RMSNorm, vector_norm

BAD_TENSORS = {
    "meta": (lambda: torch.ones(3, 4, device="meta"), ValueError, "a meta tensor has no values"),
    "sparse_coo": (lambda: torch.ones(3, 4).to_sparse(), ValueError, "dense .*sparse_coo"),
    "sparse_csr": (lambda: torch.ones(3, 4).to_sparse_csr(), ValueError, "dense .*sparse_csr"),
    "complex": (lambda: torch.ones(3, 4, dtype=torch.complex64), TypeError, "floating-point .*complex64"),
    "int": (lambda: torch.ones(3, 4, dtype=torch.int32), TypeError, "floating-point .*int32"),
    "bool": (lambda: torch.ones(3, 4, dtype=torch.bool), TypeError, "floating-point .*bool"),
    "list": (lambda: [[1.0] * 4] * 3, TypeError, "torch.Tensor"),
}

#: every way in: (callable, the argument's name in messages)
ENTRY_POINTS = {
    "quantize": (lambda x: lowp.quantize(x, "fp16"), "x"),
    "quantize emulated": (lambda x: lowp.quantize(x, "e3m2", "up", native=False), "x"),
    "quantize stochastic": (lambda x: lowp.quantize(x, "bf16", "stochastic"), "x"),
    "quantize_ste": (lambda x: lowp.quantize_ste(x, "fp16"), "x"),
    "vector_norm": (lambda x: vector_norm(x), "x"),
    "vector_norm naive fp16": (lambda x: vector_norm(x, method="naive", compute="fp16", format="fp16"), "x"),
    "RMSNorm": (lambda x: RMSNorm(4)(x), "input"),
    "LayerNorm": (lambda x: LayerNorm(4)(x), "input"),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("bad", list(BAD_TENSORS))
def test_bad_tensors_raise_an_error_naming_the_argument(entry, bad):
    make, error, message = BAD_TENSORS[bad]
    call, name = ENTRY_POINTS[entry]
    with pytest.raises(error, match=f"^{name}: .*{message}"):
        call(make())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("entry", ["quantize", "vector_norm", "RMSNorm", "LayerNorm"])
def test_nested_tensors_are_refused(entry):
    call, name = ENTRY_POINTS[entry]
    nested = torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)])
    with pytest.raises(ValueError, match=f"^{name}: expected a dense .*nested tensor"):
        call(nested)


def test_empty_meta_tensor_is_refused_too():
    """Refused whatever the size, so that the answer does not depend on the path taken."""
    with pytest.raises(ValueError, match="^x: a meta tensor"):
        lowp.quantize(torch.ones(0, device="meta"), "fp16")


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
def test_module_with_meta_parameters_names_the_parameter(cls):
    module = cls(4, device="meta")
    with pytest.raises(ValueError, match="^weight: a meta tensor has no values; materialise the module"):
        module(torch.ones(3, 4))
    module.to_empty(device="cpu")
    module.reset_parameters()
    assert module(torch.ones(3, 4)).shape == (3, 4)


def test_layernorm_meta_bias_is_named():
    module = LayerNorm(4)
    module.bias = torch.nn.Parameter(torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="^bias: a meta tensor"):
        module(torch.ones(3, 4))


# ---- an empty normalized_shape: as torch ------------------------------------------------------

CASES = [(0, (3, 0)), (0, (0,)), (0, (0, 0)), ((2, 0), (5, 2, 0)), ((0, 2), (5, 0, 2))]


@pytest.mark.parametrize("name", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("shape,size", CASES, ids=[f"{s}-{x}" for s, x in CASES])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_empty_normalized_shape_matches_torch(name, shape, size, affine, dtype):
    ours = getattr(lowp.norms, name)(shape, elementwise_affine=affine, dtype=dtype)
    theirs = getattr(torch.nn, name)(shape, elementwise_affine=affine, dtype=dtype)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x_ours = torch.ones(size, dtype=dtype, requires_grad=True)
    x_theirs = torch.ones(size, dtype=dtype, requires_grad=True)
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    assert y_ours.shape == y_theirs.shape == size and y_ours.dtype == y_theirs.dtype == dtype
    assert y_ours.requires_grad == y_theirs.requires_grad
    y_ours.sum().backward()
    y_theirs.sum().backward()
    assert x_ours.grad is not None and x_theirs.grad is not None and x_ours.grad.shape == x_theirs.grad.shape
    for (n, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert p.grad is not None and q.grad is not None and p.grad.shape == q.grad.shape, n


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("name", ["RMSNorm", "LayerNorm"])
def test_empty_normalized_shape_keeps_a_half_input_dtype_with_float_weights(name):
    """torch returns the input's dtype here too (fp16 input, fp32 weight)."""
    x = torch.ones(3, 0, dtype=torch.float16)
    ours = getattr(lowp.norms, name)(0)(x)
    theirs = getattr(torch.nn, name)(0)(x)
    assert ours.shape == theirs.shape == (3, 0) and ours.dtype == theirs.dtype == torch.float16


def test_empty_normalized_shape_without_grad():
    with torch.no_grad():
        y = LayerNorm(0)(torch.ones(3, 0))
    assert y.shape == (3, 0) and not y.requires_grad
