"""The few collectives of a step on DTensor parameters, each over the ranks that hold the parameter.

A rank joins a collective only with the ranks of its parameters' device meshes, never the whole
default group: under pipeline parallelism each stage's ranks hold other parameters (another
number of them, maybe another optimizer configuration), and a collective over the default group
would pair one stage's message with another's (a hang, or flags mixed between parameters).

A mesh's collective runs over each of its dimensions' process groups in turn (those of more than
one rank): a reduction over dimension 0's group, then dimension 1's, ... reduces over every rank
of the mesh (each rank has then combined the values of all ranks that share its other
coordinates, then of those that share none); an all-gather the same way gathers every rank's
rows. Parameters are taken mesh by mesh, in the order of each mesh's first parameter, so every
rank of a group makes the same collectives in the same order, as long as the ranks of a mesh
step the same parameters (what FSDP2, tensor parallelism and HSDP guarantee).
"""
from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from lowp.optim.sharding import MeshGroups, is_dtensor

__all__ = ["Groups", "Agreement", "Counts", "agreement", "agree", "agree_by", "FailTogether", "PeerFailed",
           "CountsDiffer", "sums_by_mesh", "all_messages"]

#: the process groups of a mesh's dimensions of more than one rank, in mesh order
Groups = tuple[dist.ProcessGroup, ...]
#: per mesh: its groups and the positions of its parameters in a list of parameters
Agreement = list[tuple[Groups, list[int]]]
#: per position of an agreement: a step count all ranks of its mesh must hold, or ``None``
Counts = Sequence["int | None"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def agreement(params: Sequence[torch.Tensor]) -> Agreement:
    """Which ranks must agree on a flag of each of ``params``: the positions of the DTensor
    parameters by the process groups of their meshes (in the order of each mesh's first
    parameter; a mesh of one rank needs nobody), the plain tensors' positions with every mesh.
    Without a DTensor parameter, every flag is its rank's own."""
    by_mesh: dict[Groups, list[int]] = {}
    plain: list[int] = []
    groups_of = MeshGroups()
    for i, p in enumerate(params):
        if not is_dtensor(p):
            plain.append(i)
        elif groups := groups_of(p):
            by_mesh.setdefault(groups, []).append(i)
    return [(groups, sorted(members + plain)) for groups, members in by_mesh.items()]


def agree_by(compute: Callable[[], Sequence[bool]], plan: Agreement, whole: bool = False,
             counts: Counts | None = None) -> list[bool]:
    """This rank's flags, ``compute()``, each flag of ``plan``'s positions true only when true on
    every rank of its mesh: per mesh, one all-reduce (MIN) over each group (unchanged without a
    process group).

    Each mesh's all-reduce also carries one more flag, this rank's "every flag true" so far; with
    ``whole`` (a decision that reads every flag: ``skip_step``, an aborted load), all flags come
    back false when it came back false. The meshes of one model are the mesh of its parameters
    and sub-meshes of it (FSDP2 with tensor parallelism: parameters on ``(dp, tp)`` and on
    ``mesh["dp"]``), so the largest one's all-reduce reaches every rank whose parameters share a
    rank with this one's, and all of them decide alike; pipeline stages (disjoint meshes) do not
    meet.

    When ``compute`` raises (an ``Exception``: out of memory, a bad tensor on this rank only),
    this rank still takes part in every all-reduce of ``plan``, sending -1 in place of its flags,
    then raises its error; a rank that receives a -1 passes it on to its next mesh and raises
    :class:`PeerFailed` rather than decide, so no rank waits for a rank that will not come.

    ``counts``: per position, a step count that every rank of the position's mesh must hold alike
    (``None``: none to compare), sent in the same all-reduces (its minimum and the minimum of its
    negation), every position's in each mesh's; where they differ every rank of the meshes that
    hold the parameter raises :class:`CountsDiffer` alike, before acting."""
    return FailTogether(plan).agree(compute, whole, counts)


class FailTogether:
    """Work of several ranks that ends in an agreement (:func:`agree_by` over ``plan``) and may
    make collectives of its own before it (a load that redistributes states): call
    :meth:`before_collective` right before each of them, and a rank that fails anywhere in the
    work makes every rank of ``plan`` raise at the next such point, or at the agreement.

    The failing rank sends -1 in one round of the agreement's all-reduces (per mesh, over each
    group, the message sizes of the agreement itself); :meth:`before_collective` is one such round
    with every flag true, so the failure meets the other ranks at whichever of the two they reach
    next, and no rank waits in a collective that a failed rank will not join. A rank that fails
    inside a collective (its buffer could not be allocated) still leaves the others waiting
    there: only the rounds between collectives carry failures.

    Args:
        plan: the ranks to agree with (:func:`agreement` of the parameters whose flags
            :meth:`agree` computes).
    """

    def __init__(self, plan: Agreement) -> None:
        self.plan = plan
        self._flags = 1 + max((i for _, members in plan for i in members), default=-1)
        self._told = False   # a round of this work already carried a failure

    def _active(self) -> bool:
        return bool(self.plan) and _distributed()

    def before_collective(self) -> None:
        """One round of the agreement with every flag true, right before a collective of the work
        :meth:`agree` runs; raises :class:`PeerFailed` when another rank failed in that work."""
        if not self._active():
            return
        try:
            _reduced([True] * self._flags, self.plan)
        except BaseException:
            self._told = True
            raise

    def agree(self, compute: Callable[[], Sequence[bool]], whole: bool = False,
              counts: Counts | None = None) -> list[bool]:
        """:func:`agree_by` of ``compute()`` over the plan (and of ``counts``); when ``compute``
        raises, this rank sends its failure in one round (unless a round inside ``compute``
        already carried one) and raises its error."""
        self._told = False
        try:
            flags = list(compute())
        except Exception:
            if self._active() and not self._told:
                _reduced(None, self.plan, counts)
            raise
        if not self._active():
            return flags
        agreed, every = _reduced(flags, self.plan, counts)
        return [False] * len(flags) if whole and not every else agreed


def _reduced(flags: list[bool] | None, plan: Agreement, counts: Counts | None = None
             ) -> tuple[list[bool], bool]:
    """:func:`agree_by`'s all-reduces: the agreed flags and "every flag true" (``flags=None``:
    this rank failed), with ``counts`` compared. Raises :class:`PeerFailed` when another rank
    failed, :class:`CountsDiffer` when a count differs between ranks."""
    failed = flags is None
    agreed = list(flags or [])
    every = all(agreed)
    differ: dict[int, tuple[int, int]] = {}
    # every position's count in every mesh's all-reduce (as a plain tensor's flag): a sub-mesh's
    # parameter (FSDP2 with tensor parallelism: on mesh["dp"]) is then compared over the whole mesh
    # too, so every rank of it raises alike, whichever mesh comes first
    positions = sorted({i for _, members in plan for i in members}) if counts is not None else []
    held = [counts[i] or 0 for i in positions] if counts is not None else []
    for groups, members in plan:
        n = len(members)
        sent = [-1] * (n + 1) if failed else [int(agreed[i]) for i in members] + [int(every)]
        sent += held + [-c for c in held]   # min(count) and min(-count): equal counts when min = -min(-count)
        t = torch.tensor(sent, dtype=torch.int64, device=_device(groups))
        got = _all_reduce(t, groups, dist.ReduceOp.MIN).tolist()
        values, all_true = got[:n], got[n]
        if min(values + [all_true]) < 0:
            failed = True   # passed on to the next mesh's ranks
            continue
        for i, ok in zip(members, values):
            agreed[i] = bool(ok)
        every = every and bool(all_true)
        k = len(positions)
        for i, low, high in zip(positions, got[n + 1:n + 1 + k], got[n + 1 + k:]):
            if low != -high:
                differ[i] = (low, -high)
    if failed and flags is not None:
        raise PeerFailed("another rank failed before the ranks agreed on their checks (its own error says why); "
                         "no rank acted on them")
    if differ:
        raise CountsDiffer(differ)
    return agreed, every


def agree(compute: Callable[[], Sequence[bool]], params: Sequence[torch.Tensor], whole: bool = False,
          counts: Counts | None = None) -> list[bool]:
    """:func:`agree_by` the :func:`agreement` of ``params`` (a step's non-finite flags, a load's
    checks: ``skip_param`` decides alike on every rank that holds the parameter, ``skip_step``
    and an aborted load, ``whole``, on every rank whose parameters share a rank with this one's;
    a step's ``counts``, its DTensor parameters' step counts)."""
    return agree_by(compute, agreement(params), whole, counts)


class CountsDiffer(RuntimeError):
    """The ranks that hold a parameter hold different step counts for it: a step failed part-way
    on some of them and the loop went on (lowp's error said how many parameters it had stepped),
    or a checkpoint was loaded on some ranks only. Every rank of the mesh raises it alike, before
    the step writes anything: stepping on would give the parameter's shards different bias
    corrections and random streams.

    Args:
        differ: per position among the agreed parameters, the (lowest, highest) count of its ranks.
    """

    def __init__(self, differ: dict[int, tuple[int, int]]) -> None:
        self.differ = differ
        first, (low, high) = min(differ.items())
        super().__init__(f"step counts differ between the ranks that hold {len(differ)} parameter(s) (the first, "
                         f"at position {first} of the step's parameters with a gradient: {low} on one rank, {high} "
                         f"on another): a step failed on some ranks only, or a checkpoint was loaded on some ranks "
                         f"only; nothing was stepped on any rank: load one checkpoint on every rank")


class PeerFailed(RuntimeError):
    """Another rank of a collective failed before its part: it sent a failure, not its data, and
    raised its own error; nothing was written on this rank.

    Args:
        message: what the other rank could not do, and that nothing was written.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)


def sums_by_mesh(values: dict[Groups, list[float]]) -> dict[Groups, list[float]]:
    """Each mesh's ``values`` summed over its ranks in float64: per mesh (in the dict's order,
    which every rank of a mesh must share), one all-reduce over each group."""
    out = dict(values)
    if not _distributed():
        return out
    for groups, vals in values.items():
        t = torch.tensor(vals, dtype=torch.float64, device=_device(groups))
        out[groups] = _all_reduce(t, groups, dist.ReduceOp.SUM).tolist()
    return out


def all_messages(message: torch.Tensor | None, groups: Groups) -> torch.Tensor | None:
    """The float64 messages (one dimension, lengths may differ between ranks) of every rank of
    ``groups`` (a mesh's, :class:`~lowp.optim.sharding.MeshGroups`), end to end (each group's
    ranks in order, group after group): over each group in turn, one all-gather of each rank's
    length and message padded to the length :data:`_EXPECTED` keeps for the group, which every
    rank of it knows alike (each saw every length of its last exchange), and a second all-gather
    of the messages padded to the longest only where one is longer (a group's first exchange, a
    new layout). A sharded step sends messages of the same lengths every step, so one all-gather
    each where the lengths and then the messages took two (``message`` itself without a process
    group).

    ``message=None`` says this rank failed: it sends a length of -1, and every rank of the groups
    returns ``None`` (a rank that learns of a failure passes it on to the next group) without
    waiting for messages that will not come."""
    if not groups or not _distributed():
        return message
    device = _device(groups)
    failed = message is None
    for group in groups:
        ranks = dist.get_world_size(group)
        expected = _EXPECTED.get(group, 0)
        first = torch.zeros(expected + 1, dtype=torch.float64, device=device)
        first[0] = -1 if message is None else message.numel()
        if message is not None:
            first[1:1 + min(message.numel(), expected)] = message[:expected]
        everyone = [torch.empty_like(first) for _ in range(ranks)]
        dist.all_gather(everyone, first, group=group)
        lengths = [int(n) for n in torch.stack([t[0] for t in everyone]).tolist()]   # one copy to the host
        if min(lengths) < 0:
            message, failed = None, True
            continue
        assert message is not None
        longest = max(lengths)
        _EXPECTED[group] = longest if longest > expected or 4 * longest < expected else expected
        if longest > expected:
            mine = torch.zeros(longest, dtype=torch.float64, device=device)
            mine[:message.numel()] = message
            everyone = [torch.empty_like(mine) for _ in range(ranks)]
            dist.all_gather(everyone, mine, group=group)
        else:
            everyone = [t[1:] for t in everyone]
        message = torch.cat([t[:n] for t, n in zip(everyone, lengths)])
    return None if failed or message is None else message.cpu()


#: per process group: the length :func:`all_messages` pads a message to in its first all-gather
#: over it: the longest of an earlier exchange (each rank of the group saw every length of each,
#: so all of them hold the same number), kept until a longer one, or one shorter than a quarter
_EXPECTED: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()


def _all_reduce(t: torch.Tensor, groups: Groups, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    """``t`` reduced with ``op`` over every rank of a mesh: over each of its groups in turn."""
    for group in groups:
        dist.all_reduce(t, op=op, group=group)
    return t


def _device(groups: Groups) -> torch.device:
    """The device ``groups``' backend communicates from (CUDA for NCCL, else the CPU)."""
    if dist.get_backend(groups[0]) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
