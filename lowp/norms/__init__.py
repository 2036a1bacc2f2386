"""Safe L2 norms, RMSNorm and LayerNorm for low-precision formats .

``vector_norm(x, dim, eps=..., method=..., compute=...)`` computes ``sqrt(sum x**2 + eps)`` by one
of :data:`METHODS` with every operation in a chosen (native or emulated) format;
:class:`RMSNorm` and :class:`LayerNorm` are drop-in replacements for torch's modules whose
forward and backward never overflow or underflow in fp16/bf16. See docs/norms.md.
"""
from lowp.norms.methods import METHODS
from lowp.norms.modules import LayerNorm, RMSNorm
from lowp.norms.norm import vector_norm

__all__ = ["vector_norm", "METHODS", "RMSNorm", "LayerNorm"]
