"""The native CPU kernel (``backend="native"``): :mod:`.kernel` (:class:`~.kernel.NativeKernel`),
:mod:`.source` (the C++ translation units generated from a spec), :mod:`.build` (compiling and
loading them through :mod:`lowp.build_cache`), :mod:`.codec` (the block-scaled codec), and the
hand-written C++ they include, in this folder (``*.h``, ``codes.cpp``, ``finite.cpp``).
"""
