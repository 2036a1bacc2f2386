"""The C++ rebuild of sharded tensors' sums (lowp/optim/kernels/native/rebuild.py): bit for bit
``ordered_sum.Rebuild.totals`` (the definition) and ``ordered_sum`` of the whole terms, over
ranges cut anywhere, replicas, NaN, infinities, signed zeros and empty tensors; the definition's
refusals with its messages; a Rebuild whose indices were damaged is refused by the C++ itself
(in a subprocess: the process lives on)."""
from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest
import torch

from lowp.optim import ordered_sum as order
from lowp.optim.kernels.native import rebuild as native_rebuild
from lowp.optim.ordered_sum import UNIT, ordered_sum

pytestmark = pytest.mark.skipif(not native_rebuild.available(), reason="the native kernel does not build here")


def _runs(numels: list[int], seed: int, replicas: bool = True, special: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """The runs of every tensor of ``numels`` cut at random places (a random range repeated as a
    replica's), shuffled: ``totals_from_pieces``' head and values, and each tensor's ordered sum.
    ``special``: terms holding NaN, infinities and signed zeros."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads, values, want = [], [], []
    for t, n in enumerate(numels):
        terms = torch.rand(n, generator=gen) * torch.exp2(torch.randint(-60, 60, (n,), generator=gen).float())
        if special and n:
            _special(terms, rng.choice(SPECIALS), rng)
        cuts = sorted(rng.randint(0, n) for _ in range(rng.randint(0, 4)))
        edges = [0, *cuts, n]
        runs = [order.pieces(terms[a:b], a, n) for a, b in zip(edges, edges[1:])]
        if replicas and rng.random() < 0.5:
            runs.append(runs[rng.randrange(len(runs))])
        for r in runs:
            heads.append(torch.cat([torch.full((r.head.shape[0], 1), t), r.head], 1))
            values.append(r.values)
        want.append(ordered_sum(terms))
    order_ = list(range(len(heads)))
    rng.shuffle(order_)
    head = torch.cat([torch.zeros((0, 4), dtype=torch.int64), *(heads[i] for i in order_)])
    return head, torch.cat([torch.zeros(0, dtype=torch.float64), *(values[i] for i in order_)]), want


#: what :func:`_special` puts in a tensor's terms
SPECIALS = ("nan payloads", "infinity", "both infinities", "negative zeros", "signed zeros", "none")


def _special(terms: torch.Tensor, kind: str, rng: random.Random) -> None:
    """Put ``kind`` into ``terms`` (fp32, in place): two NaNs of other signs and payloads side by
    side (a lane's pair), an infinity, both infinities, every term -0.0, or -0.0 and +0.0 mixed."""
    n = terms.numel()
    bits = terms.view(torch.int32)
    if kind == "nan payloads" and n >= 2:
        at = rng.randrange(n // 2) * 2
        bits[at], bits[at + 1] = 0x7FC00001, -0x3FFFFE   # 0x7fc00001, 0xffc00002
    elif kind == "infinity":
        terms[rng.randrange(n)] = float("inf")
    elif kind == "both infinities":
        terms[rng.randrange(n)], terms[rng.randrange(n)] = float("inf"), float("-inf")
    elif kind == "negative zeros":
        terms.fill_(-0.0)
    elif kind == "signed zeros":
        terms.copy_(torch.where(torch.rand(n) < 0.5, -0.0, 0.0))


def _sizes(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([0, 1, 15, 16, 17, 100, UNIT - 1, UNIT, UNIT + 1, rng.randint(1, 4 * UNIT)])
            for _ in range(rng.randint(1, 6))]


def _bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.int64).tolist()


@pytest.mark.parametrize("seed", range(12))
def test_the_same_bits_as_the_definition(seed):
    """Any cut, replicas, and on every other seed NaNs of other payloads in one lane's pair (the
    one NaN comes out of either path), infinities, negative and signed zeros."""
    numels = _sizes(seed)
    head, values, want = _runs(numels, seed, special=seed % 2 == 0)
    rebuild = order.rebuild_for(head, numels)
    calls = native_rebuild.CALLS[0]
    got = native_rebuild.totals(rebuild, values)
    assert native_rebuild.CALLS[0] == calls + 1   # the C++ ran
    assert _bits(got) == _bits(rebuild.totals(values))
    assert _bits(got) == _bits(torch.tensor(want, dtype=torch.float64))


def test_gpt2_like_shards_of_two_ranks():
    """Many tensors, shards smaller than a unit (a piece per block) and larger: the shapes of
    GPT-2 / 8 cut in two, as the sharded step sends them."""
    numels = [6432 * 96, 128 * 96, 96, 96, 96 * 288, 288, 96 * 96, 96, 96 * 384, 384, 384 * 96, 96] * 4
    gen = torch.Generator().manual_seed(3)
    heads, values, want = [], [], []
    for t, n in enumerate(numels):
        terms = torch.rand(n, generator=gen)
        half = -(-n // 2)
        for a, b in ((0, half), (half, n)):
            r = order.pieces(terms[a:b], a, n)
            heads.append(torch.cat([torch.full((r.head.shape[0], 1), t), r.head], 1))
            values.append(r.values)
        want.append(ordered_sum(terms))
    head, value = torch.cat(heads), torch.cat(values)
    got = native_rebuild.totals(order.rebuild_for(head, numels), value)
    assert got.tolist() == want


def test_the_definitions_refusals():
    numels = [2 * UNIT + 16 * 7 + 3, 100]
    head, values, _ = _runs(numels, 7, replicas=False)
    rebuild = order.rebuild_for(head, numels)
    with pytest.raises(ValueError, match=f"the runs hold {values.numel()} pieces, got {values.numel() - 1} values"):
        native_rebuild.totals(rebuild, values[:-1])
    with pytest.raises(ValueError, match="values: expected a float64 tensor of one dimension, got torch.float32"):
        native_rebuild.totals(rebuild, values.float())
    term_run = int((head[:, 1] == order.TERM).nonzero()[0])
    bad = values.clone()
    bad[int(head[:term_run, 3].sum())] = 0.1
    with pytest.raises(ValueError, match="a term of 0.1, which is no fp32 value"):
        native_rebuild.totals(rebuild, bad)
    with pytest.raises(ValueError, match="a term of 0.1, which is no fp32 value"):
        rebuild.totals(bad)
    twice = torch.cat([head, head[:1]]), torch.cat([values, values[:int(head[0, 3])]])
    rebuild = order.rebuild_for(twice[0], numels)
    other = twice[1].clone()
    other[-1] += 1.0
    with pytest.raises(ValueError, match="disagree"):
        native_rebuild.totals(rebuild, other)


def test_a_nan_total_is_the_one_nan():
    """Two NaNs of other signs and payloads in one lane's pair: which one an addition keeps
    depends on the order of its operands in the machine code, so every path gives the one quiet
    NaN (``float("nan")``'s bits)."""
    terms = torch.rand(32)
    terms.view(torch.int32)[0], terms.view(torch.int32)[1] = 0x7FC00001, -0x3FFFFE
    runs = [order.pieces(terms[:8], 0, 32), order.pieces(terms[8:], 8, 32)]
    head = torch.cat([torch.cat([torch.zeros((r.head.shape[0], 1), dtype=torch.int64), r.head], 1) for r in runs])
    values = torch.cat([r.values for r in runs])
    rebuild = order.rebuild_for(head, [32])
    nan = torch.tensor([float("nan")], dtype=torch.float64)
    assert _bits(native_rebuild.totals(rebuild, values)) == _bits(rebuild.totals(values)) == _bits(nan)
    assert _bits(torch.tensor([ordered_sum(terms)], dtype=torch.float64)) == _bits(nan)


def test_damaged_indices_are_refused_by_the_kernel():
    """A Rebuild whose unit index points far outside its array (as memory corruption would), or
    whose unit or block count is negative or impossibly large: the C++ checks every index and
    size before use and refuses it (a count too large to allocate: ``MemoryError``); a Rebuild
    changed after its first call keeps what was prepared; the process lives on."""
    script = textwrap.dedent("""
        import torch
        from lowp.optim import ordered_sum as order
        from lowp.optim.kernels.native import rebuild as native_rebuild
        terms = torch.rand(3 * order.UNIT)
        runs = [order.pieces(terms[:order.UNIT], 0, terms.numel()),
                order.pieces(terms[order.UNIT:], order.UNIT, terms.numel())]
        head = torch.cat([torch.cat([torch.zeros((r.head.shape[0], 1), dtype=torch.int64), r.head], 1) for r in runs])
        values = torch.cat([r.values for r in runs])
        rebuild = order.Rebuild(head, (terms.numel(),))
        for name, at in (("unit_to", 1 << 40), ("unit_from", -5), ("base", 1 << 50)):
            t = getattr(rebuild, name).clone()
            t[0] = at
            damaged = order.Rebuild(head, (terms.numel(),))
            setattr(damaged, name, t)
            try:
                native_rebuild.totals(damaged, values)
            except RuntimeError as e:
                print(name, "refused:", e)
        for name, at in (("units", -1), ("blocks", 1 << 61)):
            damaged = order.Rebuild(head, (terms.numel(),))
            setattr(damaged, name, at)
            try:
                native_rebuild.totals(damaged, values)
            except (RuntimeError, MemoryError) as e:
                print(name, "refused:", type(e).__name__)
        want = native_rebuild.totals(rebuild, values).item()
        rebuild.tensors = 7   # changed after its first call: the prepared count is what the C++ reads
        rebuild.base.resize_(1 << 20)
        print("kept", native_rebuild.totals(rebuild, values).tolist() == [want])
        print("alive", want == order.ordered_sum(terms))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(" refused:")[0] for line in lines[:-2]] == ["unit_to", "unit_from", "base", "units",
                                                                   "blocks"], done.stdout
    assert all("is outside its array" in line for line in lines[:3]), done.stdout
    assert lines[3:5] == ["units refused: RuntimeError", "blocks refused: MemoryError"], done.stdout
    assert lines[-2:] == ["kept True", "alive True"], done.stdout
