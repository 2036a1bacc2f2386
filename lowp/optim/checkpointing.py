"""The checkpoints of a lowp optimizer: what ``state_dict`` saves and how ``load_state_dict``
checks a checkpoint before it replaces anything.

A checkpoint is torch's layout (``state`` by parameter index, ``param_groups``), each state in its
own dtype and ``step`` as a 0-dim int64 tensor (:func:`saved`). It holds only tensors, numbers,
strings, lists and dicts (dtypes as their names, :mod:`lowp.optim.options`), so every torch
checkpoint helper takes it, and the extras (:func:`extras`: the seed and the skip counters, which
with the step counters define every random stream, :mod:`lowp.optim.randomness`, and the
optimizer's kind) ride in every group under ``"lowp"``, a key every live group also has, so that
checkpointers which rebuild groups from the live keys keep them.

Loading (:func:`checked_load`, after :mod:`lowp.optim.migrate` translated a torch or optimi
layout) validates the whole checkpoint first: the optimizer's kind, the group count and sizes,
each group's hyper-parameters, every state key and entry name, states that arrive in this
optimizer's layout instead of the saved one (:func:`_cast_into_layout`), each tensor's layout,
shape and dtype (floating-point states are cast only where ``state_dtype`` names a dtype, and
encoded where it names a block-scaled code), finite values, nonnegative second moments and
scales, step counts that can be saved again. With DTensor states every rank checks its shards
and the ranks agree, twice (the entries as read, then the states as placed); a rank that fails
in between tells the others at their next collective of the load (:func:`checked_load`).
"""
from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import torch

from lowp.optim import collectives, options, preflight, sharding
from lowp.optim.codes import CODES, SCALE_DTYPES, Code, code_for, decode, encode, scale_name, stored_shapes
from lowp.optim.slices import CodedState
from lowp.optim.preflight import check_seed
from lowp.optim.spec import OptimizerSpec
from lowp.optim.state_layout import STORED_FLOATS, asked_dtype, coded_layout, new_state_dtype
from lowp.optim.writeback import BUFFER_NAMES, resolve_mode

__all__ = ["extras", "checkpoint_kind", "saved", "checked_load", "LayoutCastError", "holds_live_states",
           "value_problems", "recode_loaded"]


class LowpOptimizer(Protocol):
    """What the checkpoint code reads of the optimizer (:class:`lowp.optim.base.LowpOptimizer`,
    which imports this module)."""

    param_groups: list[dict[str, Any]]
    seed: int
    skipped_params: int
    skipped_steps: int

    @property
    def state(self) -> Mapping[torch.Tensor, Mapping[str, Any]]:
        """The states by parameter (torch's ``Optimizer.state``)."""

    @property
    def spec(self) -> OptimizerSpec | None:
        """The optimizer's spec (``None``: reference only)."""

    def checkpoint_kind(self) -> str:
        """:func:`checkpoint_kind`, bound."""

    def check_group(self, group: dict[str, Any]) -> None:
        """Check a group's hyper-parameters."""

    def state_names(self, group: dict[str, Any], param: torch.Tensor) -> tuple[str, ...]:
        """Names of the optimizer states of ``param``."""

    def coded_states(self, group: dict[str, Any], param: torch.Tensor) -> list[CodedState]:
        """The block-scaled states of ``param``."""

    def check_state(self, group: dict[str, Any], p: torch.Tensor, state: Mapping[str, Any], where: str,
                    coded_states: list[CodedState] | None = None) -> None:
        """Check the state entries of ``p``."""

    def _recode_loaded(self, group: dict[str, Any], p: torch.Tensor, loaded: dict[str, Any]) -> None:
        """:func:`recode_loaded`, bound."""

    def _value_problems(self, groups: list[dict[str, Any]], state: Mapping[torch.Tensor, dict[str, Any]]
                        ) -> list[str | None]:
        """:func:`value_problems`, bound."""


def extras(optimizer: LowpOptimizer) -> dict[str, Any]:
    """What a checkpoint holds besides groups and states: the seed and the skip counters
    (the seed and the step counters define every random stream)."""
    return {"seed": optimizer.seed, "skipped_params": optimizer.skipped_params,
            "skipped_steps": optimizer.skipped_steps, "optimizer": optimizer.checkpoint_kind()}


