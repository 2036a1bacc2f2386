"""``LowpOptimizer``: the bookkeeping every lowp optimizer shares.

A subclass only states its spec (:mod:`lowp.optim.spec`: state names, numbers, switches and the
elementwise rule the fused kernels run) and its reference math::

    class MyOpt(LowpOptimizer):
        spec = OptimizerSpec("myopt", states=lambda group: ("exp_avg",), numbers=..., rule=...)
        def update(self, group, weights, grads, states, step): ... return updates

(a subclass without a spec states ``state_names`` instead and always runs the reference).

``update`` receives lists of fp32 tensors (weights and grads read-only, states updated in place)
and returns the intended change ``u`` of each weight, decoupled weight decay included. Everything
else lives here: parameter groups and hyper-parameter checks, state creation with a dtype per
state, step counting, the non-finite guard with skip counters, GradScaler support,
diagnostics, the backend that runs the step and the write-back mode that stores it, and an exact
``state_dict`` round trip (dtypes and compensation/remainder buffers included; stochastic
rounding draws counter-based bits from the seed and the step counters,
:mod:`lowp.optim.randomness`, so nothing else needs saving).

A step is all or nothing. :meth:`LowpOptimizer._prepare` validates every group's
hyper-parameters and every (parameter, gradient, state, buffer) before anything changes (a
gradient sharing memory with a weight the step writes included); :meth:`LowpOptimizer._plan`
then creates missing states and gathers sharded slices, putting every entry back should that
fail; only :meth:`LowpOptimizer._execute` writes, with Ctrl-C held until it is done
(:mod:`lowp.interrupts`), and each parameter's step counter advances with its weight and states.
What remains is an error inside a backend's kernel on checked input (running out of memory):
the parameters of the jobs before it are stepped whole, the rest untouched. ``load_state_dict``
validates the whole checkpoint (foreign layouts are translated first, :mod:`lowp.optim.migrate`)
before it replaces anything: the optimizer's kind, every state key and entry name, each tensor's
layout, shape and dtype, finite values, nonnegative second moments and scales, step counts that
can be saved again. The step itself is never traced by ``torch.compile`` (:data:`COMPILE_REASON`).

Checkpoints hold only tensors, numbers, strings, lists and dicts (dtypes as their names,
:mod:`lowp.optim.options`), so every torch checkpoint helper takes them, and the extras (seed,
skip counters, the optimizer's kind) ride in every group under ``"lowp"``, a key every live group
also has, so that checkpointers which rebuild groups from the live keys keep them.
:meth:`LowpOptimizer.step_params` steps some of the parameters along the same path (gradient
release, :mod:`lowp.optim.release`, steps each one during the backward pass).
"""
from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Iterable, NamedTuple, Sequence

import torch

from lowp.interrupts import deferred_interrupts
from lowp.optim import options, preflight, sharding
from lowp.optim.backends import Backend, backend_for, get_backend
from lowp.optim.codes import CODES, SCALE_DTYPES, Code, check_block, code_for, encode, scale_name, stored_shapes
from lowp.optim.coded import CodedState, run_coded
from lowp.optim.migrate import to_lowp_layout
from lowp.optim.preflight import check_flag, check_seed
from lowp.optim.randomness import Stream, default_seed
from lowp.optim.scratch import Scratch
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.spec import OptimizerSpec
from lowp.optim.storage import STATE_ROUNDINGS, store, working_copy
from lowp.optim.writeback import (BUFFER_NAMES, LOW_PRECISION, MODES, WriteBack, ensure_buffer, get_mode,
                                  resolve_mode)

__all__ = ["LowpOptimizer", "TwoMomentOptimizer", "NONFINITE_POLICIES", "default_state_dtype", "check_betas",
           "check_nonnegative", "real_value", "warn_if_swapped", "COMPILE_REASON"]

NONFINITE_POLICIES = ("skip_param", "skip_step", "off")
#: The constructor keywords of :class:`LowpOptimizer` besides the subclass's hyper-parameters.
_CONSTRUCTOR_OPTIONS = ("mode", "state_dtype", "state_block", "state_scale_dtype", "state_rounding", "maximize",
                        "nonfinite", "foreach", "backend", "chunk_size", "seed", "diagnostics", "fused", "kahan_sum",
                        "capturable", "differentiable")
