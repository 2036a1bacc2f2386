"""``LowpOptimizer``: the bookkeeping every lowp optimizer shares.

A subclass only states its state names and its math::

    class MyOpt(LowpOptimizer):
        def state_names(self, group, param): return ("exp_avg",)
        def update(self, group, weights, grads, states, step): ... return updates

``update`` receives lists of fp32 tensors (weights and grads read-only, states updated in place)
and returns the intended change ``u`` of each weight, decoupled weight decay included. Everything
else lives here: parameter groups and hyper-parameter checks, state creation with a dtype per
state, step counting, the non-finite guard with skip counters, GradScaler support,
diagnostics, the backend that runs the step and the write-back mode that stores it, and an exact
``state_dict`` round trip (dtypes and compensation/remainder buffers included; stochastic
rounding draws counter-based bits from the seed and the step counters,
:mod:`lowp.optim.randomness`, so nothing else needs saving).
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping

import torch

from lowp.optim.backends import Backend, ParamSlice, StepContext, get_backend
from lowp.optim.randomness import Stream
from lowp.optim.storage import STATE_ROUNDINGS, store, working_copy
from lowp.optim.writeback import MODES, WriteBack, get_mode, resolve_mode

__all__ = ["LowpOptimizer", "TwoMomentOptimizer", "NONFINITE_POLICIES", "check_betas", "check_nonnegative",
           "real_value"]

NONFINITE_POLICIES = ("skip_param", "skip_step", "off")
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


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


def _check_state_dtype(value: Any) -> None:
    dtypes = value.values() if isinstance(value, Mapping) else [value]
    for d in dtypes:
        if d is not None and d not in _FLOAT_DTYPES:
            raise ValueError(f"state_dtype: expected None, a float dtype or a dict of them, got {value!r}")


class LowpOptimizer(torch.optim.Optimizer):
    """Base of every lowp optimizer.

    Common keyword arguments (per parameter group where noted):

    - ``mode`` (group): ``"auto"`` (kahan for bf16/fp16 weights), ``"kahan"``, ``"stochastic"``,
      ``"nearest"`` or ``"exact"``; fp32/fp64 weights are always updated plainly.
    - ``state_dtype`` (group): ``None`` (the parameter's dtype), a dtype, or a dict
      ``{state name: dtype}``.
    - ``state_rounding`` (group): ``"stochastic"`` (default) or ``"nearest"`` for states stored in
      16 bits. With beta2 = 0.999, ``v * beta2`` rounds back to ``v`` in bf16 (eps 2**-7), so
      round-to-nearest states stop decaying; stochastic rounding keeps them unbiased.
    - ``maximize`` (group).
    - ``nonfinite``: ``"skip_param"`` (a parameter whose gradient has a NaN/inf is not updated),
      ``"skip_step"`` (nothing is updated) or ``"off"`` (no check). Skips are counted.
    - ``foreach`` / ``backend`` / ``chunk_size``: how the step runs (:mod:`lowp.optim.backends`).
    - ``fused``: ``None`` picks a fused backend when one is available and worth it, ``True``
      requires one, ``False`` never uses one (:func:`lowp.optim.kernels.choose_backend`).
    - ``seed``: seed of the stochastic-rounding streams (default: ``torch.initial_seed()``): element
      ``i`` of parameter ``param_id`` (its position over all groups) draws
      ``random16(i, stream_key(seed, step, param_id, stream))`` (:mod:`lowp.optim.randomness`).
    - ``diagnostics``: count elements whose stored weight did not move this step.
    """

    #: True when ``update`` is elementwise, so parameters may be cut into chunks.
    elementwise: bool = True
    #: GradScaler hands ``grad_scale``/``found_inf`` to ``step`` instead of unscaling in place.
    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable, defaults: dict[str, Any], *, mode: str = "auto",
                 state_dtype: "torch.dtype | Mapping[str, torch.dtype] | None" = None,
                 state_rounding: str = "stochastic", maximize: bool = False, nonfinite: str = "skip_param",
                 foreach: bool | None = None, backend: str | None = None, chunk_size: int = 1 << 17,
                 seed: int | None = None, diagnostics: bool = True, fused: bool | None = None) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite: expected one of {', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
        if backend is not None and fused:
            raise ValueError(f"fused: fused=True conflicts with backend={backend!r}; give one of them")
        get_backend(backend or "eager", chunk_size)  # checks backend and chunk_size before any state exists
        self.nonfinite = nonfinite
        self.diagnostics_enabled = bool(diagnostics)
        self.seed = torch.initial_seed() if seed is None else int(seed)
        self.skipped_params = 0
        self.skipped_steps = 0
        self._last_stalled: dict[int, tuple[torch.Tensor | None, int]] = {}
        defaults = dict(defaults, mode=mode, state_dtype=state_dtype, state_rounding=state_rounding,
                        maximize=maximize)
        super().__init__(params, defaults)
        if backend is None:
            from lowp.optim.kernels import choose_backend
            backend = choose_backend(self, fused, foreach)
        self.backend: Backend = get_backend(backend, chunk_size)

    # ---- subclass hooks -------------------------------------------------------------------
    def state_names(self, group: dict[str, Any], param: torch.Tensor) -> tuple[str, ...]:
        """Names of the optimizer states of ``param``."""
        return ()

    def state_shape(self, name: str, param: torch.Tensor) -> torch.Size:
        """Shape of state ``name`` of ``param`` (default: the parameter's shape)."""
        return param.shape

    def validate(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the bad hyper-parameter of ``group``."""

    def update(self, group: dict[str, Any], weights: list[torch.Tensor], grads: list[torch.Tensor],
               states: dict[str, list[torch.Tensor]], step: int) -> list[torch.Tensor]:
        """The intended weight changes (fresh fp32 tensors); see the module docstring."""
        raise NotImplementedError

    # ---- parameter groups -----------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        merged = {**self.defaults, **param_group}
        check_nonnegative("lr", merged["lr"])
        if merged["mode"] != "auto":
            get_mode(merged["mode"])
        if merged["state_rounding"] not in STATE_ROUNDINGS:
            raise ValueError(f"state_rounding: expected one of {', '.join(STATE_ROUNDINGS)}, "
                             f"got {merged['state_rounding']!r}")
        _check_state_dtype(merged["state_dtype"])
        self.validate(merged)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if not isinstance(p, torch.Tensor) or p.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"params: expected real floating-point tensors, got "
                                f"{getattr(p, 'dtype', type(p).__name__)}")
            resolve_mode(merged["mode"], p)
        super().add_param_group({**param_group, "params": params})

    # ---- state ----------------------------------------------------------------------------
    def _state_dtype(self, group: dict[str, Any], name: str, param: torch.Tensor) -> torch.dtype:
        spec = group["state_dtype"]
        dtype = spec.get(name) if isinstance(spec, Mapping) else spec
        return dtype or param.dtype

    def init_state(self, group: dict[str, Any], p: torch.Tensor, mode: WriteBack) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            for name in self.state_names(group, p):
                state[name] = torch.zeros(self.state_shape(name, p), dtype=self._state_dtype(group, name, p),
                                          device=p.device)
            if mode.buffer_name is not None:
                state[mode.buffer_name] = mode.init_buffer(p.detach())
        return state

    # ---- the step -------------------------------------------------------------------------
    def _finite_flags(self, grads: list[torch.Tensor]) -> list[bool]:
        return [True] * len(grads) if self.nonfinite == "off" else self.backend.finite_flags(grads)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; returns ``closure()``'s loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            self.skipped_steps += 1
            return loss
        grad_scale = getattr(self, "grad_scale", None)
        inv_scale = None if grad_scale is None else float(grad_scale.double().reciprocal())

        params = [(group, p) for group in self.param_groups for p in group["params"]]   # param_id = position here
        todo = [(group, p, param_id) for param_id, (group, p) in enumerate(params) if p.grad is not None]
        for p in (p for _, p, _ in todo):
            if p.grad.is_sparse:
                raise TypeError("params: sparse gradients are not supported")
        # GradScaler hands over found_inf only after checking every gradient of this optimizer:
        # 0 means all are finite, and a second pass over them would cost about 10% of a fused step
        finite = [True] * len(todo) if found_inf is not None else self._finite_flags([p.grad for _, p, _ in todo])
        if not all(finite) and self.nonfinite == "skip_step":
            self.skipped_steps += 1
            return loss
        self.skipped_params += finite.count(False)

        jobs: dict[tuple, list[ParamSlice]] = defaultdict(list)
        for (group, p, param_id), ok in zip(todo, finite):
            if not ok:
                continue
            mode = resolve_mode(group["mode"], p)
            state = self.init_state(group, p, mode)
            state["step"] += 1
            names = self.state_names(group, p)
            key = (id(group), mode.name, state["step"], p.dtype, p.device, names)
            jobs[key].append(ParamSlice(p, p.grad, {n: state[n] for n in names},
                                        state.get(mode.buffer_name) if mode.buffer_name else None, param_id))
        groups = {id(g): (i, g) for i, g in enumerate(self.param_groups)}
        self._last_stalled = {}
        for (gid, mode_name, step, _, _, _), slices in jobs.items():
            index, group = groups[gid]
            ctx = StepContext(group, MODES[mode_name], step, inv_scale, self.seed, self.diagnostics_enabled)
            stalled = self.backend.run(self, ctx, slices)
            old, n = self._last_stalled.get(index, (None, 0))
            if stalled is not None:
                stalled = stalled if old is None else old + stalled
            self._last_stalled[index] = (stalled, n + sum(s.numel for s in slices))
        return loss

    def apply_batch(self, ctx: StepContext, batch: list[ParamSlice]) -> torch.Tensor | None:
        """The reference pipeline for one batch: fp32 working copies, ``update``, store states
        with their rounding, write the weights back with the mode. Returns the stalled count."""
        group, mode = ctx.group, ctx.mode
        grads = [working_copy(s.grad) for s in batch]
        factor = (-1.0 if group["maximize"] else 1.0) * (1.0 if ctx.inv_scale is None else ctx.inv_scale)
        if factor != 1.0:
            grads = torch._foreach_mul(grads, factor)
        weights = [mode.load(s.param, s.buffer) for s in batch]
        names = list(batch[0].states)
        states = {n: [working_copy(s.states[n]) for s in batch] for n in names}
        updates = self.update(group, weights, grads, states, ctx.step)
        counts = []
        for i, s in enumerate(batch):
            streams = ctx.streams(s)
            for j, n in enumerate(names):
                store(s.states[n], states[n][i], group["state_rounding"], streams, Stream.STATE + j)
            counts.append(mode.apply(s.param, weights[i], updates[i], s.buffer, streams, ctx.count))
        return torch.stack(counts).sum() if ctx.count else None

    # ---- diagnostics ----------------------------------------------------------------------
    def diagnostics(self) -> list[dict[str, float]]:
        """Per parameter group: ``stalled_fraction`` (elements of the last step whose stored
        weight did not change: their update was lost to rounding, or zero), ``compensation_rel``
        (``||k|| / ||theta||`` over the group's Kahan buffers, 0 without any) and skip counters."""
        out = []
        for i, group in enumerate(self.param_groups):
            stalled, n = self._last_stalled.get(i, (None, 0))
            comp_sq, weight_sq = 0.0, 0.0
            for p in group["params"]:
                k = self.state.get(p, {}).get("compensation")
                if k is not None:
                    comp_sq += float(k.float().square().sum())
                    weight_sq += float(p.detach().float().square().sum())
            out.append({
                "stalled_fraction": float(stalled) / n if stalled is not None and n else 0.0,
                "compensation_rel": math.sqrt(comp_sq / weight_sq) if weight_sq else 0.0,
                "skipped_params": float(self.skipped_params),
                "skipped_steps": float(self.skipped_steps),
            })
        return out

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["lowp"] = {"seed": self.seed, "skipped_params": self.skipped_params,
                      "skipped_steps": self.skipped_steps}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint keeping every state's own dtype (torch's loader would cast
        floating-point states to the parameter's dtype, losing fp32 states of bf16 weights).
        The ``generators`` entry of checkpoints from lowp versions that drew stochastic rounding
        from ``torch.Generator`` is ignored: the seed and the step counters define the streams."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("state_dict: it has a different number of parameter groups")
        super().load_state_dict({"state": {}, "param_groups": saved_groups})
        ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i in state_dict["state"]:
                self.state[p] = {k: v.to(device=p.device, copy=True) if isinstance(v, torch.Tensor) else v
                                 for k, v in state_dict["state"][i].items()}
        extra = state_dict.get("lowp", {})
        self.seed = extra.get("seed", self.seed)
        self.skipped_params = extra.get("skipped_params", 0)
        self.skipped_steps = extra.get("skipped_steps", 0)


class TwoMomentOptimizer(LowpOptimizer):
    """Checks and states shared by the Adam family: ``betas``, ``eps``, ``weight_decay``;
    states ``exp_avg`` and ``exp_avg_sq``."""

    def validate(self, group: dict[str, Any]) -> None:
        check_betas(group["betas"])
        check_nonnegative("eps", group["eps"])
        check_nonnegative("weight_decay", group["weight_decay"])

    def state_names(self, group: dict[str, Any], param: torch.Tensor) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")