def checkpoint_kind(optimizer: LowpOptimizer) -> str:
    """The name a checkpoint of this optimizer carries (its spec's, else its class's), checked on
    load: another optimizer's moments would restart from zero with the old step counts."""
    return optimizer.spec.name if optimizer.spec is not None else type(optimizer).__name__


def saved(sd: dict[str, Any], extras: dict[str, Any]) -> dict[str, Any]:
    """torch's ``state_dict`` ``sd`` as a lowp checkpoint: each ``step`` a 0-dim int64 tensor,
    the dtypes of each group as their names and the ``extras`` in every group."""
    sd["state"] = {key: {**entry, **({"step": torch.tensor(entry["step"], dtype=torch.int64)}
                                     if isinstance(entry.get("step"), int) else {})}
                   for key, entry in sd["state"].items()}
    sd["param_groups"] = [{**options.saved_group(group), options.EXTRAS_KEY: extras} for group in sd["param_groups"]]
    return sd


def checked_load(optimizer: LowpOptimizer, read: Callable[[], Mapping[str, Any]]
                 ) -> tuple[list[dict[str, Any]], defaultdict, dict[str, Any]]:
    """The new groups, states and extras of the checkpoint ``read()`` returns (a state dict in
    lowp's layout: :func:`lowp.optim.migrate.to_lowp_layout`, which may run a third-party
    ``dequantize``), all checked, in two rounds that the ranks of the optimizer's DTensor
    parameters take together (:class:`~lowp.optim.collectives.FailTogether`): each rank reads
    (``read()``) and checks its entries (:func:`_read`), and they agree; each places its states
    in this run's layout (collectives where a state arrives in another one), recodes and checks
    them and their values (:func:`_placed_states`), and they agree again. A rank that fails
    anywhere in a round (a bad entry on this rank only, out of memory) sends its failure at its
    next point of agreement, so the others raise :class:`~lowp.optim.collectives.PeerFailed`
    instead of waiting for it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ranks = collectives.FailTogether(collectives.agreement(params))
    reading: list[_Reading] = []
    first = ranks.agree(lambda: _read(optimizer, read(), reading), whole=True)
    groups, entries, casts, extras, extras_missing = reading[0]
    for cast, ok in zip(casts, first):
        if cast is not None:
            raise LayoutCastError(cast)
        if not ok:
            raise LayoutCastError("state_dict: on another rank a state arrived cast into this optimizer's storage "
                                  "layout (its error names the entry); nothing was loaded")
    if extras_missing:
        warnings.warn("state_dict: this lowp checkpoint lacks its 'lowp' extras (the seed of the stochastic-"
                      "rounding streams and the skip counters; a checkpointer dropped them), so the optimizer "
                      f"keeps its own seed ({optimizer.seed}) and a resumed run draws other random bits than the run "
                      "that saved it",
                      UserWarning, stacklevel=3)
    state: defaultdict = defaultdict(dict)
    problems: list[str | None] = []

    def place_and_check() -> list[bool]:
        with sharding.announcing(ranks.before_collective):
            _placed_states(optimizer, entries, state)
        problems.extend(optimizer._value_problems(groups, state))
        return [problem is None for problem in problems]
    for problem, ok in zip(problems, ranks.agree(place_and_check, whole=True)):
        if problem is not None:
            raise ValueError(problem)
        if not ok:
            raise ValueError("state_dict: another rank found a non-finite or out-of-range state value in its "
                             "shards of this checkpoint (its error names the entry); nothing was loaded")
    return groups, state, extras


class _Reading(NamedTuple):
    """What :func:`_read` found: the new groups, per parameter with an entry its group, the
    parameter, the entry and where it is, per parameter of every group a state cast into this
    run's layout (``None``: none), the extras, and whether the checkpoint lacks them."""

    groups: list[dict[str, Any]]
    entries: list[tuple[dict[str, Any], torch.Tensor, Mapping[str, Any], str]]
    casts: list[str | None]
    extras: dict[str, Any]
    extras_missing: bool


