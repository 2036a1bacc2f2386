"""The Triton kernel (``backend="triton"``): :mod:`.kernel` (:class:`~.kernel.TritonKernel`),
:mod:`.source` (the kernel module generated from a spec) and :mod:`.ops` (the Triton functions
that generated module imports).
"""
