"""``LowpOptimizer``: the class every lowp optimizer derives from, torch's ``Optimizer`` contract
(parameter groups, ``step``, ``state_dict``, hooks, pickling) with lowp's options.

A subclass only states its spec (:mod:`lowp.optim.spec`: state names, numbers, switches and the
elementwise rule the fused kernels run) and its reference math::

    class MyOpt(LowpOptimizer):
        spec = OptimizerSpec("myopt", states=lambda group: ("exp_avg",), numbers=..., rule=...)
        def update(self, group, weights, grads, states, step): ... return updates

(a subclass without a spec states ``state_names`` instead and always runs the reference).
``update`` receives lists of fp32 tensors (weights and grads read-only, states updated in place)
and returns the intended change ``u`` of each weight, decoupled weight decay included.

The class keeps the options and parameter groups (checked by :mod:`lowp.optim.hyper`), the seed,
the skip counters and the backend. The other jobs have their modules, whose functions it binds as
its methods (subclasses may override them; they reach the optimizer's other methods through it):
:mod:`~lowp.optim.state_layout` (a parameter's states: ``init_state``, ``check_state``...),
:mod:`~lowp.optim.step_plan` (the step, all or nothing), :mod:`~lowp.optim.reference`
(``apply_batch``), :mod:`~lowp.optim.diagnostics` and :mod:`~lowp.optim.checkpointing` (what
``state_dict`` saves and ``load_state_dict`` checks).

``step()`` reads through four objects: this optimizer (checks, counters, the non-finite policy),
its :class:`~lowp.optim.step_plan.StepPlan` (states created, slices grouped into jobs), the
:class:`~lowp.optim.backends.Backend` that runs each job (a fused kernel, or :meth:`apply_batch`)
and the :class:`~lowp.optim.writeback.WriteBack` mode that stores each weight. It is never traced
by ``torch.compile`` (:data:`COMPILE_REASON`). ``step_params`` steps some of the parameters along
the same path (gradient release, :mod:`lowp.optim.release`, steps each during the backward pass).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Iterable, Sequence

import torch

from lowp.optim import checkpointing, options, reference, sharding, state_layout, step_plan
from lowp.optim.backends import Backend, backend_for, get_backend
from lowp.optim.cached_step import Plans
from lowp.optim.diagnostics import report
from lowp.optim.hyper import (CONSTRUCTOR_OPTIONS, NONFINITE_POLICIES, check_betas, check_group_values,
                              check_nonnegative, check_optimizer_options, check_state_dtype_names, checked_group,
                              mode_from_kahan_sum, real_value, warn_if_swapped)
from lowp.optim.migrate import check_optimizer_state_dict, to_lowp_layout
from lowp.optim.preflight import check_seed
from lowp.optim.randomness import default_seed
from lowp.optim.spec import OptimizerSpec
from lowp.optim.stalled import Stalled
from lowp.optim.state_layout import default_state_dtype

__all__ = ["LowpOptimizer", "TwoMomentOptimizer", "NONFINITE_POLICIES", "default_state_dtype", "check_betas",
           "check_nonnegative", "real_value", "warn_if_swapped", "COMPILE_REASON"]

#: Why ``torch.compile`` must not trace a lowp step (shown by ``fullgraph=True``).
COMPILE_REASON = ("a lowp optimizer step runs eagerly (its fused kernels and exact bf16 round trips, e.g. the Kahan "
                  "update k' = v - (theta' - theta), would be rewritten by Inductor); compile the model and call "
                  "opt.step() outside the compiled function, or use fullgraph=False so the compiled code "
                  "graph-breaks around the step")


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
            master weight exactly, 4 bytes), ``"exact8"`` (bf16 weight + int8 remainder, 16
            significant bits in 3 bytes, the remainder rounded stochastically), both for bf16
            weights only (a ``TypeError`` for fp16), or ``"master"`` (an fp32 master weight beside
            a bf16 or fp16 weight, 4 extra bytes). fp32/fp64 weights are always updated plainly,
            whatever the mode. Another name raises ``ValueError``.
        state_dtype (group): the dtype new optimizer states are created in: ``None`` (default:
            the parameter's dtype, but bf16 for fp16 parameters, see :func:`default_state_dtype`),
            ``torch.float32``, ``torch.bfloat16``, ``torch.float16``, or a dict
            ``{state name: dtype or None}``. fp64 parameters always keep fp64 states; float64
            and other dtypes raise ``ValueError``. Block-scaled codes (:mod:`lowp.optim.codes`):
            ``torch.int8``, ``torch.int4``, ``torch.float8_e4m3fn`` and ``torch.float8_e5m2`` for
            any state, ``torch.uint8`` and ``torch.uint4`` (stored as square roots) for the
            states the optimizer's spec declares nonnegative (Adam's ``exp_avg_sq``); elementwise
            states only, else ``ValueError`` (:mod:`lowp.optim.encodings`: one module per code).
            DTensor parameters keep the codes of whole blocks sharded like themselves, replicated
            where their shards split blocks (:func:`lowp.optim.sharding.coded_placements`).
        state_block (group): elements per scale of block-scaled states: 32, 64 (default), 128 or
            256.
        state_scale_dtype (group): the dtype of the block scales: ``torch.bfloat16`` (default:
            fp32's range, so the scales of tiny second moments do not underflow as in fp16),
            ``torch.float16`` or ``torch.float32``.
        coded_min_numel (group): parameters of fewer elements (their whole size, however they
            are sharded) keep the states ``state_dtype`` asks codes for in 16 bits
            (:func:`~lowp.optim.state_layout.default_state_dtype` of the weight), as
            bitsandbytes' ``min_8bit_size`` (4096) and torchao's low-bit optimizers (4096
            elements) keep small tensors' states whole; default 4096 (0: codes for every size).
            Biases and norm weights are a negligible share of the bytes, and a vector's shards
            are the ones that split blocks under FSDP2 (``docs/distributed.md``).
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
                 state_rounding: str = "stochastic", coded_min_numel: int = 4096, maximize: bool = False,
                 nonfinite: str = "skip_param",
                 foreach: bool | None = None, backend: str | None = None, chunk_size: int | None = None,
                 seed: int | None = None, diagnostics: bool = True, fused: bool | None = None,
                 kahan_sum: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 **unknown: Any) -> None:
        if unknown:
            raise options.unknown_keywords(type(self).__name__, unknown, [*defaults, *CONSTRUCTOR_OPTIONS])
        check_optimizer_options(nonfinite, foreach, diagnostics, capturable, differentiable)
        mode = mode_from_kahan_sum(mode, kahan_sum)
        if backend is not None and fused:
            raise ValueError(f"fused: fused=True conflicts with backend={backend!r}; give one of them")
        get_backend(backend or "eager", chunk_size)  # checks backend and chunk_size before any state exists
        self.nonfinite = nonfinite
        self.diagnostics_enabled = diagnostics
        seed = None if seed is None else check_seed(seed)
        self.skipped_params = 0
        self.skipped_steps = 0
        # per group: (stalled count, elements, sharding.Share) of each job of the last step
        self._last_stalled: dict[int, list[tuple[Stalled, int, sharding.Share]]] = {}
        # parameter -> (group index, index in the group, position over all groups), a cache of
        # lowp.optim.step_plan.prepare_subset
        self._positions: dict[torch.Tensor, tuple[int, int, int]] = {}
        # the plan of the last full step, reused while it matches (lowp.optim.cached_step)
        self._plans = Plans()
        # why the states cannot be stepped from: a refused load whose state dict was this
        # optimizer's own tensors, which a loader may have written in place; cleared by a load
        self._overwritten: str | None = None
        # what a group may repeat of the optimizer-wide options (lowp.optim.options.group_options)
        self._wide = dict(seed=seed, nonfinite=nonfinite, backend=backend, chunk_size=chunk_size,
                          diagnostics=diagnostics, foreach=foreach, fused=fused, capturable=capturable,
                          differentiable=differentiable)
        if "betas" in defaults:
            defaults = dict(defaults, betas=options.plain_betas(defaults["betas"]))
        state_dtype = options.dtype_value(state_dtype, "state_dtype")
        state_scale_dtype = options.dtype_value(state_scale_dtype, "state_scale_dtype")
        defaults = dict(defaults, mode=mode, state_dtype=state_dtype, state_block=state_block,
                        state_scale_dtype=state_scale_dtype, state_rounding=state_rounding,
                        coded_min_numel=coded_min_numel, maximize=maximize)
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

    @classmethod
    def shards_sums(cls) -> bool:
        """Whether this per-tensor optimizer steps the shards of a DTensor parameter with the
        whole tensor's sum exchanged between the ranks (:mod:`lowp.optim.sharded_sums`) rather
        than on gathered copies: its class's spec has a ``tensor_sum``, its ``update`` is the one
        the spec mirrors, and the class that declares the spec gives the terms (``tensor_terms``),
        so a subclass with a spec of its own never inherits another spec's terms."""
        owner = next((c for c in cls.__mro__ if "spec" in c.__dict__), None)
        return cls.spec is not None and cls.spec.tensor_sum is not None and cls.update is cls._spec_update \
            and owner is not None and callable(owner.__dict__.get("tensor_terms"))

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
        (a complete group: defaults merged in): the options every optimizer has
        (:func:`~lowp.optim.hyper.check_group_values`, a ``state_dtype`` dict naming its states:
        :func:`~lowp.optim.hyper.check_state_dtype_names`), then the subclass's ``validate``. Used by
        ``add_param_group``, ``load_state_dict`` and before every step."""
        check_group_values(group, self.flag_keys)
        check_state_dtype_names(self, group)
        self.validate(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its hyper-parameters and every parameter (layout, mode, overlap,
        :func:`~lowp.optim.hyper.checked_group`)."""
        super().add_param_group(checked_group(self, param_group))

    # ---- the jobs of other modules, bound as methods (module docstring) ----------------------
    # a parameter's states (lowp.optim.state_layout)
    state_dtypes = state_layout.state_dtypes
    coded_states = state_layout.coded_states
    check_state = state_layout.check_state
    init_state = state_layout.init_state
    # the step's checks and non-finite flags (lowp.optim.step_plan), a batch's reference pipeline
    _prepare = step_plan.prepare
    _finite_flags = step_plan.finite_flags
    apply_batch = reference.apply_batch
    diagnostics = report
    # checkpoints (lowp.optim.checkpointing)
    extras = checkpointing.extras
    checkpoint_kind = checkpointing.checkpoint_kind
    _recode_loaded = checkpointing.recode_loaded
    _value_problems = checkpointing.value_problems

    # ---- the step -------------------------------------------------------------------------
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
        self._check_not_overwritten()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step_plan.step_all(self)
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
        self._check_not_overwritten()
        return step_plan.step_some(self, params, grad_scale, new_step, update_weights)

    # ---- checkpoints and pickling ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's layout (``state`` by parameter index, ``param_groups``), each state in its own
        dtype, ``step`` as a 0-dim int64 tensor; the :meth:`extras` ride in every group under the
        key ``"lowp"``. Both are what ``torch.distributed.checkpoint`` restores in place (it
        leaves a plain int inside ``state`` at the value of the state dict it loads into)."""
        return checkpointing.saved(super().state_dict(), self.extras())

    def __getstate__(self) -> dict[str, Any]:
        """torch's pickled fields plus lowp's options and counters (``copy.deepcopy``, ``pickle``);
        the backend travels by name and chunk size, gradient release does not travel."""
        return {**super().__getstate__(), "nonfinite": self.nonfinite, "diagnostics_enabled": self.diagnostics_enabled,
                "seed": self.seed, "skipped_params": self.skipped_params, "skipped_steps": self.skipped_steps,
                "_wide": self._wide, "_backend_name": (self.backend.name, self.backend.chunk_size),
                "_overwritten": getattr(self, "_overwritten", None)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        backend = state.pop("_backend_name", None)
        super().__setstate__(state)
        if backend is not None:
            self.backend = get_backend(*backend)
            self._last_stalled, self._positions, self._released_by = {}, {}, None
        self._plans = Plans()

    def _check_not_overwritten(self) -> None:
        if getattr(self, "_overwritten", None) is not None:
            raise RuntimeError(f"step: {self._overwritten}")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a checkpoint of this optimizer, of ``torch.optim`` or of optimi
        (:mod:`lowp.optim.migrate` translates the latter two), keeping every state's own dtype
        unless the group's ``state_dtype`` names one. Everything is checked first: group count
        and sizes, each group's hyper-parameters, each state's shape, dtype and step count, the
        extras, and that no state arrives cast into this optimizer's storage layout (a template
        of other options filled by ``torch.distributed.checkpoint.load``). On any error this
        method changes nothing; but when that last check refuses a state dict made of this
        optimizer's own state tensors (``dcp.load`` fills them in place before this method sees
        them), they hold what the loader wrote, and :meth:`step` / :meth:`step_params` raise
        until a load succeeds."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a mapping, got {type(state_dict).__name__}")
        given = state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        try:
            check_optimizer_state_dict(state_dict)   # before any collective (its docstring)
            groups, state, extras = checkpointing.checked_load(self, lambda: to_lowp_layout(self, state_dict))
        except checkpointing.LayoutCastError as e:
            if checkpointing.holds_live_states(self, given) or checkpointing.holds_live_states(self, state_dict):
                self._overwritten = (
                    f"this optimizer's states hold what a loader wrote into them from a checkpoint of another "
                    f"storage layout (torch.distributed.checkpoint.load fills the optimizer's own state tensors "
                    f"in place; load_state_dict then refused: {str(e)[:300]}); load a checkpoint of this "
                    f"optimizer's layout, or build the optimizer with the checkpoint's options")
            raise
        self.__setstate__({"state": state, "param_groups": groups})
        self._overwritten = None
        self.seed, self.skipped_params, self.skipped_steps = (extras["seed"], extras["skipped_params"],
                                                              extras["skipped_steps"])
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


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
        coded_min_numel (group): smaller parameters keep 16-bit states instead of codes (default 4096).
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