def _read(optimizer: LowpOptimizer, sd: Mapping[str, Any], out: list[_Reading]) -> list[bool]:
    """Check the checkpoint ``sd`` against ``optimizer`` (its kind and extras, the group count and
    sizes, each group's hyper-parameters, the state keys, each parameter's entry on this rank: its
    shards) and append the :class:`_Reading` to ``out``; per parameter of every group, whether its
    states arrived in their saved layout rather than in this run's."""
    extras = _checked_extras(sd.get("lowp"), optimizer)
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"state_dict: it has {len(saved_groups)} parameter groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    for i, (old, new) in enumerate(zip(optimizer.param_groups, saved_groups)):
        if len(old["params"]) != len(new["params"]):
            raise ValueError(f"state_dict: param_groups[{i}] has {len(new['params'])} parameters, the "
                             f"optimizer's {len(old['params'])}")
    groups = []
    for i, (old, new) in enumerate(zip(optimizer.param_groups, saved_groups)):
        new = options.loaded_group(new, f"state_dict: param_groups[{i}]")
        if "mode" in new and "coded_min_numel" not in new:   # lowp's, saved before the option: codes at every size
            new["coded_min_numel"] = 0
        group = {**{k: v for k, v in old.items() if k != "params"}, **new, "params": old["params"],
                 options.EXTRAS_KEY: {}}
        try:
            optimizer.check_group(group)
        except (TypeError, ValueError) as e:
            raise type(e)(f"state_dict: param_groups[{i}]: {e}") from None
        for p in group["params"]:
            resolve_mode(group["mode"], p)
        groups.append(group)
    saved_state = sd["state"]
    _check_state_keys(saved_state, saved_groups)
    live = _live_tensors(optimizer)
    entries: list[tuple[dict[str, Any], torch.Tensor, Mapping[str, Any], str]] = []
    casts: list[str | None] = []
    for group, live_group, new in zip(groups, optimizer.param_groups, saved_groups):
        for key, p in zip(new["params"], group["params"]):
            where = f"state_dict['state'][{key!r}]"
            entry = saved_state.get(key)
            casts.append(None)
            if entry is None:
                continue
            if not isinstance(entry, Mapping):
                raise TypeError(f"{where}: expected a dict of states, got {type(entry).__name__}")
            _check_entry_names(optimizer, group, p, entry, where)
            for name, value in entry.items():
                if name != "step" and isinstance(value, torch.Tensor):
                    preflight.check_saved(value, f"{where}[{name!r}]")
            casts[-1] = _cast_into_layout(optimizer, group, live_group, p, entry, live, where)
            entries.append((group, p, entry, where))
    out.append(_Reading(groups, entries, casts, extras,
                        sd.get("lowp") is None and any("mode" in g for g in saved_groups)))
    return [cast is None for cast in casts]


def _placed_states(optimizer: LowpOptimizer, entries: list[tuple[dict[str, Any], torch.Tensor, Mapping[str, Any], str]],
                   state: defaultdict) -> None:
    """Each entry's states as private copies laid out for this run (:func:`_loaded_tensor`; the
    step count checked), brought to the group's storage (:func:`recode_loaded`) and checked
    (``check_state``), into ``state`` by parameter."""
    for group, p, entry, where in entries:
        loaded = {}
        for name, value in entry.items():
            if name == "step":
                value = preflight.step_count(value, f"{where}['step']")
            elif isinstance(value, torch.Tensor):
                value = _loaded_tensor(optimizer, group, name, p, value)
            loaded[name] = value
        if loaded:
            optimizer._recode_loaded(group, p, loaded)
            optimizer.check_state(group, p, loaded, where)
            state[p] = loaded


