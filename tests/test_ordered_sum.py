"""StableAdamW's per-tensor sum (lowp/optim/ordered_sum.py): the order written down once in
Python, against math.fsum and hand-built cases where the order decides the result, and the
reference (eager, foreach) bit for bit against the native kernel, whose lowp_sums adds the terms
in that order, with the RMS clip acting."""
from __future__ import annotations

import dataclasses
import math
import platform
import shutil
from functools import reduce

import numpy as np
import pytest
import torch

import lowp.optim as lo
from lowp.optim import ordered_sum as order
from lowp.optim import stableadamw
from lowp.optim.ordered_sum import BLOCK, UNIT, ordered_sum
from fused_helpers import assert_fused, assert_same_run

NATIVE = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
                            reason="the native kernel needs x86-64 and g++")
#: awkward sizes: one element, a block short by one, a block, a tail of 1, 300 (a tail of 12), 384
#: (whole blocks), 1000 (a tail of 8), a 2-D tensor (a tail of 7), three past a work unit
SIZES = [(1,), (15,), (16,), (17,), (300,), (384,), (1000,), (37, 11), (UNIT + 3,)]


def _sequential(values: list[float]) -> float:
    return reduce(lambda a, b: a + b, values, 0.0)


def _by_definition(terms: torch.Tensor) -> float:
    """The order of the module docstring, one Python float at a time (slow: small inputs)."""
    t = terms.reshape(-1).tolist()
    t += [0.0] * (-len(t) % BLOCK)
    lanes = [float(np.float32(t[i]) + np.float32(t[i + 1])) for i in range(0, len(t), 2)]
    blocks = [_sequential(lanes[i:i + BLOCK // 2]) for i in range(0, len(lanes), BLOCK // 2)]
    per_unit = UNIT // BLOCK
    return _sequential([_sequential(blocks[i:i + per_unit]) for i in range(0, len(blocks), per_unit)])


def test_cpu_cumsum_is_a_sequential_float64_scan():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(3, 4099, generator=gen, dtype=torch.float64) * torch.randn(3, 4099, generator=gen,
                                                                             dtype=torch.float64).mul(30).exp()
    assert float(x[0].sum()) != _sequential(x[0].tolist())  # the data tell orders apart
    for row, total in zip(x, x.cumsum(1)[:, -1].tolist()):
        assert total == _sequential(row.tolist())
    assert float(x[1].cumsum(0)[-1]) == _sequential(x[1].tolist())


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 2 * UNIT + 100])
def test_close_to_fsum_and_equal_to_the_definition(n):
    gen = torch.Generator().manual_seed(n)
    terms = torch.randn(n, generator=gen).exp()
    exact = math.fsum(terms.double().tolist())
    got = ordered_sum(terms)
    assert abs(got - exact) <= 2 ** -23 * exact  # the fp32 lane additions: half an ulp each at most
    assert got == _by_definition(terms)
    signed = torch.randn(n, generator=gen)
    assert abs(ordered_sum(signed) - math.fsum(signed.double().tolist())) <= 2 ** -23 * float(signed.abs().sum())


def test_pairs_add_in_fp32_and_change_the_rounded_mean():
    """Even elements 1.0 and odd ones 0.75 * 2**-24 in 15 lanes: each lane rounds to 1.0 in fp32,
    so the sum is 15.0, where the exact one (15 + 11.25 * 2**-24) rounds up in fp32."""
    t = torch.zeros(32)
    t[0:30:2] = 1.0
    t[1:30:2] = 0.75 * 2 ** -24
    exact = math.fsum(t.double().tolist())
    assert ordered_sum(t) == 15.0 == _by_definition(t)
    assert np.float32(15.0 / 32) != np.float32(exact / 32)
    assert ordered_sum(t.view(2, 16).t().contiguous()) != 15.0  # another element order, another sum


def test_units_add_their_blocks_separately():
    """One 1.0, then 2**-54 at the head of every block: inside the first unit the small ones are
    lost against the 1.0 (half an ulp of 1.0 is 2**-53), the second unit's add up exactly first."""
    t = torch.zeros(2 * UNIT)
    t[::BLOCK] = 2.0 ** -54
    t[0] = 1.0
    assert ordered_sum(t) == 1.0 + 2 ** -43
    assert _sequential(t.double().tolist()) == 1.0  # one sequential float64 sum: all lost


def test_empty_shaped_and_wrong_dtype():
    assert ordered_sum(torch.zeros(0)) == 0.0
    t = torch.rand(5, 7)
    assert ordered_sum(t) == ordered_sum(t.reshape(-1)) == ordered_sum(t.t().contiguous().t())
    with pytest.raises(TypeError, match="terms: expected a float32 tensor, got torch.float64"):
        ordered_sum(torch.zeros(3, dtype=torch.float64))


# ---- StableAdamW: every backend the same ----------------------------------------------------------
SCALES = [0.01, 1.0, 0.5]  # a 100x jump at step 2: RMS(g**2 / v_hat) > 1 in every tensor there


def _run(backend: str, dtype: torch.dtype, mode: str | None, sizes=SIZES, scales=SCALES, spread=2.0, **kw):
    """StableAdamW over tensors of ``sizes``, a step per gradient scale, gradients of magnitudes
    ``exp(spread * N(0, 1))`` (the terms ``g**2 / v_hat`` then span many binades)."""
    gen = torch.Generator().manual_seed(3)
    params = [(torch.randn(s, generator=gen) * 0.1).to(dtype) for s in sizes]
    opt = lo.StableAdamW(params, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, backend=backend, seed=5,
                         **({"mode": mode} if mode else {}), **kw)
    for scale in scales:
        for p in params:
            magnitude = torch.randn(p.shape, generator=gen).mul(spread).exp()
            p.grad = (torch.randn(p.shape, generator=gen) * magnitude * scale).to(dtype)
        opt.step()
    return params, opt


CODED = dict(state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}, coded_min_numel=0)
# (every write-back mode x StableAdamW on the native kernel: tests/test_registry.py)
CASES = {"bf16": (torch.bfloat16, "kahan", {}), "fp32": (torch.float32, None, dict(state_dtype=torch.float32)),
         "bf16-coded": (torch.bfloat16, "stochastic", CODED)}


