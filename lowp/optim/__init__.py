"""Compensated low-precision optimizers.

Each optimizer is one module with its spec (:mod:`lowp.optim.spec`: states, numbers, switches and
the elementwise rule every fused kernel is generated from) and its reference update
(:mod:`lowp.optim.adamw`, ...); one shared write-back mode stores the update into the weights
(:mod:`lowp.optim.writeback`: kahan, stochastic, nearest, exact, exact8, master); one shared backend runs the
step (:mod:`lowp.optim.backends`: eager, foreach, or a fused kernel with a fallback). Bookkeeping
lives in :class:`lowp.optim.base.LowpOptimizer`. The imports of optimizer modules below are the
registry (:mod:`lowp.optim.registry`): one line per optimizer.
"""
from lowp.optim.backends import Backend, register_backend
from lowp.optim.base import LowpOptimizer
from lowp.optim.clip import clip_grad_norm_, grad_norm
from lowp.optim.convert import cast_model, full_precision_state_dict, full_precision_weights, load_full_precision
from lowp.optim.registry import exported_names
from lowp.optim.release import GradientRelease, release_gradients
from lowp.optim.writeback import MODES

from lowp.optim.sgd import SGD, sgd_update
from lowp.optim.adam import Adam
from lowp.optim.adamw import AdamW, adamw_update
from lowp.optim.lion import Lion, lion_update
from lowp.optim.radam import RAdam, radam_update
from lowp.optim.stableadamw import StableAdamW, stableadamw_update
from lowp.optim.adafactor import Adafactor, adafactor_update
from lowp.optim.adan import Adan, adan_update

__all__ = ["LowpOptimizer", "Backend", "register_backend", "MODES", "cast_model", "load_full_precision",
           "full_precision_weights", "full_precision_state_dict", "clip_grad_norm_", "grad_norm",
           "release_gradients", "GradientRelease",
           *(name for name in exported_names() if name in globals())]
