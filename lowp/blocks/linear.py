"""Fake-quantized training: a linear layer whose three GEMMs see block-quantized operands.

A linear layer ``y = x W^T + b`` runs three GEMMs per training step; a block-format recipe
quantizes each GEMM's two operands in blocks along that GEMM's *reduction* dimension:

=========  ===============================  =========================================
GEMM       computes                         operands, blocked along
=========  ===============================  =========================================
fprop      ``y = x_q W_q^T``                ``x`` and ``W`` along ``in_features``
dgrad      ``dx = dy_q (W^T)_q^T``           ``dy`` and ``W^T`` along ``out_features``
wgrad      ``dW = (dy^T)_q (x^T)_q^T``       ``dy^T`` and ``x^T`` along the tokens
=========  ===============================  =========================================

``x`` is flattened to ``(tokens, in_features)``. The products are computed in fp32 from the
decoded (fake-quantized) operands, as a tensor core with fp32 accumulation would. The bias and
its gradient (``dy`` summed over tokens) are not quantized.

A :class:`BlockRecipe` says, per operand kind (``inputs`` = activations ``x``, ``weights``,
``grads`` = output gradients ``dy``), which format to use: a :class:`~lowp.blocks.BlockFormat`
(1D blocks), an element format such as ``"bf16"`` (each value rounded to nearest, no scale) or
``None`` (left as is). Further ingredients:

* ``weight_2d``: the weight is quantized once in ``b x b`` tiles (``b`` the weight format's block
  size), so fprop and dgrad see the same quantized weight (NVIDIA's NVFP4 recipe, 16x16).
  Without it the weight is quantized twice, along ``in_features`` for fprop and along
  ``out_features`` for dgrad.
* ``grad_rounding="stochastic"`` (with ``random_bits``): output gradients rounded stochastically
  in both dgrad and wgrad; inputs and weights always round to nearest (NVFP4 recipe).
* ``wgrad_hadamard=n``: both wgrad operands rotated by the same seeded random Hadamard transform
  (:func:`~lowp.blocks.random_hadamard`) along the tokens before quantizing; since the rotation is
  orthonormal, ``dW`` is unchanged up to rounding (NVFP4 recipe, ``n = 16``).

Presets (:data:`RECIPES`): ``"none"`` (no quantization; the layer is ``nn.Linear``), ``"bf16"``
(every operand rounded to bf16), ``"mxfp8"`` (MXFP8 e4m3 for all three operands with RCEIL
scales: Mishra et al. 2025, "Recipes for Pre-training LLMs with MXFP8", arXiv:2506.08027),
``"nvfp4"`` (NVFP4 for all three, 16x16 weight tiles, stochastic rounding of gradients, a 16-point
random Hadamard transform on the wgrad inputs: NVIDIA, "Pretraining Large Language Models with
NVFP4", arXiv:2509.25149). NVIDIA's recipe also keeps some layers in bf16; here
:func:`quantize_linears` takes an ``include`` filter for that.

Random draws: each layer owns a ``torch.Generator`` seeded with ``seed``; a backward pass draws
first for dgrad's ``dy`` and then for wgrad's ``dy^T``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn
from torch.nn import functional as F

from lowp.blocks.core import BlockFormat, fake_quantize, get_block_format
from lowp.blocks.hadamard import _check_size, random_hadamard
from lowp.formats import FloatFormat, get_format
from lowp.rounding import fits_in, quantize

__all__ = ["BlockRecipe", "RECIPES", "get_recipe", "BlockQuantLinear", "quantize_linears"]

OperandFormat = Union[BlockFormat, FloatFormat, None]
_OPERANDS = ("inputs", "weights", "grads")


def _operand_format(field: str, spec: object) -> OperandFormat:
    if spec is None or isinstance(spec, (BlockFormat, FloatFormat)):
        fmt = spec
    elif isinstance(spec, str):
        try:
            fmt = get_block_format(spec)
        except ValueError:
            try:
                fmt = get_format(spec)
            except ValueError:
                raise ValueError(f"{field}: {spec!r} is neither a block format nor an element format") from None
    else:
        raise ValueError(f"{field}: expected a BlockFormat, a FloatFormat, a format name or None, "
                         f"got {type(spec).__name__}")
    if isinstance(fmt, BlockFormat):
        if fmt.block_rows != 1:
            raise ValueError(f"{field}: {fmt.name} has {fmt.block_rows}-row tiles; give the 1D format and set "
                             f"weight_2d=True for tiled weights")
        if fmt.hadamard:
            raise ValueError(f"{field}: {fmt.name} has a Hadamard pre-transform; use the recipe's wgrad_hadamard")
    elif isinstance(fmt, FloatFormat) and not fits_in(fmt, get_format("fp32")):
        raise ValueError(f"{field}: {fmt.name} does not fit in fp32")
    return fmt


@dataclass(frozen=True)
class BlockRecipe:
    """Which formats the three GEMMs of a linear layer use (module docstring).

    Args:
        name: a label.
        inputs: format of the activations ``x`` (fprop and wgrad): a :class:`BlockFormat` with 1D
            blocks, a block preset name (``"mxfp8_e4m3"``), an element format (``"bf16"``,
            ``FloatFormat``) rounded to nearest per value, or ``None`` for no rounding.
        weights: format of the weights (fprop and dgrad).
        grads: format of the output gradients ``dy`` (dgrad and wgrad).
        weight_2d: quantize the weight once in ``b x b`` tiles (needs a block format for ``weights``).
        grad_rounding: ``"nearest"`` or ``"stochastic"`` for ``grads`` (block formats only).
        random_bits: random bits per stochastic decision (``None``: every discarded bit).
        wgrad_hadamard: 0, or the size of the random Hadamard transform applied along the tokens to
            both wgrad operands (a power of two).
        hadamard_seed: seed of the transform's random signs.
    """

    name: str
    inputs: Any = None
    weights: Any = None
    grads: Any = None
    weight_2d: bool = False
    grad_rounding: str = "nearest"
    random_bits: int | None = None
    wgrad_hadamard: int = 0
    hadamard_seed: int = 0

    def __post_init__(self) -> None:
        for field in _OPERANDS:
            object.__setattr__(self, field, _operand_format(field, getattr(self, field)))
        if not isinstance(self.weight_2d, bool):
            raise ValueError(f"weight_2d: expected a bool, got {self.weight_2d!r}")
        if self.weight_2d and not isinstance(self.weights, BlockFormat):
            raise ValueError("weight_2d: 2D weight tiles need a block format for weights")
        if self.grad_rounding not in ("nearest", "stochastic"):
            raise ValueError(f"grad_rounding: expected 'nearest' or 'stochastic', got {self.grad_rounding!r}")
        if self.grad_rounding == "stochastic" and not isinstance(self.grads, BlockFormat):
            raise ValueError("grad_rounding: stochastic rounding needs a block format for grads")
        if self.random_bits is not None:
            if self.grad_rounding != "stochastic":
                raise ValueError("random_bits: only meaningful with grad_rounding='stochastic'")
            if isinstance(self.random_bits, bool) or not isinstance(self.random_bits, int) \
                    or not 1 <= self.random_bits <= 24:
                raise ValueError(f"random_bits: expected an int in [1, 24], got {self.random_bits!r}")
        if self.wgrad_hadamard:
            try:
                _check_size(self.wgrad_hadamard)
            except ValueError as exc:
                raise ValueError(f"wgrad_hadamard: {exc}") from None
        if isinstance(self.hadamard_seed, bool) or not isinstance(self.hadamard_seed, int):
            raise ValueError(f"hadamard_seed: expected an int, got {self.hadamard_seed!r}")

    @property
    def quantizes(self) -> bool:
        """Whether any operand is rounded (False for ``"none"``)."""
        return any(getattr(self, f) is not None for f in _OPERANDS)

    def replace(self, **changes: object) -> "BlockRecipe":
        """A copy with some fields changed, e.g. ``get_recipe("nvfp4").replace(wgrad_hadamard=0)``."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def block_sizes(self) -> dict[str, int]:
        """The block size each reduction dimension must be a multiple of: ``in_features`` (fprop),
        ``out_features`` (dgrad) and ``tokens`` (wgrad; the Hadamard size included)."""
        def size(*fmts: OperandFormat) -> int:
            out = 1
            for f in fmts:
                if isinstance(f, BlockFormat):
                    out = max(out, f.block_size)
            return out
        tokens = max(size(self.inputs, self.grads), self.wgrad_hadamard or 1)
        return {"in_features": size(self.inputs, self.weights), "out_features": size(self.grads, self.weights),
                "tokens": tokens}


