"""Compensated low-precision optimizers.

Each optimizer computes an fp32 update (:mod:`lowp.optim.adamw`, ...); one shared write-back
mode stores it into the weights (:mod:`lowp.optim.writeback`: kahan, stochastic, nearest,
exact); one shared backend runs the step (:mod:`lowp.optim.backends`: eager, foreach, or a
registered compiled/fused one). Bookkeeping lives in :class:`lowp.optim.base.LowpOptimizer`.
"""
from lowp.optim.adafactor import Adafactor, adafactor_update
from lowp.optim.adam import Adam
from lowp.optim.adamw import AdamW, adamw_update
from lowp.optim.backends import Backend, register_backend
from lowp.optim.base import LowpOptimizer
from lowp.optim.clip import clip_grad_norm_, grad_norm
from lowp.optim.convert import cast_model, full_precision_state_dict, full_precision_weights, load_full_precision
from lowp.optim.lion import Lion, lion_update
from lowp.optim.radam import RAdam, radam_update
from lowp.optim.sgd import SGD, sgd_update
from lowp.optim.stableadamw import StableAdamW, stableadamw_update
from lowp.optim.writeback import MODES

__all__ = ["LowpOptimizer", "SGD", "Adam", "AdamW", "Lion", "RAdam", "StableAdamW", "Adafactor", "sgd_update",
           "adamw_update", "lion_update", "radam_update", "stableadamw_update", "adafactor_update", "Backend",
           "register_backend", "MODES", "cast_model", "load_full_precision", "full_precision_weights",
           "full_precision_state_dict", "clip_grad_norm_", "grad_norm"]