class LayoutCastError(ValueError):
    """A checkpoint's state arrived cast into the loading optimizer's storage layout
    (:func:`_cast_into_layout`); nothing was loaded.

    Args:
        message: the entry, the two dtypes and the saved options.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)


def _cast_into_layout(optimizer: LowpOptimizer, group: dict[str, Any], live_group: dict[str, Any],
                      p: torch.Tensor, entry: Mapping[str, Any], live: tuple[set[int], set[int]],
                      where: str) -> str | None:
    """Why a state of ``entry`` looks cast into this optimizer's storage layout (``None``: none
    does). A template-filling loader (``torch.distributed.checkpoint.load``) copies each saved
    tensor into the state dict it is given, which casts, and restores the saved group's options:
    with a template from an optimizer built with other ``state_dtype`` or ``coded_min_numel`` than
    the saving run's, int8 codes arrive as their integer values in bf16 states (their block scales
    left behind), fp32 moments rounded to bf16, or (with a planner that allows partial loads)
    bf16 moments as int8 codes beside the template's own scales; the saved options would take
    them as states. A state is taken for such a cast when it arrives in the dtype ``live_group``'s
    options give it, where the saved ``group``'s give another, and the cast loses information:
    codes into floats; a float narrower than the saved one (or the other 16-bit format) where
    the saved options name a dtype (without one, states keep their own); floats into codes when
    the codes are this optimizer's own state tensors (the template itself: a checkpoint's own
    codes, saved after their options changed, are brought to the saved storage by
    :func:`recode_loaded`). A run that changed its options and loads its own ``state_dict()``
    (the conversion) has saved and live options alike."""
    for name in optimizer.state_names(group, p):
        value = entry.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        try:
            mine = _layout_dtype(optimizer, live_group, name, p)
        except (TypeError, ValueError):   # live options changed by hand into invalid ones: the saved ones replace them
            continue
        saved = _layout_dtype(optimizer, group, name, p)
        if value.dtype != mine or mine == saved:
            continue
        if mine not in STORED_FLOATS:
            lossy = saved in STORED_FLOATS and _is_live(value, live)
        else:
            lossy = saved not in STORED_FLOATS or (asked_dtype(group, name) is not None and _narrower(mine, saved))
        if lossy:
            return (f"{where}[{name!r}]: arrived as {_short(mine)}, the dtype this optimizer's options give it, "
                    f"while the checkpoint's options ({_options_text(group)}) store it as {_short(saved)}: it "
                    f"looks cast into a template of this optimizer's layout (torch.distributed.checkpoint.load "
                    f"copies each saved tensor into the state dict it is given: codes into 16-bit states without "
                    f"their scales, fp32 moments rounded). Build the optimizer with the options the checkpoint was "
                    f"saved with, take the template from it and load, then change the options and convert with "
                    f"opt.load_state_dict(opt.state_dict()); nothing was loaded")
    return None


def _layout_dtype(optimizer: LowpOptimizer, group: dict[str, Any], name: str, p: torch.Tensor) -> torch.dtype:
    """The dtype ``group``'s options store state ``name`` of ``p`` in: its code's storage when
    coded, else the dtype of a new plain state."""
    for c in optimizer.coded_states(group, p):
        if c.name == name:
            return c.code.storage
    return new_state_dtype(group, name, p)


def _narrower(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether the float dtype ``a`` cannot hold every value of the float dtype ``b``."""
    return torch.finfo(a).bits < torch.finfo(b).bits or (a != b and torch.finfo(a).bits == torch.finfo(b).bits)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _options_text(group: Mapping[str, Any]) -> str:
    asked = group.get("state_dtype")
    shown = ({k: _short(v) for k, v in asked.items()} if isinstance(asked, Mapping)
             else _short(asked) if isinstance(asked, torch.dtype) else asked)
    return f"state_dtype={shown}, coded_min_numel={group.get('coded_min_numel')}"


def _check_entry_names(optimizer: LowpOptimizer, group: dict[str, Any], p: torch.Tensor, entry: Mapping[str, Any],
                       where: str) -> None:
    """Every entry of a saved state is one a step of this optimizer reads: ``step``, its states
    (with their block scales when coded), a write-back buffer. Another optimizer's states
    (SGD's ``momentum_buffer`` in an AdamW) would be dropped while the moments restart from
    zero at the old step count."""
    names = optimizer.state_names(group, p)
    known = {"step", *names, *BUFFER_NAMES, *(scale_name(n) for n in names)}
    for name in entry:
        if name not in known:
            raise ValueError(f"{where}[{name!r}]: {type(optimizer).__name__} keeps no state of that name (its states: "
                             f"{', '.join(names) or 'none'}, plus step and a write-back buffer); is this another "
                             f"optimizer's checkpoint?")