@NATIVE
@pytest.mark.parametrize("dtype,mode,kw", CASES.values(), ids=CASES.keys())
def test_stableadamw_bit_identical_on_every_backend(monkeypatch, dtype, mode, kw):
    clipped = []

    def spy(numbers, total, numel):
        made = stable_tensor_numbers(numbers, total, numel)
        clipped.append(made["step_size"] > -numbers["lr"] / numbers["bias_correction1"])
        return made

    stable_tensor_numbers = stableadamw.stable_tensor_numbers
    monkeypatch.setattr(stableadamw, "stable_tensor_numbers", spy)  # the reference's calls
    eager = _run("eager", dtype, mode, **kw)
    assert any(clipped) and not all(clipped)  # lr_t < lr for some tensors at some steps
    native = _run("native", dtype, mode, **kw)
    assert_fused(native[1], len(SCALES) * sum(p.numel() for p in native[0]))  # pre-pass and all
    assert_same_run(eager, native)
    assert_same_run(eager, _run("foreach", dtype, mode, **kw))


def _isas() -> list[str]:
    from lowp.optim.kernels.native import build
    return [name for name, (_, needed) in build.ISAS.items() if all(f in build._cpu_features() for f in needed)]


@NATIVE
@pytest.mark.parametrize("isa", _isas())
def test_native_sums_are_the_python_ones(isa, monkeypatch):
    """The kernel's per-tensor totals equal :func:`ordered_sum` of the reference's terms in every
    bit, for tensors of several work units, in every instruction set's build (the 512-bit one
    adds a 32-element block as two 16-element ones); with another unit size they would not."""
    monkeypatch.setenv("LOWP_NATIVE_ISA", isa)
    sizes = [(3 * UNIT + 5,), (2 * UNIT,), (UNIT + 17,)]
    native_totals, terms = [], []

    def record_total(numbers, total, numel):
        native_totals.append(total)
        return stableadamw.stable_tensor_numbers(numbers, total, numel)

    def record_terms(t):
        terms.append(t.clone())
        return ordered_sum(t)

    monkeypatch.setattr(lo.StableAdamW, "spec", dataclasses.replace(stableadamw.STABLEADAMW,
                                                                    tensor_numbers=record_total))
    monkeypatch.setattr(stableadamw, "ordered_sum", record_terms)
    scales = [1.0, 1.0, 1.0]
    _run("native", torch.bfloat16, "kahan", sizes, scales, spread=4.0, state_dtype=torch.float32)
    _run("eager", torch.bfloat16, "kahan", sizes, scales, spread=4.0, state_dtype=torch.float32)
    assert len(native_totals) == len(terms) == len(scales) * len(sizes)
    assert native_totals == [ordered_sum(t) for t in terms]
    for unit in (UNIT // 2, UNIT * 2):
        monkeypatch.setattr(order, "UNIT", unit)
        assert native_totals != [ordered_sum(t) for t in terms]


@pytest.mark.gpu
def test_the_same_sum_on_cuda():
    gen = torch.Generator().manual_seed(1)
    terms = torch.randn(2 * UNIT + 77, generator=gen).mul(4).exp()
    assert ordered_sum(terms.cuda()) == ordered_sum(terms)


@pytest.mark.gpu
def test_the_same_pieces_from_cuda_terms():
    """``Pieces`` of ranges whose terms are on the GPU (the CUDA reference route): the block sums
    made there, one copy to the host, the runs of the same terms on the CPU bit for bit."""
    gen = torch.Generator().manual_seed(2)
    n, cuts = 2 * UNIT + 77, [5, UNIT + 16]
    terms = torch.randn(n, generator=gen).mul(4).exp()
    ranges = list(zip([0, *cuts], [*cuts, n]))
    made = {}
    for device in ("cpu", "cuda"):
        made[device] = order.Pieces([a for a, _ in ranges], [b - a for a, b in ranges], [n] * len(ranges))
        for a, b in ranges:
            made[device].add(terms[a:b].to(device))
    for got, want in zip(made["cuda"].runs(), made["cpu"].runs()):
        assert got.values.device.type == "cpu" and torch.equal(got.head, want.head)
        assert torch.equal(got.values, want.values)


def _together(pieces: list[tuple[int, order.Runs]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``totals_from_pieces``' arguments from runs of tensors ``t``: the heads with ``t`` first."""
    head = torch.cat([torch.cat([torch.full((r.head.shape[0], 1), t), r.head], 1) for t, r in pieces])
    return head, torch.cat([r.values for _, r in pieces])


#: (elements, cut points): ranges of FSDP-like shards and worse: inside a block, on block and
#: unit edges, several ranges inside one block, a range of one element, empty ranges, the padded
#: last block split, and a range holding whole units between two partial ones
CUTS = [(17, [9]), (33, [1, 2, 3, 20]), (UNIT + 3, [UNIT + 1]), (2 * UNIT + 7, [5, UNIT, UNIT + 16]),
        (3 * UNIT, [UNIT // 2 + 9, UNIT // 2 + 9, 2 * UNIT + 5]), (5 * UNIT + 300, [7, 4 * UNIT + 311]),
        (70001, [23333, 46666]), (1000, [0, 1000])]


@pytest.mark.parametrize("n,cuts", CUTS)
def test_pieces_of_ranges_give_the_whole_sum_bit_for_bit(n, cuts):
    """The pieces of contiguous ranges covering a tensor (a replica's runs repeated) rebuild its
    ordered sum exactly in float64; the same pieces added in another order (their plain sum) do
    not, so the data tell the orders apart."""
    gen = torch.Generator().manual_seed(n)
    terms = torch.rand(n, generator=gen) * torch.exp2(torch.randint(-40, 40, (n,), generator=gen).float())
    edges = [0, *cuts, n]
    runs = [order.pieces(terms[a:b], a, n) for a, b in zip(edges, edges[1:])]
    assert all(r.values.dtype == torch.float64 and r.head.dtype == torch.int64 and r.head.shape[0] <= 5 for r in runs)
    want = ordered_sum(terms)
    assert order.total_from_pieces(runs + runs[:1], n) == want
    assert order.total_from_pieces(runs[::-1], n) == want   # the runs in any order
    if n > 1000:
        assert float(torch.cat([r.values for r in runs]).sum()) != want
        kinds = torch.cat([r.head[:, 0] for r in runs])
        assert (kinds == order.UNIT_SUM).any() and (kinds == order.TERM).any()


def test_the_layouts_of_many_ranges_are_each_ones_layout():
    """``layouts`` of every range of :data:`CUTS` (empty ones too) at once: each range's runs, in
    order, are its ``layout``, at most five of them, which cover exactly its elements (each
    element in one piece: a term, a whole block or a whole unit) in element order, each run's
    pieces consecutive ones of its kind."""
    ranges = [(a, b - a, n) for n, cuts in CUTS for a, b in zip([0, *cuts], [*cuts, n])]
    kind, index, count, start, length, runs = order.layouts(*zip(*ranges))
    assert runs.tolist() == [order.layout(*r)[0].numel() for r in ranges] and runs.max() <= 5
    at = 0
    for (first, n, numel), r in zip(ranges, runs.tolist()):
        alone = order.layout(first, n, numel)
        together = (kind[at:at + r], index[at:at + r], count[at:at + r], start[at:at + r], length[at:at + r])
        assert all(torch.equal(a, b) for a, b in zip(alone, together)), (first, n, numel)
        covered = torch.cat([torch.arange(s, s + k) for s, k in zip(together[3].tolist(), together[4].tolist())]
                            + [torch.arange(0)])
        assert torch.equal(covered, torch.arange(n)), (first, n, numel)
        size = torch.tensor(order.PIECE_SIZE)[together[0]]
        assert torch.equal(together[3] + first, together[1] * size), (first, n, numel)   # each run's first piece
        assert torch.equal(-(-together[4] // size), together[2]) and bool((together[2] > 0).all())
        at += r
    assert at == kind.numel()
    with pytest.raises(ValueError, match="first: elements \\[5, 12\\) are not inside a tensor of 10 elements"):
        order.layouts([0, 5], [3, 7], [10, 10])
    with pytest.raises(ValueError, match="firsts, ns, numels: expected one entry per range in each, got 2, 1 and 2"):
        order.layouts([0, 5], [3], [10, 10])


def test_only_runs_given_twice_are_compared_piece_by_piece(monkeypatch):
    """The runs of ranges covering tensors whose last block and unit are padded (sizes no multiple
    of 16 or of a unit, one after the other) overlap nowhere, so the rebuild compares no pieces
    one by one (a sort of every piece); a replica's runs given twice are compared."""
    numels = [2 * UNIT + 16 * 7 + 3, 100, 100, UNIT + 1]
    gen = torch.Generator().manual_seed(11)
    pieces = []
    for t, n in enumerate(numels):
        terms = torch.rand(n, generator=gen)
        pieces += [(t, order.pieces(terms[:n // 2], 0, n)), (t, order.pieces(terms[n // 2:], n // 2, n))]
    compared = []
    monkeypatch.setattr(order, "_repeats", lambda *a, real=order._repeats: compared.append(1) or real(*a))
    alone = order.totals_from_pieces(*_together(pieces), numels)
    assert compared == []
    assert torch.equal(order.totals_from_pieces(*_together(pieces + pieces[1:2]), numels), alone)
    assert compared == [1]


def test_the_same_runs_again_rebuild_from_kept_indices(monkeypatch):
    """A sharded step sends the same runs every step with other values: the second call with the
    same head and sizes makes no new :class:`~lowp.optim.ordered_sum.Rebuild` (its checks and
    indices are kept), and gives each tensor's ordered sum of the new terms bit for bit, as a
    rebuild made afresh does; a value it must refuse (a repeat that disagrees, a term that is no
    fp32 value) is still refused, and only the last few heads are kept."""
    numels = [2 * UNIT + 16 * 7 + 3, 100, UNIT + 1]
    gen = torch.Generator().manual_seed(12)
    made = []
    real = order.Rebuild.__init__
    monkeypatch.setattr(order.Rebuild, "__init__", lambda self, *a: made.append(1) or real(self, *a))
    monkeypatch.setattr(order, "_REBUILDS", type(order._REBUILDS)())

    def runs(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], list[float]]:
        pieces, want = [], []
        for t, n in enumerate(numels):
            terms = torch.rand(n, generator=gen) * 10.0 ** step
            cut = n // 3 + 5
            pieces += [(t, order.pieces(terms[:cut], 0, n)), (t, order.pieces(terms[cut:], cut, n))]
            pieces += pieces[-1:]   # a replica's runs
            want.append(ordered_sum(terms))
        return _together(pieces), want
    (head, values), want = runs(0)
    assert order.totals_from_pieces(head, values, numels).tolist() == want
    (head2, values2), want2 = runs(1)
    assert torch.equal(head2, head) and len(made) == 1
    assert order.totals_from_pieces(head2, values2, numels).tolist() == want2
    assert len(made) == 1   # the kept rebuild
    assert torch.equal(order.Rebuild(head2, tuple(numels)).totals(values2),
                       order.totals_from_pieces(head2, values2, numels))
    bad = values2.clone()
    bad[-1] += 1.0   # the replica's last piece no longer its original's
    with pytest.raises(ValueError, match="disagree"):
        order.totals_from_pieces(head2, bad, numels)
    bad = values2.clone()
    term_run = int((head2[:, 1] == order.TERM).nonzero()[0])   # tensor 0's terms after its first range's blocks
    bad[int(head2[:term_run, 3].sum())] = 0.1
    with pytest.raises(ValueError, match="a term of 0.1, which is no fp32 value"):
        order.totals_from_pieces(head2, bad, numels)
    assert len(made) == 2   # the kept one and the fresh one above
    made.clear()
    for k in range(1, order._KEPT_REBUILDS + 1):   # other sizes: other keys; the first one is dropped
        order.totals_from_pieces(head, values, [*numels[:-1], numels[-1] + k])
    order.totals_from_pieces(head, values, numels)
    assert len(made) == order._KEPT_REBUILDS + 1 and len(order._REBUILDS) == order._KEPT_REBUILDS


def test_the_sums_of_many_tensors_at_once_are_each_ones_own():
    """``totals_from_pieces`` over the runs of all tensors of :data:`CUTS` (each cut into its
    ranges, a replica's runs repeated, all runs shuffled together) gives each tensor's ordered
    sum bit for bit, as it does alone; a missing piece or a row outside its tensor names the
    tensor."""
    gen = torch.Generator().manual_seed(5)
    pieces, want = [], []
    for t, (n, cuts) in enumerate(CUTS):
        terms = torch.rand(n, generator=gen) * torch.exp2(torch.randint(-40, 40, (n,), generator=gen).float())
        edges = [0, *cuts, n]
        mine = [order.pieces(terms[a:b], a, n) for a, b in zip(edges, edges[1:])]
        pieces += [(t, r) for r in mine + mine[:1]]
        want.append(ordered_sum(terms))
        assert order.total_from_pieces(mine + mine[:1], n) == want[-1]
    pieces = [pieces[i] for i in torch.randperm(len(pieces), generator=gen).tolist()]
    numels = [n for n, _ in CUTS]
    assert order.totals_from_pieces(*_together(pieces), numels).tolist() == want
    last = len(CUTS) - 1
    missing = f"pieces: element 0 of a tensor of 1000 elements is in no piece \\(tensor {last}\\)"
    with pytest.raises(ValueError, match=missing):
        order.totals_from_pieces(*_together([(t, r) for t, r in pieces if t != last]), numels)
    outside = (0, order.Runs(torch.tensor([[order.TERM, 17, 1]]), torch.ones(1, dtype=torch.float64)))
    with pytest.raises(ValueError, match="kind 0 of 1 pieces from index 17 is outside a tensor of 17 elements "
                                         "\\(tensor 0\\)"):
        order.totals_from_pieces(*_together(pieces + [outside]), numels)
    with pytest.raises(ValueError, match=f"a run of tensor {len(CUTS)}, expected one of {len(CUTS)}"):
        order.totals_from_pieces(*_together([(len(CUTS), outside[1])]), numels)


def test_the_pieces_of_many_ranges_are_each_pieces_own_sums(monkeypatch):
    """``Pieces`` over every range of :data:`CUTS` (empty ones too), the ranges of all tensors
    shuffled together and each range's terms given in turn: each row is the ordered sum of the
    elements it covers (a term itself, a block's or a unit's sum: :func:`ordered_sum` of those
    elements alone), in the range's layout, and the runs of all ranges give each tensor's sum; all
    of it reaches the host in one copy. Terms of the wrong count, dtype or number are refused by
    name."""
    gen = torch.Generator().manual_seed(7)
    tensors = [torch.rand(n, generator=gen) * torch.exp2(torch.randint(-40, 40, (n,), generator=gen).float())
               for n, _ in CUTS]
    ranges = [(t, a, b - a) for t, (n, cuts) in enumerate(CUTS) for a, b in zip([0, *cuts], [*cuts, n])]
    ranges = [ranges[i] for i in torch.randperm(len(ranges), generator=gen).tolist()]
    copies = []
    monkeypatch.setattr(order, "_to_host", lambda parts, real=order._to_host: copies.append(len(parts)) or real(parts))
    made = order.Pieces([a for _, a, _ in ranges], [n for _, _, n in ranges], [CUTS[t][0] for t, _, _ in ranges])
    for t, a, n in ranges:
        made.add(tensors[t][a:a + n])
    runs = made.runs()
    assert copies == [2 * len(ranges)]
    for (t, a, n), got in zip(ranges, runs):
        kind, index, count, start, length = order.layout(a, n, CUTS[t][0])
        assert torch.equal(got.head, torch.stack([kind, index, count], 1)), (t, a, n)
        local = tensors[t][a:a + n]
        want = [float(local[e]) if k == order.TERM else ordered_sum(local[e:min(e + size, s + m)])
                for k, s, m in zip(kind.tolist(), start.tolist(), length.tolist())
                for size in [order.PIECE_SIZE[k]] for e in range(s, s + m, size)]
        assert got.values.tolist() == want, (t, a, n)
    together = _together([(t, r) for (t, _, _), r in zip(ranges, runs)])
    assert order.totals_from_pieces(*together, [n for n, _ in CUTS]).tolist() == list(map(ordered_sum, tensors))
    made = order.Pieces([0, 5], [5, 4], [9, 9])
    with pytest.raises(ValueError, match="terms: 0 of 2 ranges have their terms"):
        made.runs()
    with pytest.raises(ValueError, match="terms: range 0 holds 5 elements, got 4 terms"):
        made.add(torch.ones(4))
    with pytest.raises(TypeError, match="terms: expected a float32 tensor, got torch.bfloat16"):
        made.add(torch.ones(5, dtype=torch.bfloat16))
    made.add(torch.ones(5))
    made.add(torch.ones(4))
    with pytest.raises(ValueError, match="terms: every one of the 2 ranges has its terms already"):
        made.add(torch.ones(4))
    assert order.total_from_pieces(made.runs(), 9) == 9.0


def test_pieces_refuse_what_they_cannot_place():
    terms = torch.ones(20)
    with pytest.raises(ValueError, match="first: elements \\[10, 30\\) are not inside a tensor of 25"):
        order.pieces(terms, 10, 25)
    with pytest.raises(TypeError, match="terms: expected a float32 tensor, got torch.float64"):
        order.pieces(terms.double(), 0, 20)
    with pytest.raises(ValueError, match="pieces: element 3 of a tensor of 40 elements is in no piece"):
        order.total_from_pieces([order.pieces(terms[:3], 0, 40)], 40)


def _one_run(kind: int, first: int, *values: float, count: int | None = None) -> order.Runs:
    return order.Runs(torch.tensor([[kind, first, len(values) if count is None else count]]),
                      torch.tensor(values, dtype=torch.float64))


@pytest.mark.parametrize("extra,error", [
    (_one_run(order.TERM, 20, 1e6), "a run of kind 0 of 1 pieces from index 20 is outside a tensor of 18 elements"),
    (_one_run(order.BLOCK_SUM, 5, 1e6), "a run of kind 1 of 1 pieces from index 5 is outside"),   # inside the last unit
    (_one_run(order.UNIT_SUM, 1, 1e6), "a run of kind 2 of 1 pieces from index 1 is outside"),
    (_one_run(order.TERM, -1, 1.0), "a run of kind 0 of 1 pieces from index -1 is outside"),
    (_one_run(order.TERM, 0, count=-1), "a run of kind 0 of -1 pieces from index 0 is outside"),
    (_one_run(order.TERM, 0, 1.0, 1.0, 1.0, count=2 ** 62), "a run of kind 0 of 4611686018427387904 pieces"),
    (_one_run(3, 0, 1e6), "a run of kind 3, expected 0 \\(term\\), 1 \\(block sum\\) or 2 \\(unit sum\\)"),
    (_one_run(order.TERM, 0, 1.0, count=2), "the runs hold 5 pieces, got 4 values"),
    (_one_run(order.BLOCK_SUM, 0, 100.0), "pieces of kind 1 and index 0 disagree"),   # block 0's sum is 16
    (_one_run(order.TERM, 16, 1.0, 2.0), "pieces of kind 0 and index 17 disagree"),
])
def test_runs_that_are_not_pieces_of_the_tensor_are_refused(extra, error):
    """A run outside the tensor (in the last block's or unit's padding too), of an unknown kind,
    of more pieces than values, or repeating a piece with another value is refused wherever it
    sits among the runs, rather than added (or winning by its place); a replica's runs repeated
    exactly are accepted."""
    terms = torch.ones(18)
    runs = [order.pieces(terms[:17], 0, 18), order.pieces(terms[17:], 17, 18)]
    assert order.total_from_pieces(runs + runs, 18) == order.ordered_sum(terms) == 18.0
    for together in (runs + [extra], [extra] + runs):
        with pytest.raises(ValueError, match=f"pieces: {error}"):
            order.total_from_pieces(together, 18)
    with pytest.raises(ValueError, match="pieces: a term of 0.1, which is no fp32 value"):
        order.total_from_pieces([_one_run(order.TERM, 0, math.nan, 0.1)], 2)
    with pytest.raises(ValueError, match="expected runs whose head is an int64 tensor of shape \\[runs, 3\\], got "
                                         "torch.int64 of shape \\(1, 4\\)"):
        order.total_from_pieces([order.Runs(torch.zeros((1, 4), dtype=torch.int64), torch.ones(1).double())], 18)
    with pytest.raises(ValueError, match="head: expected an int64 tensor of shape \\[runs, 4\\], got torch.float64"):
        order.totals_from_pieces(runs[0].head.double(), runs[0].values, [18])
    with pytest.raises(ValueError, match="values: expected a float64 tensor of one dimension, got torch.float32"):
        order.totals_from_pieces(torch.zeros((0, 4), dtype=torch.int64), torch.zeros(0), [18])


def test_the_rebuilt_sum_needs_no_memory_per_element_of_the_tensor():
    """The rebuilt sum of a tensor of 2**28 elements whose first block is split places the
    block's terms without a table over all the tensor's blocks: no operation of it allocates
    anywhere near one int64 per block (128 MiB)."""
    from torch.profiler import ProfilerActivity, profile
    numel = 1 << 28
    runs = [order.pieces(torch.full((7,), 0.5), 0, numel), order.pieces(torch.full((UNIT - 7,), 0.5), 7, numel),
            order.pieces(torch.full((numel - UNIT,), 0.5), UNIT, numel)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        total = order.total_from_pieces(runs, numel)
    assert total == numel * 0.5
    largest = max(e.cpu_memory_usage for e in prof.key_averages())
    assert 0 < largest < 1 << 24, largest


#: (weight dtype, mode, state dtype, maximize) of the shards whose pieces the native kernel makes
SHARD_KINDS = [(torch.bfloat16, "kahan", torch.bfloat16, False), (torch.bfloat16, "exact", torch.float32, True),
               (torch.float32, "nearest", torch.float32, False), (torch.float16, "kahan", torch.float16, False)]


@NATIVE
@pytest.mark.parametrize("kind", SHARD_KINDS, ids=lambda k: f"{k[0]}-{k[1]}-{k[2]}-max{k[3]}")
def test_the_native_kernel_makes_the_pieces_torch_makes(kind, monkeypatch):
    """The native kernel's pieces of shards' StableAdamW terms (its lowp_piece_sums over each
    shard's runs of units, blocks and terms) are the runs ``pieces`` makes from the reference's terms, bit for bit,
    for shards cut inside blocks, on unit edges and at the tensor's padded end, under a
    GradScaler's 1/scale; the exchange takes them from the kernel (the torch terms not computed),
    all shards of one dtype signature in one native call."""
    from lowp.optim import sharded_sums
    from lowp.optim.kernels.native import kernel as native_kernel
    from lowp.optim.randomness import ElementIndex
    from lowp.optim.slices import ParamSlice, StepContext, TensorSum
    from lowp.optim.writeback import MODES

    dtype, mode, state_dtype, maximize = kind
    numel = 3 * UNIT + 1000
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(numel, generator=gen).to(dtype)
    grad = (torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-8, 8, (numel,), generator=gen))).to(dtype)
    second = torch.rand(numel, generator=gen).to(state_dtype)
    native = lo.StableAdamW([torch.nn.Parameter(weight.clone())], mode=mode, fused=True, maximize=maximize)
    reference = lo.StableAdamW([torch.nn.Parameter(weight.clone())], mode=mode, fused=False, maximize=maximize)
    buffer_dtype = {"kahan": dtype, "exact": torch.int16, "nearest": None}[mode]
    shards = []
    for first, end in [(0, 9), (9, UNIT + 5), (UNIT + 5, 2 * UNIT), (2 * UNIT, numel), (37, 3 * UNIT + 17)]:
        shard = slice(first, end)
        plain = buffer_dtype is None or dtype == torch.float32
        buffer = None if plain else torch.zeros(end - first, dtype=buffer_dtype)
        shards.append(ParamSlice(weight[shard], grad[shard], {"exp_avg": torch.zeros(end - first, dtype=state_dtype),
                                                              "exp_avg_sq": second[shard]},
                                 buffer, 0, ElementIndex(offset=first), tensor_sum=TensorSum(numel)))
    ctx = StepContext(reference.param_groups[0], MODES[mode], 3, inv_scale=0.25)
    want = [runs for s in shards for [runs] in [sharded_sums._pieces(reference, ctx, [s])]]
    calls = []
    real = native_kernel.piece_sums_function

    def counted(source):
        calls.append(source)
        return real(source)
    monkeypatch.setattr(native_kernel, "piece_sums_function", counted)
    monkeypatch.setattr(lo.StableAdamW, "tensor_terms", lambda *a: pytest.fail("torch terms computed"))
    ctx = StepContext(native.param_groups[0], MODES[mode], 3, inv_scale=0.25)
    got = sharded_sums._pieces(native, ctx, shards)
    assert len(calls) == 1, len(calls)
    assert len(got) == len(shards)
    for s, runs, runs_want in zip(shards, got, want):
        assert torch.equal(runs.head, runs_want.head), s.index
        assert torch.equal(runs.values.view(torch.int64), runs_want.values.view(torch.int64)), s.index
        assert runs.values.numel() > 0 and runs.values.abs().sum() > 0


def test_every_sum_is_exchanged_but_small_ones_of_the_cuda_reference(monkeypatch):
    """``sharded_sums.min_numel``: every parameter's sum is exchanged (0) on the native kernel and
    on the reference on the CPU (their pieces are made for all shards together); with parameters
    on a CUDA device, where no kernel makes the pieces (the Triton kernel has no per-tensor pass),
    those under ``CUDA_REFERENCE_MIN_NUMEL`` are gathered, whatever the backend asked for; an
    optimizer that exchanges no sums has none."""
    from types import SimpleNamespace

    from lowp.optim import sharded_sums
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    native, reference = lo.StableAdamW(params, fused=True), lo.StableAdamW(params, fused=False)
    assert sharded_sums.min_numel(native) == sharded_sums.min_numel(reference) == sharded_sums.MIN_NUMEL == 0
    on_cuda = [{"params": [SimpleNamespace(is_cuda=False), SimpleNamespace(is_cuda=True)]}]
    for opt in (native, reference):
        monkeypatch.setattr(opt, "param_groups", on_cuda)
        assert sharded_sums.min_numel(opt) == sharded_sums.CUDA_REFERENCE_MIN_NUMEL == 1 << 16
    assert sharded_sums.min_numel(lo.AdamW(params)) is None


def test_a_states_only_step_of_a_shard_needs_no_exchanged_sum():
    """A states-only step (gradient release's micro-batch steps) discards the update, the only
    reader of a shard's whole-tensor sum: it runs with the sum not exchanged and gives the states
    of the same step on a slice without one; a whole step refuses a sum not exchanged."""
    from lowp.optim.reference import apply_batch
    from lowp.optim.slices import ParamSlice, StepContext, TensorSum
    from lowp.optim.writeback import MODES

    gen = torch.Generator().manual_seed(3)
    weight, grad = torch.randn(100, generator=gen).bfloat16(), torch.randn(100, generator=gen).bfloat16()
    opt = lo.StableAdamW([torch.nn.Parameter(weight.clone())], fused=False)
    states = {}
    for whole in (TensorSum(300), None):
        s = ParamSlice(weight.clone(), grad, {"exp_avg": torch.zeros(100, dtype=torch.bfloat16),
                                              "exp_avg_sq": torch.zeros(100, dtype=torch.bfloat16)},
                       torch.zeros(100, dtype=torch.bfloat16), tensor_sum=whole)
        apply_batch(opt, StepContext(opt.param_groups[0], MODES["kahan"], 1, count=False, update_weights=False), [s])
        assert torch.equal(s.param, weight)
        states[whole is None] = s.states
    assert all(torch.equal(states[True][n], states[False][n]) and states[True][n].any() for n in states[True])
    s = ParamSlice(weight.clone(), grad, {n: t.clone() for n, t in states[True].items()},
                   torch.zeros(100, dtype=torch.bfloat16), tensor_sum=TensorSum(300))
    with pytest.raises(RuntimeError, match="a shard's whole-tensor sum was not exchanged before its step"):
        apply_batch(opt, StepContext(opt.param_groups[0], MODES["kahan"], 2), [s])


def test_only_the_class_that_declares_the_spec_gives_the_terms():
    """``shards_sums``: StableAdamW and a subclass that keeps its spec exchange sharded sums; a
    subclass with a spec of its own (another term) or its own ``update`` does not inherit that
    path (its shards are gathered); an elementwise optimizer has no sums."""
    class Kept(lo.StableAdamW):
        pass

    class OwnSpec(lo.StableAdamW):
        spec = dataclasses.replace(stableadamw.STABLEADAMW, name="stableadamw_variant")

        def update(self, group, weights, grads, states, step):
            return super().update(group, weights, grads, states, step)

    class OwnUpdate(lo.StableAdamW):
        def update(self, group, weights, grads, states, step, sums=None):
            return super().update(group, weights, grads, states, step, sums)

    assert lo.StableAdamW.shards_sums() and Kept.shards_sums()
    assert not OwnSpec.shards_sums() and not OwnUpdate.shards_sums() and not lo.AdamW.shards_sums()


def test_the_messages_of_several_ranks_read_back_and_what_is_not_one_is_refused():
    """``sharded_sums``' wire format: each rank's message (its run count, then each run's
    ``(param_id, kind, first, count)``, then the values) read back from several end to end gives
    every run and value in order; a message that does not read as one (a fractional or too large
    run count, a fractional head, more pieces than numbers left) is a ``RuntimeError`` naming
    what is wrong, not an index error or a wrong sum."""
    import types

    from lowp.optim import sharded_sums
    terms = torch.rand(UNIT + 40, generator=torch.Generator().manual_seed(3))
    mine = [(types.SimpleNamespace(param_id=7), order.pieces(terms[:UNIT + 9], 0, UNIT + 40)),
            (types.SimpleNamespace(param_id=2), order.pieces(terms[:5], 0, 5))]
    theirs = [(types.SimpleNamespace(param_id=7), order.pieces(terms[UNIT + 9:], UNIT + 9, UNIT + 40))]
    both = torch.cat([sharded_sums._message(mine), sharded_sums._message(theirs)])
    head, values = sharded_sums._read_messages(both)
    runs = [r for _, r in mine + theirs]
    assert torch.equal(head[:, 1:], torch.cat([r.head for r in runs]))
    assert head[:, 0].tolist() == [7] * mine[0][1].head.shape[0] + [2] + [7] * theirs[0][1].head.shape[0]
    assert torch.equal(values, torch.cat([r.values for r in runs]))
    head[:, 0] = (head[:, 0] == 2).long()
    want = [ordered_sum(terms), ordered_sum(terms[:5])]
    assert order.totals_from_pieces(head, values, [UNIT + 40, 5]).tolist() == want
    for broken, error in [(torch.tensor([1.5]), "a message of 1.5 runs"),
                          (torch.tensor([math.nan]), "a message of nan"),
                          (torch.tensor([3.0, 7, 0, 0, 1, 1.0]), "a message of 3.0 runs with 5 numbers after it"),
                          (torch.tensor([1.0, 7, 0.5, 0, 1, 1.0]), "a run whose parameter, kind, index or count"),
                          (torch.tensor([1.0, 7, 0, 0, -1]), "a run whose .* or whose count is negative"),
                          (torch.tensor([1.0, 7, 0, 0, 4, 1.0]), "a run whose .* larger than the message"),
                          # counts whose int64 sum wraps around (to -2**63, or back to this message's start)
                          (torch.tensor([2.0, 0, 1, 0, 2.0 ** 62, 0, 1, 0, 2.0 ** 62]), "a run whose .* larger than"),
                          (torch.tensor([2.0, 0, 1, 0, 3, 0, 1, 0, 3, 1, 1, 1]), "a message of 6 pieces")]:
        with pytest.raises(RuntimeError, match=f"sharded sums: {error}"):
            sharded_sums._read_messages(torch.cat([both, broken.double()]))
    with pytest.raises(ValueError, match="slices: expected shards that each have a TensorSum"):
        sharded_sums.exchange_pieces([types.SimpleNamespace(tensor_sum=None, param_id=0)], lambda: [])