_MXFP8_RCEIL = get_block_format("mxfp8_e4m3").replace(name="mxfp8_e4m3_rceil", aliases=(), scale_rounding="rceil")
RECIPES: dict[str, BlockRecipe] = {
    "none": BlockRecipe("none"),
    "bf16": BlockRecipe("bf16", "bf16", "bf16", "bf16"),
    "mxfp8": BlockRecipe("mxfp8", _MXFP8_RCEIL, _MXFP8_RCEIL, _MXFP8_RCEIL),
    "nvfp4": BlockRecipe("nvfp4", "nvfp4", "nvfp4", "nvfp4", weight_2d=True, grad_rounding="stochastic",
                         wgrad_hadamard=16),
}


def get_recipe(spec: "str | BlockRecipe") -> BlockRecipe:
    """A :class:`BlockRecipe` by preset name (:data:`RECIPES`) or passed through."""
    if isinstance(spec, BlockRecipe):
        return spec
    if isinstance(spec, str) and spec.lower() in RECIPES:
        return RECIPES[spec.lower()]
    if isinstance(spec, str):
        raise ValueError(f"recipe: unknown recipe {spec!r}; known: {', '.join(RECIPES)}")
    raise TypeError(f"recipe: expected a recipe name or a BlockRecipe, got {type(spec).__name__}")