def value_problems(optimizer: LowpOptimizer, groups: list[dict[str, Any]],
                   state: Mapping[torch.Tensor, dict[str, Any]]) -> list[str | None]:
    """Per parameter of every group, what its loaded values hold that a step cannot use
    (``None``: nothing): a non-finite floating-point state, compensation or block scale, a
    negative value of a state the spec declares nonnegative (a negative second moment makes
    ``sqrt(v)`` NaN) or of a scale. A DTensor state is checked on this rank's shards (the ranks
    agree in :func:`checked_load`)."""
    nonnegative = set(optimizer.spec.nonnegative) if optimizer.spec is not None else set()
    problems: list[str | None] = []
    for index, (group, p) in enumerate((g, p) for g in groups for p in g["params"]):
        never_negative = nonnegative | {scale_name(n) for n in optimizer.state_names(group, p)}
        problems.append(next((f"state_dict['state'][{index}][{name!r}]: {why}"
                              for name, value in state.get(p, {}).items() if isinstance(value, torch.Tensor)
                              for why in [_value_problem(sharding.local(value), name in never_negative)] if why),
                             None))
    return problems


def _loaded_tensor(optimizer: LowpOptimizer, group: dict[str, Any], name: str, p: torch.Tensor,
                   value: torch.Tensor) -> torch.Tensor:
    """A private copy of a saved tensor on ``p``'s device; a floating-point state is cast only
    when the group's ``state_dtype`` names a dtype for it."""
    for c in optimizer.coded_states(group, p):   # codes and scales (a coded state saved as floats is encoded later)
        if name == scale_name(c.name) or (name == c.name and value.dtype not in STORED_FLOATS):
            (codes, scales), placements = coded_layout(group, p, c.code)
            return _placed(value, p, codes if name == c.name else scales, placements, name)
    wanted = asked_dtype(group, name)
    cast = (wanted is not None and code_for(wanted) is None and value.dtype in STORED_FLOATS
            and name in optimizer.state_names(group, p))
    dtype = wanted if cast else value.dtype
    if sharding.is_dtensor(p) or sharding.is_dtensor(value):   # laid out (sharded) like p
        value = sharding.load_state(value, p)
        return value.to(dtype) if cast else value
    return value.to(device=p.device, dtype=dtype, copy=True, memory_format=torch.contiguous_format)


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


def recode_loaded(optimizer: LowpOptimizer, group: dict[str, Any], p: torch.Tensor, loaded: dict[str, Any]) -> None:
    """Bring the loaded states of ``p`` to the group's storage (:func:`encode_loaded`,
    :func:`decode_loaded`): a state saved in floating point where the group keeps codes, or as
    codes where it keeps 16-bit states (``coded_min_numel`` or ``state_dtype`` changed)."""
    encode_loaded(optimizer, group, p, loaded)
    decode_loaded(optimizer, group, p, loaded)


def encode_loaded(optimizer: LowpOptimizer, group: dict[str, Any], p: torch.Tensor, loaded: dict[str, Any]) -> None:
    """Encode the floating-point states of a loaded checkpoint that the group stores as
    block-scaled codes (rounded to nearest: a load is not a step and draws no random bits).
    A sharded state is gathered and encoded whole (a collective: every rank loads)."""
    for c in optimizer.coded_states(group, p):
        value = loaded.get(c.name)
        if not isinstance(value, torch.Tensor) or value.dtype not in STORED_FLOATS \
                or scale_name(c.name) in loaded:
            continue
        if value.shape != p.shape:
            raise ValueError(f"state_dict: state {c.name!r}: expected shape {tuple(p.shape)} to encode it as "
                             f"{c.code.name}, got {tuple(value.shape)}")
        (codes_at, scales_at), placements = coded_layout(group, p, c.code)
        codes = torch.empty(codes_at, dtype=c.code.storage, device=p.device)
        block_scales = torch.empty(scales_at, dtype=group["state_scale_dtype"], device=p.device)
        encode(sharding.gather(value).float(), c.code, group["state_block"], codes.view(-1),
               block_scales.view(-1), None)
        if placements is None:   # fresh tensors of their own, as a plain parameter keeps them
            loaded[c.name], loaded[scale_name(c.name)] = codes, block_scales
        else:   # each rank keeps its box, or the whole state where it is replicated
            loaded[c.name] = sharding.place(codes, p, codes_at, placements)
            loaded[scale_name(c.name)] = sharding.place(block_scales, p, scales_at, placements)