#: What a state may be stored in (float64 states are refused: the fused kernels and the mixed
#: fp32/fp64 foreach pipeline cannot run them).
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the float dtypes a loaded state may arrive in (cast to the state's dtype, or encoded, on load)
_LOADABLE_FLOATS = (*STATE_DTYPES, torch.float64)
#: A sharded parameter of at least this many elements whose block-scaled states must be replicated
#: (its shards split blocks) gets a warning: it costs its whole state on every rank.
REPLICATED_WARN_NUMEL = 1 << 16
#: Why ``torch.compile`` must not trace a lowp step (shown by ``fullgraph=True``).
COMPILE_REASON = ("a lowp optimizer step runs eagerly (its fused kernels and exact bf16 round trips, e.g. the Kahan "
                  "update k' = v - (theta' - theta), would be rewritten by Inductor); compile the model and call "
                  "opt.step() outside the compiled function, or use fullgraph=False so the compiled code "
                  "graph-breaks around the step")


def real_value(value: Any, allow_tensor: bool = False) -> float | None:
    """``float(value)`` for a real number (int or float; with ``allow_tensor`` also a one-element
    real tensor), else ``None``.

    Bools are not numbers here: ``True`` is an ``int`` in Python, so ``lr=True`` would
    otherwise pass as 1.0.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if not allow_tensor:
            return None
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        return float(value)
    return float(value) if isinstance(value, (int, float)) else None


def check_nonnegative(name: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number >= 0 (not a bool)."""
    v = real_value(value, allow_tensor=True)
    if v is None or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")


def check_betas(betas: Any, count: int = 2) -> None:
    """Raise ``ValueError`` unless ``betas`` is a tuple of ``count`` numbers in [0, 1) (not bools)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != count:
        raise ValueError(f"betas: expected a tuple of {count} numbers in [0, 1), got {betas!r}")
    for i, b in enumerate(betas):
        v = real_value(b)
        if v is None or not 0.0 <= v < 1.0:
            raise ValueError(f"betas[{i}]: expected a number in [0, 1), got {b!r}")


def default_state_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the optimizer states of a ``weight_dtype`` parameter when ``state_dtype`` is
    ``None``: the weight's own, except bf16 for fp16 weights. fp16's range ends at 6.1e-5 (normal)
    and 6e-8 (subnormal), so Adam's second moment of typical gradients (``g**2`` around 1e-10)
    underflows to zero and the step ``m / (sqrt(v) + eps)`` blows up; bf16 has fp32's range at the
    same two bytes, and stochastic rounding keeps its 8-bit significand unbiased (measured on the
    demo model: fp16 weights with fp16 states end 56% above fp32's validation loss, with bf16
    states within 0.1% of it; docs/optimizers.md)."""
    return torch.bfloat16 if weight_dtype == torch.float16 else weight_dtype


def _check_state_dtype(value: Any) -> None:
    if isinstance(value, Mapping) and not all(isinstance(k, str) for k in value):
        raise ValueError(f"state_dtype: expected a dict keyed by state names, got {value!r}")
    dtypes = value.values() if isinstance(value, Mapping) else [value]
    for d in dtypes:
        if d is not None and d not in STATE_DTYPES and code_for(d) is None:
            raise ValueError(f"state_dtype: expected None, torch.float32, torch.bfloat16, torch.float16, a "
                             f"block-scaled code ({', '.join(str(c) for c in CODES)}) or a dict of them, got {value!r}")


def _check_codes_options(group: Mapping[str, Any]) -> None:
    check_block(group["state_block"], "state_block")
    if group["state_scale_dtype"] not in SCALE_DTYPES:
        raise ValueError(f"state_scale_dtype: expected one of {', '.join(map(str, SCALE_DTYPES))}, "
                         f"got {group['state_scale_dtype']!r}")


class _Checked(NamedTuple):
    """A parameter the step will update, checked by :meth:`LowpOptimizer._checked_param`."""

    #: its parameter group
    group: dict[str, Any]
    param: torch.Tensor
    #: its write-back mode
    mode: WriteBack
    #: its position over all groups (which picks its random streams)
    param_id: int
    #: :meth:`LowpOptimizer.coded_states` of the parameter in its group, computed once per step
    coded: list[CodedState]


class _Plan:
    """The jobs of one step (:meth:`LowpOptimizer._plan`), each keyed by (group id, mode name,
    step count, dtype, device, state names, diagnostics weight): its slices, its coded states
    (the same for all of them), the flat block scales of each slice, the states whose counters
    advance with it, and the gathered DTensor steps to write back with their states and counts."""

    def __init__(self) -> None:
        self.jobs: dict[tuple, list[ParamSlice]] = defaultdict(list)
        self.coded: dict[tuple, list[CodedState]] = {}
        self.scales: dict[tuple, list[dict[str, torch.Tensor]]] = defaultdict(list)
        self.counters: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
        self.gathered: list[tuple[sharding.Gathered, dict[str, Any], int]] = []


class _Undo:
    """What planning a step may change, kept to put it back: each parameter's state entries
    (a shallow copy: planning adds or replaces entries but writes no existing tensor) and the
    weights a mode switch folds a buffer into (:func:`~lowp.optim.writeback.ensure_buffer`)."""

    def __init__(self) -> None:
        self.entries: list[tuple[torch.Tensor, dict[str, Any] | None]] = []
        self.weights: list[tuple[torch.Tensor, torch.Tensor]] = []

    def remember(self, states: Mapping[torch.Tensor, dict[str, Any]], p: torch.Tensor, mode: WriteBack) -> None:
        """Keep ``p``'s state entries, and its weight when a buffer of another mode will be folded."""
        state = states.get(p)
        self.entries.append((p, None if state is None else dict(state)))
        if state and any(n in state for n in BUFFER_NAMES if n != mode.buffer_name):
            self.weights.append((p, sharding.local(p).detach().clone()))

    def restore(self, states: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Put back every remembered state entry and weight."""
        for p, entries in reversed(self.entries):
            if entries is None:
                states.pop(p, None)
            else:
                states[p].clear()
                states[p].update(entries)
        for p, weight in self.weights:
            sharding.local(p).detach().copy_(weight)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with contiguous local elements (a DTensor keeps its placements)."""
    if sharding.is_dtensor(t):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(t.to_local().contiguous(), t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t.contiguous()


def warn_if_swapped(eps: Any, weight_decay: Any) -> None:
    """Warn when ``eps`` and ``weight_decay`` look exchanged: optimi's positional order is
    ``lr, betas, weight_decay, eps``, torch's and lowp's ``lr, betas, eps, weight_decay``."""
    e, wd = real_value(eps, allow_tensor=True), real_value(weight_decay, allow_tensor=True)
    if e is not None and wd is not None and e >= 1e-2 and wd <= 1e-5:
        warnings.warn(f"eps={eps!r} is large and weight_decay={weight_decay!r} tiny: were they passed in optimi's "
                      f"positional order (lr, betas, weight_decay, eps)? lowp follows torch's order (lr, betas, eps, "
                      f"weight_decay); pass them by keyword", UserWarning, stacklevel=3)


class LowpOptimizer(torch.optim.Optimizer):
    """Base of every lowp optimizer.

    Subclasses take their own hyper-parameters and pass the options below through ``**options``;
    the options marked *(group)* are stored per parameter group and may differ between groups.
    The others act on the whole optimizer: a parameter group may repeat one only with the
    optimizer's own value (``ValueError`` naming the group and key otherwise), optimi's
    ``kahan_sum`` in a group sets that group's mode, and a misspelt option or another library's
    keyword raises naming the nearest option or lowp's equivalent (:mod:`lowp.optim.options`).

    Args:
        params: the tensors to optimize, or parameter groups (dicts with a ``"params"`` entry and
            per-group options), or ``(name, tensor)`` pairs as ``named_parameters()`` yields them.
            Each must be a dense real floating-point tensor (bf16, fp16, fp32 or fp64); a set (no
            fixed order), distinct tensors sharing memory and tensor subclasses other than
            ``nn.Parameter`` and DTensor raise.
        defaults: the subclass's hyper-parameters (``lr``, ``betas``...), the defaults of every
            group; checked (``lr`` a finite number >= 0, the subclass's ``validate``) before any
            state exists.
        mode (group): how the fp32 update is written back into bf16/fp16 weights
            (:mod:`lowp.optim.writeback`): ``"auto"`` (default: ``"kahan"``), ``"kahan"``,
            ``"stochastic"``, ``"nearest"``, ``"exact"`` (bf16 weight + int16 remainder: the fp32
            master weight exactly, 4 bytes) or ``"exact8"`` (bf16 weight + int8 remainder, 16
            significant bits in 3 bytes, the remainder rounded stochastically); the last two
            take bf16 weights only (a ``TypeError`` for fp16). fp32/fp64 weights are always
            updated plainly, whatever the mode. Another name raises ``ValueError``.
        state_dtype (group): the dtype new optimizer states are created in: ``None`` (default:
            the parameter's dtype, but bf16 for fp16 parameters, see :func:`default_state_dtype`),
            ``torch.float32``, ``torch.bfloat16``, ``torch.float16``, or a dict
            ``{state name: dtype or None}``. fp64 parameters always keep fp64 states; float64
            and other dtypes raise ``ValueError``. Block-scaled codes (:mod:`lowp.optim.codes`):
            ``torch.int8``, ``torch.float8_e4m3fn`` and ``torch.float8_e5m2`` for any state,
            ``torch.uint8`` and ``torch.uint4`` (stored as square roots) for the states the
            optimizer's spec declares nonnegative (Adam's ``exp_avg_sq``); elementwise states
            only, else ``ValueError``. DTensor parameters keep the codes of whole blocks sharded
            like themselves, replicated where their shards split blocks
            (:func:`lowp.optim.sharding.coded_placements`).
        state_block (group): elements per scale of block-scaled states: 32, 64 (default), 128 or
            256.
        state_scale_dtype (group): the dtype of the block scales: ``torch.bfloat16`` (default:
            fp32's range, so the scales of tiny second moments do not underflow as in fp16),
            ``torch.float16`` or ``torch.float32``.
        state_rounding (group): ``"stochastic"`` (default) or ``"nearest"``, how states stored in
            16 bits or in block-scaled codes are rounded. With beta2 = 0.999, ``v * beta2``
            rounds back to ``v`` in bf16 (eps 2**-7), so round-to-nearest states stop decaying;
            stochastic rounding keeps them unbiased.
        maximize (group): ``True`` ascends the objective (the gradient's sign is flipped);
            default ``False``. Must be a bool.
        nonfinite: what a gradient holding a NaN or infinity does: ``"skip_param"`` (default:
            that parameter is not updated), ``"skip_step"`` (no parameter is updated) or
            ``"off"`` (no check: the non-finite values reach the weights). Skips are counted
            (:meth:`diagnostics`).
        foreach: ``None`` (default) or ``True`` run unfused steps with the ``foreach`` backend
            (batches of ``torch._foreach_*`` ops), ``False`` with ``eager`` (one tensor at a
            time); with ``fused=None``, ``False`` also rules out the fused CPU backends. ``None``,
            ``True`` or ``False``.
        backend: a backend by name (``"eager"``, ``"foreach"``, ``"native"``, ``"compiled"``,
            ``"triton"`` or one added with :func:`~lowp.optim.backends.register_backend`),
            overriding ``foreach`` and ``fused``; default ``None`` (chosen by
            :func:`~lowp.optim.backends.backend_for`). An unknown name, or a name together with
            ``fused=True``, raises ``ValueError``.
        chunk_size: the most elements one batch or chunk holds, which bounds the fp32
            temporaries of a step (:mod:`lowp.optim.backends`); a positive int, or ``None``
            (default: ``2**18`` on the CPU, ``2**22`` on a GPU).
        seed: the seed of the stochastic-rounding streams, an int in ``[0, 2**64)`` (default:
            ``torch.initial_seed()``, rank 0's in a process group of several ranks, made distinct
            from the seeds of the live optimizers that drew the same one, so that one optimizer per
            parameter draws independent bits: :func:`~lowp.optim.randomness.default_seed`):
            element ``i`` of parameter
            ``param_id`` (its position over all groups) draws
            ``random16(i, stream_key(seed, step, param_id, stream))`` (:mod:`lowp.optim.randomness`).
            Saved in the ``state_dict``.
        diagnostics: ``True`` (default) counts the elements whose stored weight did not move in
            each step (:meth:`diagnostics`); ``False`` saves that count. Must be a bool.
        fused: ``None`` (default) picks a fused backend when one is available and worth it (large
            models, CUDA with Triton), ``True`` requires one (``RuntimeError`` when none can
            build code here), ``False`` never uses one (:func:`lowp.optim.backends.backend_for`).
        kahan_sum: optimi's spelling of the mode: ``True`` means ``mode="kahan"``, ``False``
            ``mode="nearest"``, ``None`` (default) leaves ``mode`` alone; a conflicting ``mode``
            raises ``ValueError``.
        capturable: torch's option for CUDA-graph capture, accepted for compatibility; only
            ``False`` (default) is supported (the step reads its counters on the host), ``True``
            raises ``ValueError``.
        differentiable: torch's option for autograd through the step, accepted for
            compatibility; only ``False`` (default) is supported (the low-precision write-back is
            not differentiable), ``True`` raises ``ValueError``.
    """

    #: The optimizer described for the backends (:mod:`lowp.optim.spec`); ``None``: reference only.
    spec: ClassVar[OptimizerSpec | None] = None
    #: The ``update`` method the spec's rule mirrors (set when a class declares its spec).
    _spec_update: ClassVar[Callable[..., Any] | None] = None
    #: True when ``update`` is elementwise, so parameters may be cut into chunks.
    elementwise: bool = True
    #: Keyword sets that together exercise every switch of the optimizer: the generic tests run
    #: each through every mode and backend (:mod:`lowp.optim.registry`).
    examples: ClassVar[tuple[dict[str, Any], ...]] = ({},)
    #: GradScaler hands ``grad_scale``/``found_inf`` to ``step`` instead of unscaling in place.
    _step_supports_amp_scaling = True
    #: optimi checkpoints: ``{state name: index of its beta}`` for states optimi stores
    #: bias-corrected (:mod:`lowp.optim.migrate`); ``None`` when optimi's layout is not known.
    optimi_debiased: dict[str, int] | None = None
    #: The active :func:`lowp.optim.release.release_gradients` handle, which steps the parameters
    #: during the backward pass (``step`` then only runs its closure); ``None`` without one.
    _released_by: Any = None

    def __init__(self, params: Iterable, defaults: dict[str, Any], *, mode: str = "auto",
                 state_dtype: "torch.dtype | Mapping[str, torch.dtype] | None" = None,
                 state_block: int = 64, state_scale_dtype: torch.dtype = torch.bfloat16,
                 state_rounding: str = "stochastic", maximize: bool = False, nonfinite: str = "skip_param",
                 foreach: bool | None = None, backend: str | None = None, chunk_size: int | None = None,
                 seed: int | None = None, diagnostics: bool = True, fused: bool | None = None,
                 kahan_sum: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 **unknown: Any) -> None:
        if unknown:
            raise options.unknown_keywords(type(self).__name__, unknown, [*defaults, *_CONSTRUCTOR_OPTIONS])
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite: expected one of {', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
        check_flag("foreach", foreach, allow_none=True)   # fused: checked by backend_for
        check_flag("diagnostics", diagnostics)
        check_flag("capturable", capturable)
        check_flag("differentiable", differentiable)
        if capturable:
            raise ValueError("capturable: capturable=True (CUDA-graph capture of the step) is not supported; the step "
                             "reads its counters on the host. Use capturable=False")
        if differentiable:
            raise ValueError("differentiable: differentiable=True (autograd through the step) is not supported; "
                             "the low-precision write-back is not differentiable. Use differentiable=False")
        mode = self._mode_from_kahan_sum(mode, kahan_sum)
        if backend is not None and fused:
            raise ValueError(f"fused: fused=True conflicts with backend={backend!r}; give one of them")
        get_backend(backend or "eager", chunk_size)  # checks backend and chunk_size before any state exists
        self.nonfinite = nonfinite
        self.diagnostics_enabled = diagnostics
        seed = None if seed is None else check_seed(seed)
        self.skipped_params = 0
        self.skipped_steps = 0
        # per group: (stalled count, elements, weight) of each job of the last step; weight 0 for
        # plain parameters, else the share of this rank in a sum over all ranks
        self._last_stalled: dict[int, list[tuple[torch.Tensor | None, int, float]]] = {}
        # parameter -> (group index, index in the group, position over all groups), see _position
        self._positions: dict[torch.Tensor, tuple[int, int, int]] = {}
        # what a group may repeat of the optimizer-wide options (lowp.optim.options.group_options)
        self._wide = dict(seed=seed, nonfinite=nonfinite, backend=backend, chunk_size=chunk_size,
                          diagnostics=diagnostics, foreach=foreach, fused=fused, capturable=capturable,
                          differentiable=differentiable)
        if "betas" in defaults:
            defaults = dict(defaults, betas=options.plain_betas(defaults["betas"]))
        state_dtype = options.dtype_value(state_dtype, "state_dtype")
        state_scale_dtype = options.dtype_value(state_scale_dtype, "state_scale_dtype")
        defaults = dict(defaults, mode=mode, state_dtype=state_dtype, state_block=state_block,
                        state_scale_dtype=state_scale_dtype, state_rounding=state_rounding, maximize=maximize)
        super().__init__(params, defaults)
        if backend is None:
            backend = backend_for([p for g in self.param_groups for p in g["params"]], fused, foreach)
        self.backend: Backend = get_backend(backend, chunk_size)
        # last: under torch.distributed the default is a broadcast, which no rank should enter
        # and then leave the others waiting by raising
        self.seed = default_seed(self) if seed is None else seed

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__ and cls.spec is not None:
            cls._spec_update = cls.update
            cls.elementwise = cls.spec.elementwise

    def kernel_spec(self) -> OptimizerSpec | None:
        """The spec the fused kernels may run for this optimizer: its class's, unless a subclass
        replaced ``update`` without declaring a spec of its own (its math is then never swapped
        for the stock rule), or the spec has no elementwise rule."""
        cls = type(self)
        spec = cls.spec
        if spec is None or spec.rule is None or cls.update is not cls._spec_update:
            return None
        return spec

    @staticmethod
    def _mode_from_kahan_sum(mode: str, kahan_sum: bool | None) -> str:
        """optimi's ``kahan_sum``: ``True`` is ``mode="kahan"``, ``False`` ``mode="nearest"``."""
        check_flag("kahan_sum", kahan_sum, allow_none=True)
        if kahan_sum is None:
            return mode
        implied = "kahan" if kahan_sum else "nearest"
        if mode not in ("auto", implied):
            raise ValueError(f"kahan_sum: kahan_sum={kahan_sum} means mode={implied!r}, which conflicts with "
                             f"mode={mode!r}; give one of them")
        return implied

    # ---- subclass hooks -------------------------------------------------------------------
    def state_names(self, group: dict[str, Any], param: torch.Tensor) -> tuple[str, ...]:
        """Names of the optimizer states of ``param`` (the spec's, by default)."""
        return self.spec.states(group) if self.spec is not None else ()

    def state_shape(self, name: str, param: torch.Tensor) -> torch.Size:
        """Shape of state ``name`` of ``param`` (default: the parameter's shape)."""
        return param.shape

    def validate(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the bad hyper-parameter of ``group``."""

    def infer_step(self, state: Mapping[str, Any]) -> int | None:
        """The step count of a loaded state that has none (``None``: it cannot be inferred)."""
        return None

    def update(self, group: dict[str, Any], weights: list[torch.Tensor], grads: list[torch.Tensor],
               states: dict[str, list[torch.Tensor]], step: int) -> list[torch.Tensor]:
        """The intended weight changes (fresh fp32 tensors); see the module docstring."""
        raise NotImplementedError

    # ---- parameter groups -----------------------------------------------------------------
    #: Group keys that must be bools (checked with the hyper-parameters).
    flag_keys: tuple[str, ...] = ("maximize", "amsgrad", "nesterov", "decoupled_weight_decay")

    def check_group(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError``/``TypeError`` naming the first bad hyper-parameter of ``group``
        (a complete group: defaults merged in). Used by ``add_param_group``, ``load_state_dict``
        and before every step."""
        check_nonnegative("lr", group["lr"])
        if group["mode"] != "auto":
            get_mode(group["mode"])
        if group["state_rounding"] not in STATE_ROUNDINGS:
            raise ValueError(f"state_rounding: expected one of {', '.join(STATE_ROUNDINGS)}, "
                             f"got {group['state_rounding']!r}")
        _check_state_dtype(group["state_dtype"])
        _check_codes_options(group)
        for key in self.flag_keys:
            if key in group:
                check_flag(key, group[key])
        self.validate(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its hyper-parameters and every parameter (layout, mode, overlap)."""
        if not isinstance(param_group, Mapping) or "params" not in param_group:
            raise TypeError(f"param_group: expected a dict with a 'params' entry, got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("params: expected an ordered collection of tensors; sets have no fixed order")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        named = [isinstance(p, tuple) for p in params]
        if any(named):   # (name, tensor) pairs, as named_parameters() yields them (torch >= 2.5 convention)
            if not all(named) or not all(len(p) == 2 and isinstance(p[0], str) for p in params):
                raise ValueError("params: expected all tensors or all (name, tensor) pairs")
            names, params = [n for n, _ in params], [t for _, t in params]
            param_group = {**param_group, "param_names": names}
        param_group = options.group_options(param_group, self._wide, [*self.defaults, *_CONSTRUCTOR_OPTIONS],
                                            f"param_groups[{len(self.param_groups)}]", self._mode_from_kahan_sum)
        param_group[options.EXTRAS_KEY] = {}   # a live key, so checkpointers that rebuild groups keep the extras
        merged = {**self.defaults, **param_group}
        self.check_group(merged)
        for i, p in enumerate(params):
            preflight.check_param(p, f"params[{i}]")
            resolve_mode(merged["mode"], p)
            self.coded_states(merged, p)
            if sharding.is_dtensor(p):
                sharding.check_placements(p)
            elif isinstance(p, torch.Tensor) and type(p) not in (torch.Tensor, torch.nn.Parameter):
                raise TypeError(f"params[{i}]: a {type(p).__name__}; lowp optimizers take plain tensors, "
                                f"nn.Parameter and DTensor (FSDP2, tensor parallel), whose arithmetic they know")
        preflight.check_distinct([q for g in self.param_groups for q in g["params"]] + params)
        preflight.check_disjoint([q for g in self.param_groups for q in g["params"]] + params)
        super().add_param_group({**param_group, "params": params})

    # ---- state ----------------------------------------------------------------------------
    def _state_dtype(self, group: dict[str, Any], name: str, param: torch.Tensor) -> torch.dtype:
        """The dtype a new state ``name`` of ``param`` is created in: fp64 for fp64 parameters
        (their pipeline runs in fp64 and cannot mix in other dtypes, whatever ``state_dtype``
        says for the group), else ``state_dtype``'s or :func:`default_state_dtype`."""
        if param.dtype == torch.float64:
            return torch.float64
        spec = group["state_dtype"]
        dtype = spec.get(name) if isinstance(spec, Mapping) else spec
        return dtype or default_state_dtype(param.dtype)

    def state_dtypes(self, group: dict[str, Any], name: str, param: torch.Tensor) -> tuple[torch.dtype, ...]:
        """The dtypes a stored state ``name`` of ``param`` may have: fp64 for fp64 parameters,
        else the one ``state_dtype`` asks for (a code's storage dtype for a block-scaled state),
        else any of fp32/bf16/fp16, since a loaded checkpoint keeps its states' dtypes."""
        if param.dtype == torch.float64:
            return (torch.float64,)
        spec = group["state_dtype"]
        dtype = spec.get(name) if isinstance(spec, Mapping) else spec
        code = code_for(dtype)
        return STATE_DTYPES if dtype is None else (code.storage,) if code is not None else (dtype,)

    def coded_states(self, group: dict[str, Any], param: torch.Tensor) -> list[CodedState]:
        """The states of ``param`` that ``state_dtype`` stores as block-scaled codes; a
        ``ValueError`` naming the state when its code cannot hold it (a non-elementwise state, an
        unsigned code for a state that may be negative)."""
        if param.dtype == torch.float64:
            return []
        spec = group["state_dtype"]
        out = []
        for j, name in enumerate(self.state_names(group, param)):
            code = code_for(spec.get(name) if isinstance(spec, Mapping) else spec)
            if code is None:
                continue
            where = f"state_dtype[{name!r}]" if isinstance(spec, Mapping) else "state_dtype"
            if self.state_shape(name, param) != param.shape or self.spec is None:
                raise ValueError(f"{where}: {type(self).__name__}'s state {name!r} is not elementwise; block-scaled "
                                 f"codes ({code.name}) hold states shaped like their parameter only")
            if not code.signed and name not in self.spec.nonnegative:
                raise ValueError(f"{where}: {code.name} codes hold nonnegative states only (as square roots), and "
                                 f"{type(self).__name__}'s {name!r} may be negative; use torch.int8 or an fp8 dtype")
            out.append(CodedState(name, j, code))
        return out

    def check_state(self, group: dict[str, Any], p: torch.Tensor, state: Mapping[str, Any], where: str,
                    coded_states: list[CodedState] | None = None) -> None:
        """Raise naming ``where[key]`` unless every entry the step reads is usable: ``step`` a
        count, each present state of the right shape, dtype and device, each present buffer of
        the weight's shape (``compensation``: the weight's dtype or fp32; ``remainder``: int16;
        ``remainder8``: int8).
        Missing states and buffers are fine: the step creates them. ``coded_states``: ``p``'s
        :meth:`coded_states` in ``group`` when the caller has them (``None``: computed here)."""
        if not state:
            return
        step = state.get("step")
        if type(step) is not int or not 0 <= step < preflight.STEP_LIMIT - 1:
            raise ValueError(f"{where}['step']: expected a step count (an int in [0, 2**63 - 1): the next one is "
                             f"saved as an int64), got {step!r}")
        if coded_states is None:
            coded_states = self.coded_states(group, p)
        coded = {c.name: c.code for c in coded_states}
        for name in self.state_names(group, p):
            if name not in state:
                continue
            code = coded.get(name)
            if code is None:
                preflight.check_tensor(state[name], where, self.state_shape(name, p),
                                       self.state_dtypes(group, name, p), p.device, name)
                continue
            if scale_name(name) not in state:
                raise ValueError(f"{where}[{scale_name(name)!r}]: the block scales of the coded state {name!r} "
                                 f"are missing")
            shapes, placements = self._coded_layout(group, p, code)
            for key, shape, dtypes in ((name, shapes[0], (code.storage,)),
                                       (scale_name(name), shapes[1], (group["state_scale_dtype"],))):
                preflight.check_tensor(state[key], where, shape, dtypes, p.device, key)
                placed = tuple(state[key].placements) if sharding.is_dtensor(state[key]) else None
                if placed != placements:
                    raise ValueError(f"{where}[{key!r}]: placed as {placed}, expected {placements} (the layout of "
                                     f"{code.name} codes in blocks of {group['state_block']} for this parameter)")
        if "compensation" in state:
            preflight.check_tensor(state["compensation"], where, p.shape, (p.dtype, torch.float32), p.device,
                                   "compensation")
        if "remainder" in state:
            preflight.check_tensor(state["remainder"], where, p.shape, (torch.int16,), p.device, "remainder")
        if "remainder8" in state:
            preflight.check_tensor(state["remainder8"], where, p.shape, (torch.int8,), p.device, "remainder8")

    def init_state(self, group: dict[str, Any], p: torch.Tensor, mode: WriteBack,
                   coded_states: list[CodedState] | None = None) -> dict[str, Any]:
        """The state of ``p`` with everything a step in ``mode`` needs: ``step`` and the
        optimizer's states (zeros when missing) and the mode's buffer (:func:`ensure_buffer`).
        ``coded_states``: ``p``'s :meth:`coded_states` in ``group`` when the caller has them
        (``None``: computed here)."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = 0
        if coded_states is None:
            coded_states = self.coded_states(group, p)
        coded = {c.name: c.code for c in coded_states}
        if sharding.is_dtensor(p) and any(n not in state for n in coded) and p.numel() >= REPLICATED_WARN_NUMEL \
                and sharding.coded_placements(p, group["state_block"]) != tuple(p.placements):
            warnings.warn(f"lowp: the shards of a parameter of shape {tuple(p.shape)} ({tuple(p.placements)}) "
                          f"split blocks of {group['state_block']} elements, so its block-scaled states are "
                          f"replicated on every rank and it is stepped whole (an all-gather per step); a "
                          f"smaller state_block, or a group with 16-bit states, avoids it", stacklevel=4)
        for name in self.state_names(group, p):   # DTensor parameters: sharded like p
            if name in state:
                continue
            code = coded.get(name)
            if code is None:
                state[name] = sharding.new_state(p, self.state_shape(name, p), self._state_dtype(group, name, p))
                continue
            (codes, scales), placements = self._coded_layout(group, p, code)
            for key, shape, dtype in ((name, codes, code.storage), (scale_name(name), scales,
                                                                      group["state_scale_dtype"])):
                state[key] = (torch.zeros(shape, dtype=dtype, device=p.device) if placements is None
                              else sharding.new_tensor(p, shape, dtype, placements))
        if mode.buffer_name is not None and not any(n in state for n in BUFFER_NAMES):
            state[mode.buffer_name] = sharding.new_buffer(p, mode.init_buffer)
        ensure_buffer(p, state, mode)   # a mode switch: folds or drops the other mode's buffer
        return state

    @staticmethod
    def _coded_layout(group: dict[str, Any], p: torch.Tensor, code: Code
                      ) -> tuple[tuple[torch.Size, torch.Size], tuple | None]:
        """The global shapes of the codes and scales of a coded state of ``p``
        (:func:`~lowp.optim.codes.stored_shapes`) and, for a DTensor ``p``, their placements
        (:func:`~lowp.optim.sharding.coded_placements`; ``None`` for a plain ``p``)."""
        block = group["state_block"]
        placements = sharding.coded_placements(p, block) if sharding.is_dtensor(p) else None
        return stored_shapes(code, p.shape, block), placements

    # ---- the step -------------------------------------------------------------------------
    def _finite_flags(self, grads: list[torch.Tensor], params: list[torch.Tensor], force: bool = False) -> list[bool]:
        """Per (local) gradient: finite; for DTensor parameters finite on every rank. All ``True``
        without a look under ``nonfinite="off"``, unless ``force``."""
        if self.nonfinite == "off" and not force:
            return [True] * len(grads)
        return sharding.agree(self.backend.finite_flags(grads), params)

    def _checked_param(self, group: dict[str, Any], p: torch.Tensor, index: int) -> _Checked:
        """Check one parameter with a gradient (layout, gradient, mode, coded states, states and
        buffers); ``index`` is its position over all groups."""
        where = f"params[{index}]"
        preflight.check_param(p, where)
        if p.is_meta:
            raise ValueError(f"{where}: a meta tensor has no values to step; materialize the model (to_empty, "
                             f"then initialize it) before stepping")
        preflight.check_grad(p, p.grad, where)
        mode = resolve_mode(group["mode"], p)
        coded = self.coded_states(group, p)
        self.check_state(group, p, self.state.get(p, {}), f"state[{index}]", coded)
        return _Checked(group, p, mode, index, coded)

    def _prepare(self) -> list[_Checked]:
        """Check everything the step will read or write, before anything changes: every group's
        hyper-parameters, and for each parameter with a gradient its layout, its mode, the
        gradient (shape, dtype, device), its coded states and its states and buffers. Returns the
        checked parameters to step."""
        todo = []
        index = -1
        for group in self.param_groups:
            self.check_group(group)
            for p in group["params"]:
                index += 1
                if p.grad is not None:
                    todo.append(self._checked_param(group, p, index))
        preflight.check_grads_apart([t.param for t in todo], [f"params[{t.param_id}]" for t in todo])
        return todo

    def _position(self, p: Any, where: str) -> tuple[int, int, int]:
        """(group index, index in the group, position over all groups) of parameter ``p``.

        Looked up in a cache that is rebuilt when it no longer matches ``param_groups`` (groups
        added, a checkpoint loaded); an error naming ``where`` when ``p`` is not a parameter of
        this optimizer."""
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where}: expected a parameter of this optimizer, got {type(p).__name__}")
        groups = self.param_groups
        found = self._positions.get(p)
        if found is None or found[0] >= len(groups) or found[1] >= len(groups[found[0]]["params"]) \
                or groups[found[0]]["params"][found[1]] is not p:
            flat = [(q, g, i) for g, group in enumerate(groups) for i, q in enumerate(group["params"])]
            self._positions = {q: (g, i, n) for n, (q, g, i) in enumerate(flat)}
            found = self._positions.get(p)
        if found is None:
            raise ValueError(f"{where}: expected a parameter of this optimizer, got another tensor")
        return found

    def _prepare_subset(self, params: Sequence[torch.Tensor]) -> list[_Checked]:
        """:meth:`_prepare` for ``params`` only: the hyper-parameters of the groups holding them
        and each of them that has a gradient, in the order given."""
        positions = [self._position(p, f"params[{i}]") for i, p in enumerate(params)]
        if len({n for _, _, n in positions}) != len(positions):
            raise ValueError("params: expected distinct parameters, got one parameter twice")
        for g in sorted({g for g, _, _ in positions}):
            self.check_group(self.param_groups[g])
        todo = [self._checked_param(self.param_groups[g], p, n) for p, (g, _, n) in zip(params, positions)
                if p.grad is not None]
        preflight.check_grads_apart([t.param for t in todo], [f"params[{t.param_id}]" for t in todo])
        return todo

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; returns ``closure()``'s loss when a closure is given.

        Everything is checked before anything changes (:meth:`_prepare`): after an error the
        weights, states, counters and hyper-parameters are as they were; Ctrl-C during the writes
        arrives once they are done (see the module docstring). Under
        ``torch.compile`` the step is not traced: it runs eagerly (:data:`COMPILE_REASON`).
        While :func:`lowp.optim.release.release_gradients` is active the parameters are stepped
        during the backward pass, and ``step`` only runs the closure."""
        return self._eager_step(closure)

    # The public methods stay plain and call these disabled ones: torch.compile of a bound method
    # whose function is disabled calls that function without ``self`` on torch 2.10
    # (``innermost_fn`` follows the wrapper's ``_torchdynamo_orig_callable`` through the method).
    @torch.compiler.disable(reason=COMPILE_REASON)
    @torch.no_grad()
    def _eager_step(self, closure: Callable[[], Any] | None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._released_by is not None:
            if getattr(self, "grad_scale", None) is not None:
                raise ValueError("scaler: a GradScaler stepped this optimizer while release_gradients steps it during "
                                 "the backward pass, with gradients still scaled; pass the scaler to "
                                 "release_gradients(opt, scaler=scaler) and keep scaler.update() after backward")
            return loss
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            self.skipped_steps += 1
            return loss
        grad_scale = getattr(self, "grad_scale", None)
        inv_scale = None if grad_scale is None else float(grad_scale.double().reciprocal())
        # GradScaler hands over found_inf only after checking every gradient of this optimizer:
        # 0 means all are finite, and a second pass over them would cost about 10% of a fused step
        self._run(self._prepare(), inv_scale, checked=found_inf is not None, new_step=True)
        return loss

    def step_params(self, params: Sequence[torch.Tensor], grad_scale: float | None = None,
                    new_step: bool = True, update_weights: bool = True) -> bool:
        """Step ``params`` only, with the bookkeeping of :meth:`step`: everything checked first,
        states created, each parameter's own step count advanced, the non-finite policy, the
        parameter's position over all groups as its ``param_id`` (so its stochastic-rounding
        streams are those of a whole :meth:`step`), the backend and the diagnostics. Parameters
        without a gradient are left alone. Stepping every parameter once this way equals one
        :meth:`step` bit for bit.

        Args:
            params: distinct parameters of this optimizer.
            grad_scale: the loss scale the gradients carry (a :class:`torch.amp.GradScaler`'s
                ``get_scale()``), divided out in the step; default ``None``: unscaled gradients.
                With a scale, a non-finite gradient is always skipped (it is an overflow the
                scaler must hear of), whatever ``nonfinite`` says.
            new_step: ``True`` (default) starts the step that :meth:`diagnostics` reports;
                ``False`` adds these parameters to the current one.
            update_weights: ``True`` (default) is a whole step. ``False`` is a states-only step:
                the states (moments) take this gradient and the step count advances exactly as
                in a whole step, bit for bit, but the weights and their write-back buffers stay
                as they are and :meth:`diagnostics` keeps reporting the last whole step. This is
                how gradient release folds micro-batches into the states instead of holding
                their gradients (``accumulate="states"`` of
                :func:`~lowp.optim.release.release_gradients`; optimi's ``optimizer_accumulation``).
                It runs the reference pipeline of the ``foreach`` backend, which writes the
                same state bits as every fused kernel.

        Returns:
            ``True`` when every checked gradient was finite (with ``nonfinite="off"`` and no
            ``grad_scale`` nothing is checked).
        """
        return self._eager_step_params(params, grad_scale, new_step, update_weights)

    @torch.compiler.disable(reason=COMPILE_REASON)
    @torch.no_grad()
    def _eager_step_params(self, params: Sequence[torch.Tensor], grad_scale: float | None, new_step: bool,
                           update_weights: bool) -> bool:
        if grad_scale is not None:
            v = real_value(grad_scale)
            if v is None or not math.isfinite(v) or v <= 0:
                raise ValueError(f"grad_scale: expected a finite number > 0 or None, got {grad_scale!r}")
            grad_scale = 1.0 / v
        check_flag("new_step", new_step)
        check_flag("update_weights", update_weights)
        return self._run(self._prepare_subset(params), grad_scale, checked=False, new_step=new_step,
                         force_check=grad_scale is not None, update_weights=update_weights)

    def _run(self, todo: list[_Checked], inv_scale: float | None, checked: bool, new_step: bool,
             force_check: bool = False, update_weights: bool = True) -> bool:
        """Step the checked ``todo`` (:meth:`_prepare`): the non-finite policy (skipped when the
        gradients are ``checked`` already; ``force_check`` skips non-finite ones even with
        ``nonfinite="off"``), then :meth:`_plan` (states created, nothing written) and
        :meth:`_execute` (the writes, with Ctrl-C held until they are done). Returns whether every
        checked gradient was finite."""
        params = [t.param for t in todo]
        grads = [sharding.local_grad(p) for p in params]
        finite = [True] * len(todo) if checked else self._finite_flags(grads, params, force_check)
        if not all(finite) and self.nonfinite == "skip_step":
            self.skipped_steps += 1
            return False
        plan = self._plan([(t, g) for t, g, ok in zip(todo, grads, finite) if ok])
        with deferred_interrupts():
            self._execute(plan, inv_scale, new_step, update_weights)
            self.skipped_params += finite.count(False)
        return all(finite)

    def _plan(self, todo: list[tuple[_Checked, torch.Tensor]]) -> _Plan:
        """The jobs of a step: parameters of one group, mode, step count, dtype, device, state
        names and diagnostics weight run together. Creates missing states and buffers (zeros, or a
        mode switch's folded buffer) and makes coded states contiguous; writes no weight, state
        value or counter that a step reads, and on any error (a failed gather, an interrupt)
        puts every state entry and folded weight back as it was."""
        plan = _Plan()
        undo = _Undo()
        try:
            for (group, p, mode, param_id, p_coded), grad in todo:
                undo.remember(self.state, p, mode)
                state = self.init_state(group, p, mode, p_coded)
                names = self.state_names(group, p)
                for c in p_coded:   # the coded step addresses codes and scales flat
                    for entry in (c.name, scale_name(c.name)):
                        if not sharding.local(state[entry]).is_contiguous():
                            state[entry] = _contiguous(state[entry])
                step = state["step"] + 1
                piece, weight, full = sharding.make_slice(p, grad, {n: state[n] for n in names},
                                                          state.get(mode.buffer_name) if mode.buffer_name else None,
                                                          param_id, self.elementwise)
                key = (id(group), mode.name, step, p.dtype, p.device, names, weight)
                plan.jobs[key].append(piece)
                plan.coded[key] = p_coded
                plan.scales[key].append({c.name: sharding.local(state[scale_name(c.name)]).view(-1) for c in p_coded})
                if full is None:
                    plan.counters[key].append(state)
                else:
                    plan.gathered.append((full, state, step))
        except BaseException:
            undo.restore(self.state)
            raise
        return plan

    def _execute(self, plan: _Plan, inv_scale: float | None, new_step: bool, update_weights: bool = True) -> None:
        """Run ``plan``'s jobs on the backend (a states-only step: on the ``foreach`` reference
        pipeline). Each parameter's step counter advances right after the job that wrote its
        weight and states (a gathered DTensor parameter's after its shards are written back), so
        weights, states and counters always agree, parameter by parameter."""
        if new_step and update_weights:
            self._last_stalled = {}
        backend = self.backend if update_weights else get_backend("foreach", self.backend.chunk_size)
        groups = {id(g): (i, g) for i, g in enumerate(self.param_groups)}
        for key, slices in plan.jobs.items():
            gid, mode_name, step, _, _, _, weight = key
            index, group = groups[gid]
            ctx = StepContext(group, MODES[mode_name], step, inv_scale, self.seed,
                              self.diagnostics_enabled and update_weights, update_weights=update_weights)
            if plan.coded[key]:
                stalled = run_coded(backend, self, ctx, slices, plan.scales[key], plan.coded[key], self.elementwise)
            else:
                stalled = backend.run(self, ctx, slices)
            for state in plan.counters[key]:
                state["step"] = step
            if update_weights:
                self._last_stalled.setdefault(index, []).append((stalled, sum(s.numel for s in slices), weight))
        for full, state, step in plan.gathered:
            full.write_back()
            state["step"] = step

    def apply_batch(self, ctx: StepContext, batch: list[ParamSlice]) -> torch.Tensor | None:
        """The reference pipeline for one batch: fp32 working copies, ``update``, store states
        with their rounding, write the weights back with the mode. Returns the stalled count.
        Working copies, random bits and the write-back's temporaries live in ``ctx.scratch``."""
        group, mode, scratch = ctx.group, ctx.mode, ctx.scratch
        device = batch[0].param.device
        grads = _working_copies([s.grad for s in batch], scratch, "grads", device)
        factor = (-1.0 if group["maximize"] else 1.0) * (1.0 if ctx.inv_scale is None else ctx.inv_scale)
        if factor != 1.0:
            grads = [g.mul_(factor) if g is not s.grad else g * factor for g, s in zip(grads, batch)]
        loaded = iter(_scratch_copies([s.param for s in batch if s.param.dtype in LOW_PRECISION], scratch, "weights",
                                      device))
        weights = [mode.load(s.param, s.buffer, next(loaded) if s.param.dtype in LOW_PRECISION else None)
                   for s in batch]
        names = list(batch[0].states)
        states = {n: _working_copies([s.states[n] for s in batch], scratch, f"state {n}", device) for n in names}
        updates = self.update(group, weights, grads, states, ctx.step)
        counts: list[torch.Tensor] = []
        rounding = group["state_rounding"]
        for i, s in enumerate(batch):
            streams = ctx.streams(s)
            streams.prefetch([Stream.STATE + j for j, n in enumerate(names)
                              if rounding == "stochastic" and s.states[n].dtype in LOW_PRECISION]
                             + (list(mode.draws(s.param, s.buffer)) if ctx.update_weights else []),
                             s.numel, device, scratch)
            for j, n in enumerate(names):
                store(s.states[n], states[n][i], rounding, streams, Stream.STATE + j)
            if not ctx.update_weights:
                continue
            stalled = mode.apply(s.param, weights[i], updates[i], s.buffer, streams, ctx.count, scratch)
            if stalled is not None:
                counts.append(stalled)
        return torch.stack(counts).sum() if ctx.count else None

    # ---- diagnostics ----------------------------------------------------------------------
    def diagnostics(self) -> list[dict[str, float]]:
        """Per parameter group: ``stalled_fraction`` (elements of the last step whose stored
        weight did not change: their update was lost to rounding, or zero), ``compensation_rel``
        (``||k|| / ||theta||`` over the group's Kahan buffers, 0 without any) and skip counters.
        With DTensor parameters the counts and squares are summed over ranks (one all-reduce:
        every rank must call it)."""
        sums = []   # per group: stalled, elements, ||k||^2, ||theta||^2; plain (local) then DTensor shares
        for i, group in enumerate(self.param_groups):
            plain, shared = [0.0] * 4, [0.0] * 4
            for stalled, n, weight in self._last_stalled.get(i, []):
                acc, w = (plain, 1.0) if weight == 0 else (shared, weight)
                acc[0] += w * float(stalled) if stalled is not None else math.nan
                acc[1] += w * n
            for p in group["params"]:
                k = self.state.get(p, {}).get("compensation")
                if k is not None:
                    acc, w = (shared, 1.0 / sharding.replicas(p)) if sharding.is_dtensor(p) else (plain, 1.0)
                    acc[2] += w * float(sharding.local(k).float().square().sum())
                    acc[3] += w * float(sharding.local(p).detach().float().square().sum())
            sums.append((plain, shared))
        if any(sharding.is_dtensor(p) for g in self.param_groups for p in g["params"]):
            reduced = iter(sharding.global_sums([v for _, shared in sums for v in shared]))
            sums = [(plain, [next(reduced) for _ in shared]) for plain, shared in sums]
        out: list[dict[str, float]] = []
        for plain, shared in sums:
            stalled_sum, count, comp_sq, weight_sq = (a + b for a, b in zip(plain, shared))
            out.append({
                "stalled_fraction": stalled_sum / count if count and not math.isnan(stalled_sum) else 0.0,
                "compensation_rel": math.sqrt(comp_sq / weight_sq) if weight_sq else 0.0,
                "skipped_params": float(self.skipped_params),
                "skipped_steps": float(self.skipped_steps),
            })
        return out

    # ---- checkpoints ----------------------------------------------------------------------
    def extras(self) -> dict[str, Any]:
        """What a checkpoint holds besides groups and states: the seed and the skip counters
        (the seed and the step counters define every random stream)."""
        return {"seed": self.seed, "skipped_params": self.skipped_params, "skipped_steps": self.skipped_steps,
                "optimizer": self.checkpoint_kind()}

    def checkpoint_kind(self) -> str:
        """The name a checkpoint of this optimizer carries (its spec's, else its class's), checked on
        load: another optimizer's moments would restart from zero with the old step counts."""
        return self.spec.name if self.spec is not None else type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        """torch's layout (``state`` by parameter index, ``param_groups``), each state in its own
        dtype, ``step`` as a 0-dim int64 tensor; the :meth:`extras` ride in every group under the
        key ``"lowp"``. Both are what ``torch.distributed.checkpoint`` restores in place (it
        leaves a plain int inside ``state`` at the value of the state dict it loads into)."""
        sd = super().state_dict()
        sd["state"] = {key: {**entry, **({"step": torch.tensor(entry["step"], dtype=torch.int64)}
                                         if isinstance(entry.get("step"), int) else {})}
                       for key, entry in sd["state"].items()}
        extras = self.extras()
        sd["param_groups"] = [{**options.saved_group(group), options.EXTRAS_KEY: extras}
                              for group in sd["param_groups"]]
        return sd

    def __getstate__(self) -> dict[str, Any]:
        """torch's pickled fields plus lowp's options and counters (``copy.deepcopy``, ``pickle``);
        the backend travels by name and chunk size, gradient release does not travel."""
        return {**super().__getstate__(), "nonfinite": self.nonfinite, "diagnostics_enabled": self.diagnostics_enabled,
                "seed": self.seed, "skipped_params": self.skipped_params, "skipped_steps": self.skipped_steps,
                "_wide": self._wide, "_backend_name": (self.backend.name, self.backend.chunk_size)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        backend = state.pop("_backend_name", None)
        super().__setstate__(state)
        if backend is not None:
            self.backend = get_backend(*backend)
            self._last_stalled, self._positions, self._released_by = {}, {}, None

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a checkpoint of this optimizer, of ``torch.optim`` or of optimi
        (:mod:`lowp.optim.migrate` translates the latter two), keeping every state's own dtype
        unless the group's ``state_dtype`` names one. Everything is checked first: group count
        and sizes, each group's hyper-parameters, each state's shape, dtype and step count, and
        the extras; on any error nothing has changed."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a mapping, got {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        sd = to_lowp_layout(self, state_dict)
        groups, state, extras = self._checked_load(sd)
        self.__setstate__({"state": state, "param_groups": groups})
        self.seed, self.skipped_params, self.skipped_steps = (extras["seed"], extras["skipped_params"],
                                                              extras["skipped_steps"])
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _checked_load(self, sd: Mapping[str, Any]) -> tuple[list[dict[str, Any]], defaultdict, dict[str, Any]]:
        """The new groups, states and extras of a checkpoint in lowp's layout, all checked."""
        extras = _checked_extras(sd.get("lowp"), self)
        saved_groups = sd["param_groups"]
        if sd.get("lowp") is None and any("mode" in g for g in saved_groups):
            warnings.warn("state_dict: this lowp checkpoint lacks its 'lowp' extras (the seed of the stochastic-"
                          "rounding streams and the skip counters; a checkpointer dropped them), so the optimizer "
                          f"keeps its own seed ({self.seed}) and a resumed run draws other random bits than the run "
                          "that saved it",
                          UserWarning, stacklevel=3)
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict: it has {len(saved_groups)} parameter groups, the optimizer "
                             f"{len(self.param_groups)}")
        for i, (old, new) in enumerate(zip(self.param_groups, saved_groups)):
            if len(old["params"]) != len(new["params"]):
                raise ValueError(f"state_dict: param_groups[{i}] has {len(new['params'])} parameters, the "
                                 f"optimizer's {len(old['params'])}")
        groups = []
        for i, (old, new) in enumerate(zip(self.param_groups, saved_groups)):
            new = options.loaded_group(new, f"state_dict: param_groups[{i}]")
            group = {**{k: v for k, v in old.items() if k != "params"}, **new, "params": old["params"],
                     options.EXTRAS_KEY: {}}
            try:
                self.check_group(group)
            except (TypeError, ValueError) as e:
                raise type(e)(f"state_dict: param_groups[{i}]: {e}") from None
            for p in group["params"]:
                resolve_mode(group["mode"], p)
            groups.append(group)
        saved_state = sd["state"]
        _check_state_keys(saved_state, saved_groups)
        state: defaultdict = defaultdict(dict)
        for group, new in zip(groups, saved_groups):
            for key, p in zip(new["params"], group["params"]):
                where = f"state_dict['state'][{key!r}]"
                if key not in saved_state:
                    continue
                entry = saved_state[key]
                if not isinstance(entry, Mapping):
                    raise TypeError(f"{where}: expected a dict of states, got {type(entry).__name__}")
                self._check_entry_names(group, p, entry, where)
                loaded = {}
                for name, value in entry.items():
                    if name == "step":
                        value = preflight.step_count(value, f"{where}['step']")
                    elif isinstance(value, torch.Tensor):
                        preflight.check_saved(value, f"{where}[{name!r}]")
                        value = self._loaded_tensor(group, name, p, value)
                    loaded[name] = value
                if loaded:
                    self._encode_loaded(group, p, loaded)
                    self.check_state(group, p, loaded, where)
                    state[p] = loaded
        self._check_values(groups, state)
        return groups, state, extras

    def _check_entry_names(self, group: dict[str, Any], p: torch.Tensor, entry: Mapping[str, Any],
                           where: str) -> None:
        """Every entry of a saved state is one a step of this optimizer reads: ``step``, its states
        (with their block scales when coded), a write-back buffer. Another optimizer's states
        (SGD's ``momentum_buffer`` in an AdamW) would be dropped while the moments restart from
        zero at the old step count."""
        names = self.state_names(group, p)
        known = {"step", *names, *BUFFER_NAMES, *(scale_name(n) for n in names)}
        for name in entry:
            if name not in known:
                raise ValueError(f"{where}[{name!r}]: {type(self).__name__} keeps no state of that name (its states: "
                                 f"{', '.join(names) or 'none'}, plus step and a write-back buffer); is this another "
                                 f"optimizer's checkpoint?")

    def _check_values(self, groups: list[dict[str, Any]], state: Mapping[torch.Tensor, dict[str, Any]]) -> None:
        """The loaded values a step can use: finite floating-point states, compensations and block
        scales, nonnegative states the spec declares so (a negative second moment makes
        ``sqrt(v)`` NaN) and nonnegative scales. With DTensor states each rank checks its shards
        and the ranks agree (one all-reduce), so all of them refuse or none does."""
        nonnegative = set(self.spec.nonnegative) if self.spec is not None else set()
        params, problems = [], []
        for index, (group, p) in enumerate((g, p) for g in groups for p in g["params"]):
            entry = state.get(p)
            if not entry:
                continue
            never_negative = nonnegative | {scale_name(n) for n in self.state_names(group, p)}
            params.append(p)
            problems.append(next((f"state_dict['state'][{index}][{name!r}]: {why}" for name, value in entry.items()
                                  if isinstance(value, torch.Tensor)
                                  for why in [_value_problem(sharding.local(value), name in never_negative)] if why),
                                 None))
        agreed = sharding.agree([problem is None for problem in problems], params)
        for problem, ok in zip(problems, agreed):
            if problem is not None:
                raise ValueError(problem)
            if not ok:
                raise ValueError("state_dict: another rank found a non-finite or out-of-range state value in its "
                                 "shards of this checkpoint (its error names the entry); nothing was loaded")

    def _loaded_tensor(self, group: dict[str, Any], name: str, p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A private copy of a saved tensor on ``p``'s device; a floating-point state is cast only
        when the group's ``state_dtype`` names a dtype for it."""
        for c in self.coded_states(group, p):   # codes and scales (a coded state saved as floats is encoded later)
            if name == scale_name(c.name) or (name == c.name and value.dtype not in _LOADABLE_FLOATS):
                (codes, scales), placements = self._coded_layout(group, p, c.code)
                return self._placed(value, p, codes if name == c.name else scales, placements, name)
        spec = group["state_dtype"]
        wanted = spec.get(name) if isinstance(spec, Mapping) else spec
        cast = (wanted is not None and code_for(wanted) is None and value.dtype in _LOADABLE_FLOATS
                and name in self.state_names(group, p))
        dtype = wanted if cast else value.dtype
        if sharding.is_dtensor(p) or sharding.is_dtensor(value):   # laid out (sharded) like p
            value = sharding.load_state(value, p)
            return value.to(dtype) if cast else value
        return value.to(device=p.device, dtype=dtype, copy=True, memory_format=torch.contiguous_format)

    @staticmethod
    def _placed(value: torch.Tensor, p: torch.Tensor, shape: torch.Size, placements: tuple | None,
                name: str) -> torch.Tensor:
        """A private copy of the saved codes or scales ``value`` (plain or DTensor, in this shape
        or flat, as saved before codes kept their parameter's rows) in ``shape``, placed like
        ``placements`` on ``p``'s mesh (a plain tensor when ``None``)."""
        if value.numel() != math.prod(shape):
            raise ValueError(f"state_dict: state {name!r}: {value.numel()} elements, expected {math.prod(shape)} "
                             f"(shape {tuple(shape)})")
        if placements is None:
            return sharding.gather(value).to(device=p.device, copy=True,
                                             memory_format=torch.contiguous_format).reshape(shape)
        return sharding.place(value, p, shape, placements)

    def _encode_loaded(self, group: dict[str, Any], p: torch.Tensor, loaded: dict[str, Any]) -> None:
        """Encode the floating-point states of a loaded checkpoint that the group stores as
        block-scaled codes (rounded to nearest: a load is not a step and draws no random bits).
        A sharded state is gathered and encoded whole (a collective: every rank loads)."""
        for c in self.coded_states(group, p):
            value = loaded.get(c.name)
            if not isinstance(value, torch.Tensor) or value.dtype not in _LOADABLE_FLOATS \
                    or scale_name(c.name) in loaded:
                continue
            if value.shape != p.shape:
                raise ValueError(f"state_dict: state {c.name!r}: expected shape {tuple(p.shape)} to encode it as "
                                 f"{c.code.name}, got {tuple(value.shape)}")
            (codes_at, scales_at), placements = self._coded_layout(group, p, c.code)
            codes = torch.empty(codes_at, dtype=c.code.storage, device=p.device)
            block_scales = torch.empty(scales_at, dtype=group["state_scale_dtype"], device=p.device)
            encode(sharding.gather(value).float(), c.code, group["state_block"], codes.view(-1),
                   block_scales.view(-1), None)
            if placements is None:   # fresh tensors of their own, as a plain parameter keeps them
                loaded[c.name], loaded[scale_name(c.name)] = codes, block_scales
            else:   # each rank keeps its box, or the whole state where it is replicated
                loaded[c.name] = sharding.place(codes, p, codes_at, placements)
                loaded[scale_name(c.name)] = sharding.place(block_scales, p, scales_at, placements)


#: Batches of fewer elements take fresh temporaries: the heap serves them without page faults,
#: and the scratch's bookkeeping would cost more than it saves.
_SCRATCH_MIN_NUMEL = 1 << 14


def _scratch_copies(tensors: list[torch.Tensor], scratch: Scratch, name: str, device: torch.device
                    ) -> list[torch.Tensor | None]:
    """Uninitialised fp32 tensors of the shapes of ``tensors`` in ``scratch``'s buffer ``name``
    (``None`` each for a batch too small to be worth it)."""
    if sum(t.numel() for t in tensors) < _SCRATCH_MIN_NUMEL:
        return [None] * len(tensors)
    copies: list[torch.Tensor | None] = [*scratch.split(name, [t.shape for t in tensors], torch.float32, device)]
    return copies


def _working_copies(tensors: list[torch.Tensor], scratch: Scratch, name: str, device: torch.device
                    ) -> list[torch.Tensor]:
    """:func:`~lowp.optim.storage.working_copy` of each tensor, the copies in ``scratch``'s buffer ``name``."""
    outs = iter(_scratch_copies([t for t in tensors if t.dtype not in (torch.float32, torch.float64)], scratch, name,
                                device))
    return [t if t.dtype in (torch.float32, torch.float64) else working_copy(t, next(outs)) for t in tensors]


def _checked_extras(extras: Any, optimizer: LowpOptimizer) -> dict[str, Any]:
    """The checkpoint's extras, checked (missing entries: the optimizer's seed, zero counters).
    The seed and the step counters define the random streams (:mod:`lowp.optim.randomness`)."""
    extras = {} if extras is None else extras
    if not isinstance(extras, Mapping):
        raise TypeError(f"state_dict: 'lowp' extras: expected a dict, got {type(extras).__name__}")
    out = {"seed": check_seed(extras.get("seed", optimizer.seed)),
           "skipped_params": preflight.check_count("skipped_params", extras.get("skipped_params", 0)),
           "skipped_steps": preflight.check_count("skipped_steps", extras.get("skipped_steps", 0))}
    kind = extras.get("optimizer")
    if kind is not None and kind != optimizer.checkpoint_kind():
        raise ValueError(f"state_dict: a checkpoint of {kind!r}, loaded into {type(optimizer).__name__} "
                         f"({optimizer.checkpoint_kind()!r}); its states mean something else here")
    return out   # a "generators" entry (lowp versions that drew from torch.Generator) is ignored


def _check_state_keys(saved_state: Mapping[Any, Any], saved_groups: Sequence[Mapping[str, Any]]) -> None:
    """Every key of a checkpoint's ``state`` is a parameter index of its ``param_groups`` (a state
    under another key would be dropped without a word: string keys after a JSON round trip, say)."""
    indices = {key for g in saved_groups for key in g["params"]}
    for key in saved_state:
        if key not in indices:
            hint = (f" (the index {int(key)} as a string: was it saved through JSON? state keys are the ints of "
                    f"param_groups[i]['params'])" if isinstance(key, str) and key.isdigit() and int(key) in indices
                    else "")
            raise ValueError(f"state_dict['state'][{key!r}]: no parameter of its param_groups has this key{hint}")


def _value_problem(value: torch.Tensor, never_negative: bool) -> str | None:
    """Why a loaded tensor cannot be stepped from (``None``: it can): a NaN or infinity in a
    floating-point state, compensation or scale (fp8 codes included), a negative value of a state
    declared nonnegative or of a block scale."""
    if value.numel() == 0 or not value.is_floating_point():
        return None
    floats = value.float() if value.element_size() == 1 else value
    if not bool(torch.isfinite(floats).all()):
        return "holds a NaN or an infinity; a step from it would make the weights NaN"
    if never_negative and bool((floats < 0).any()):
        return "holds negative values, and this entry is never negative (a second moment's sqrt would be NaN)"
    return None


class TwoMomentOptimizer(LowpOptimizer):
    """Checks shared by the Adam family: ``betas``, ``eps``, ``weight_decay``.

    The constructor is :class:`LowpOptimizer`'s; its Args section has the details of each option.

    Args:
        params: the tensors, parameter groups or ``(name, tensor)`` pairs to optimize.
        defaults: the subclass's hyper-parameters; besides ``lr`` they must hold ``betas`` (two
            numbers in [0, 1)), ``eps`` and ``weight_decay`` (finite numbers >= 0).
        mode (group): the write-back mode of bf16/fp16 weights (default ``"auto"``: kahan).
        state_dtype (group): the dtype of new states (default ``None``: the parameter's, bf16 for
            fp16 parameters), or a block-scaled code (``torch.int8``, ``torch.uint8``...).
        state_block (group): elements per scale of block-scaled states (default 64).
        state_scale_dtype (group): the dtype of the block scales (default ``torch.bfloat16``).
        state_rounding (group): ``"stochastic"`` (default) or ``"nearest"`` for 16-bit states.
        maximize (group): ascend instead of descend (default ``False``).
        nonfinite: ``"skip_param"`` (default), ``"skip_step"`` or ``"off"``.
        foreach: ``False`` runs unfused steps with the eager backend (default ``None``: foreach).
        backend: a backend by name (default ``None``: chosen from ``fused`` and ``foreach``).
        chunk_size: the most elements per batch or chunk (default ``None``: by device).
        seed: the stochastic-rounding seed (default ``torch.initial_seed()``; rank 0's under
            torch.distributed).
        diagnostics: count elements whose stored weight did not move (default ``True``).
        fused: ``None`` (default) fused when worth it, ``True`` required, ``False`` never.
        kahan_sum: optimi's spelling of ``mode`` (default ``None``: not given).
        capturable: only ``False`` (default) is supported.
        differentiable: only ``False`` (default) is supported.
    """

    def validate(self, group: dict[str, Any]) -> None:
        """Check ``betas``, ``eps`` and ``weight_decay``."""
        check_betas(group["betas"])
        check_nonnegative("eps", group["eps"])
        check_nonnegative("weight_decay", group["weight_decay"])
