"""The ``torch.compile`` kernel (``backend="compiled"``): :mod:`.kernel`
(:class:`~.kernel.CompiledKernel`), :mod:`.step` (the fused step it compiles), :mod:`.rule` (a
spec's rule on tensors) and :mod:`.bitcast` (the Inductor patch applied while compiling).
"""