def decode_loaded(optimizer: LowpOptimizer, group: dict[str, Any], p: torch.Tensor, loaded: dict[str, Any]) -> None:
    """Decode the block-scaled codes of a loaded checkpoint where the group keeps 16-bit states
    (``p`` is below ``coded_min_numel``, or ``state_dtype`` no longer asks for codes): ``q * s``
    (squared for unsigned codes, :func:`lowp.optim.codes.decode`) in fp32, rounded to nearest
    into the dtype a new state of ``p`` takes (a load draws no random bits). The code is
    :func:`_saved_code`'s; codes it cannot name stay, and the state checks refuse them. A sharded
    state is gathered and decoded whole (a collective: every rank loads)."""
    coded = {c.name for c in optimizer.coded_states(group, p)}
    for name in optimizer.state_names(group, p):
        codes, scales = loaded.get(name), loaded.get(scale_name(name))
        if name in coded or not isinstance(codes, torch.Tensor) or codes.dtype in STORED_FLOATS \
                or not isinstance(scales, torch.Tensor):
            continue
        full_codes, full_scales = sharding.gather(codes).reshape(-1), sharding.gather(scales).reshape(-1)
        code = _saved_code(group, name, p, full_codes, full_scales)
        if code is None:
            continue
        problem = f"a {full_scales.dtype}" if full_scales.dtype not in SCALE_DTYPES else \
            _value_problem(full_scales, never_negative=True)
        if problem is not None:   # the same full scales on every rank: all refuse alike
            raise ValueError(f"state_dict: the block scales {scale_name(name)!r} of the codes to decode: {problem}")
        values = decode(full_codes, full_scales, code, group["state_block"], p.numel()).view(p.shape)
        values = values.to(new_state_dtype(group, name, p))
        loaded[name] = sharding.load_state(values, p) if sharding.is_dtensor(p) else values.to(p.device)
        del loaded[scale_name(name)]


def _saved_code(group: dict[str, Any], name: str, p: torch.Tensor, codes: torch.Tensor,
                scales: torch.Tensor) -> Code | None:
    """The code of the saved flat ``codes`` and ``scales`` of state ``name``: the one the group's
    ``state_dtype`` asks for when their storage dtype and sizes fit it (``stored_shapes`` with
    the group's ``state_block``), else the only code they fit (int8 and fp8 storage name theirs;
    uint8 bytes may hold uint8, uint4 or int4 codes, and one byte of a one-element state any of
    them); ``None`` when that does not say which."""
    def fits(code: Code) -> bool:
        codes_at, scales_at = stored_shapes(code, p.shape, group["state_block"])
        return code.storage == codes.dtype and codes.numel() == math.prod(codes_at) \
            and scales.numel() == math.prod(scales_at)
    asked = code_for(asked_dtype(group, name))
    if asked is not None and fits(asked):
        return asked
    found = [c for c in CODES.values() if fits(c)]
    return found[0] if len(found) == 1 else None


def holds_live_states(optimizer: LowpOptimizer, sd: Any) -> bool:
    """Whether a tensor of ``sd['state']`` is, or shares memory with, one of the optimizer's
    states (a state dict from its own ``state_dict()``, which ``torch.distributed.checkpoint.load``
    fills in place)."""
    live = _live_tensors(optimizer)
    saved_state = sd.get("state") if isinstance(sd, Mapping) else None
    return isinstance(saved_state, Mapping) and any(
        _is_live(v, live) for entry in saved_state.values() if isinstance(entry, Mapping) for v in entry.values())


def _live_tensors(optimizer: LowpOptimizer) -> tuple[set[int], set[int]]:
    """The ids of the optimizer's state tensors (a DTensor's own: a rank's shard may be empty)
    and the addresses of their memory."""
    tensors = [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    return {id(v) for v in tensors}, {m for m in map(_memory, tensors) if m is not None}


def _is_live(value: Any, live: tuple[set[int], set[int]]) -> bool:
    return isinstance(value, torch.Tensor) and (id(value) in live[0] or _memory(value) in live[1])


def _memory(value: torch.Tensor) -> int | None:
    """The address of the memory of a plain (or DTensor's local) strided tensor with elements;
    ``None`` for anything else (subclasses, meta and sparse tensors have none to share)."""
    value = sharding.local(value)
    if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.is_meta or value.layout != torch.strided \
            or not value.numel():
        return None
    return value.untyped_storage().data_ptr() or None


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