def _quant(x: torch.Tensor, fmt: OperandFormat, rounding: str = "nearest", recipe: BlockRecipe | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (float32) fake-quantized along its last dimension."""
    if fmt is None:
        return x
    if isinstance(fmt, FloatFormat):
        return quantize(x, fmt, "nearest_even")
    bits = recipe.random_bits if recipe is not None and rounding == "stochastic" else None
    return fake_quantize(x.contiguous(), fmt, rounding, random_bits=bits, generator=generator)


def _two_d(fmt: BlockFormat) -> BlockFormat:
    return fmt.replace(name=f"{fmt.name}_2d_tiles", aliases=(), block_rows=fmt.block_size)


class _BlockLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                recipe: BlockRecipe, generator: torch.Generator) -> torch.Tensor:
        xf, wf = x.float(), weight.float()
        if recipe.weight_2d:
            wq = _quant(wf, _two_d(recipe.weights))  # type: ignore[arg-type]
        else:
            wq = _quant(wf, recipe.weights)
        out = F.linear(_quant(xf, recipe.inputs), wq, None if bias is None else bias.float())
        ctx.save_for_backward(x, weight, wq if recipe.weight_2d else None)
        ctx.recipe, ctx.generator, ctx.has_bias = recipe, generator, bias is not None
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        x, weight, wq2d = ctx.saved_tensors
        recipe: BlockRecipe = ctx.recipe
        gen, mode = ctx.generator, recipe.grad_rounding
        gf = grad.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dgrad: reduction over out_features; W^T blocked along out_features, used as (out, in)
            w = wq2d if wq2d is not None else _quant(weight.float().t(), recipe.weights).t()
            grad_x = _quant(gf, recipe.grads, mode, recipe, gen).mm(w).to(x.dtype)
        if ctx.needs_input_grad[1]:
            # wgrad: reduction over the tokens
            gt, xt = gf.t(), x.float().t()
            if recipe.wgrad_hadamard:
                gt = random_hadamard(gt, recipe.wgrad_hadamard, recipe.hadamard_seed)
                xt = random_hadamard(xt, recipe.wgrad_hadamard, recipe.hadamard_seed)
            grad_w = _quant(gt, recipe.grads, mode, recipe, gen).mm(_quant(xt, recipe.inputs).t()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = gf.sum(0)
        return grad_x, grad_w, grad_b, None, None


class BlockQuantLinear(nn.Linear):
    """``nn.Linear`` whose forward and both backward GEMMs use block-quantized operands (module docstring).

    Args:
        in_features: input features, as ``nn.Linear``'s.
        out_features: output features, as ``nn.Linear``'s.
        bias: whether the layer has a bias, as ``nn.Linear``'s.
        device: the parameters' device, as ``nn.Linear``'s.
        dtype: the parameters' dtype, as ``nn.Linear``'s.
        recipe: a :class:`BlockRecipe` or a preset name (``"mxfp8"``, ``"nvfp4"``, ``"bf16"``, ``"none"``).
        seed: seed of the layer's generator for stochastic rounding.

    ``in_features`` and ``out_features`` must be multiples of the recipe's block sizes
    (:meth:`BlockRecipe.block_sizes`), and so must the number of tokens (the input's elements over
    ``in_features``) when the weight gradient is computed; otherwise ``ValueError`` names the argument.
    Inputs of any float dtype are computed in fp32 and the output returned in the input's dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: "str | BlockRecipe" = "mxfp8",
                 *, seed: int = 0, device: Any = None, dtype: torch.dtype | None = None) -> None:
        self.recipe = get_recipe(recipe)
        sizes = self.recipe.block_sizes()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if value % sizes[name]:
                raise ValueError(f"{name}: {value} is not a multiple of the block size {sizes[name]} of recipe "
                                 f"{self.recipe.name!r} (the {'fprop' if name == 'in_features' else 'dgrad'} "
                                 f"GEMM's reduction dimension)")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input W^T + b`` with the recipe's fake-quantized GEMMs (``F.linear`` for ``"none"``)."""
        if not self.recipe.quantizes:
            return F.linear(input, self.weight, self.bias)
        if input.dim() == 0 or input.shape[-1] != self.in_features:
            raise ValueError(f"input: expected a last dimension of {self.in_features}, got shape {tuple(input.shape)}")
        x2d = input.reshape(-1, self.in_features)
        tokens = self.recipe.block_sizes()["tokens"]
        if torch.is_grad_enabled() and self.weight.requires_grad and x2d.shape[0] % tokens:
            raise ValueError(f"input: {x2d.shape[0]} tokens (the weight-gradient GEMM's reduction dimension) is not "
                             f"a multiple of the block size {tokens} of recipe {self.recipe.name!r}")
        out = _BlockLinearFunction.apply(x2d, self.weight, self.bias, self.recipe, self.generator)
        return out.reshape(*input.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        """nn.Linear's description plus the recipe."""
        return super().extra_repr() + f", recipe={self.recipe.name}"


def quantize_linears(model: nn.Module, recipe: "str | BlockRecipe",
                     include: Callable[[str, nn.Linear], bool] | None = None, *, seed: int = 0) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` (subclasses included) for which ``include(name, module)``
    holds (default: all) by a :class:`BlockQuantLinear` with ``recipe`` that shares its parameters,
    in place; layer ``i`` gets the seed ``seed + i``. Returns the names replaced. Build the optimizer
    after this call or before: the parameters are the same objects."""
    rec = get_recipe(recipe)
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and not isinstance(mod, BlockQuantLinear)
               and (include is None or include(name, mod))]
    sizes = rec.block_sizes()
    for name, mod in targets:
        for field in ("in_features", "out_features"):
            if getattr(mod, field) % sizes[field]:
                raise ValueError(f"model: layer {name!r} has {field}={getattr(mod, field)}, not a multiple of the "
                                 f"block size {sizes[field]} of recipe {rec.name!r} (leave it out with include=)")
    for i, (name, mod) in enumerate(targets):
        new = BlockQuantLinear(mod.in_features, mod.out_features, mod.bias is not None, rec, seed=seed + i,
                               device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        new.train(mod.training)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return [name for name, _ in targets]
