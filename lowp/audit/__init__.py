"""Operator precision: opmath upcasting, an exhaustive per-op ulp audit, and a precision monitor.

- :mod:`lowp.audit.opmath` — compute in fp32, round once (the ``MPTypeTrait`` rule of PaddlePaddle's
  low-precision operator guide).
- :mod:`lowp.audit.ops` — the op registry (torch op, float64 reference, input domain, low-format model).
- :mod:`lowp.audit.unary`, :mod:`lowp.audit.binary`, :mod:`lowp.audit.reductions` — audit runners.
- :mod:`lowp.audit.metrics` — ulp, absolute/relative error and special-value statistics.
- :mod:`lowp.audit.seed_tables` — the appendix tables 3.3 and 3.4 of PaddlePaddle's low-precision
  operator guide, measured.
- :mod:`lowp.audit.monitor` — forward/backward hooks recording overflow/underflow risk per module;
  :mod:`lowp.audit.demo` — the small model ``lowp doctor`` runs it on.
- :mod:`lowp.audit.lowformat`, :mod:`lowp.audit.reference` — the low-format model and the float64 references.
"""
from lowp.audit.binary import audit_binary
from lowp.audit.monitor import PrecisionMonitor
from lowp.audit.opmath import opmath, opmath_dtype, opmath_ops
from lowp.audit.reductions import audit_reductions
from lowp.audit.unary import audit_unary

__all__ = ["opmath", "opmath_dtype", "opmath_ops", "audit_unary", "audit_binary", "audit_reductions",
           "PrecisionMonitor"]
