"""The native CPU codec (lowp/optim/kernels/native/codec.py, native/codes.h) against the torch
definition (lowp/optim/codes.py), bit for bit: every code x scale dtype x block size, awkward
sizes, zero, NaN and infinite blocks, values at the top code, subnormal scales, every way of
rounding; the coded step with and without it; odd inputs refused before any C++ call."""
from __future__ import annotations

import dataclasses

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import lowp.optim as lo
from fused_helpers import same_bits_or_nan
from lowp.optim import coded
from lowp.optim.codes import BLOCK_SIZES, CODES, SCALE_DTYPES, codes_shape, decode, encode, scale_name, scales_shape
from lowp.optim.kernels import coded_slices
from lowp.optim.kernels.native import codec as native_codec
from lowp.optim.randomness import ElementIndex, random16
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.writeback import MODES

pytestmark = pytest.mark.skipif(not native_codec.available(), reason="needs the native kernel (x86-64 with g++)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_CODES = list(CODES.values())
SIZES = [1, 31, 33, 255, 257, 1001, 20011]   # odd sizes for 4-bit codes; 20011 spans two work units


def _values(n: int, block: int, signed: bool, seed: int = 0) -> torch.Tensor:
    """Values over many binades with, block by block: zeros, a NaN, an infinity, values at the top
    of the grid (all equal to the peak), tiny values (subnormal scales in every scale dtype)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-6, 3, generator=gen)
    special = [
        lambda b: b.zero_(),
        lambda b: b.__setitem__(len(b) // 2, math.nan),
        lambda b: b.__setitem__(0, -math.inf if signed else math.inf),
        lambda b: b.fill_(3.0).__setitem__(slice(None, None, 2), -3.0 if signed else 2.9999998),
        lambda b: b.mul_(1e-38),
        lambda b: b.mul_(1e-44),
        lambda b: b.mul_(1e-9),
        lambda b: b.mul_(1e-33),           # scale about 2**-116: 1 / s finite, (1 / s) * 2**16 is not
        lambda b: b[:4].fill_(-0.0),       # -0.0 (kept by unsigned codes below: stored as +0.0)
    ]
    for k, blk in enumerate(x.split(block)):
        if k % 2 == 1:
            special[(k // 2) % len(special)](blk)
    return x if signed else torch.where(x == 0, x, x.abs())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _pair(x: torch.Tensor, code, block: int, scale_dtype: torch.dtype):
    """Fresh code and scale tensors for ``x``, filled with a pattern the codec must overwrite."""
    codes = torch.full(codes_shape(code, x.shape), 0x5A, dtype=torch.uint8).view(code.storage)
    return codes, torch.full(scales_shape(x.numel(), block), -1.0, dtype=scale_dtype)


def _same_decoded(want: torch.Tensor, got: torch.Tensor, scale_dtype: torch.dtype) -> None:
    """Bit for bit; NaNs decoded from an fp16 scale only at the same places: torch's own fp16 -> fp32
    cast gives 0x7FFFFFFF for every NaN on its scalar path and keeps the payload on its vector path
    (which the codec's F16C cast matches), so those bits depend on where torch's vector loop ends."""
    if scale_dtype == torch.float16:
        assert torch.equal(want.isnan(), got.isnan())
        keep = ~want.isnan()
        want, got = want[keep], got[keep]
    assert torch.equal(_bits(want), _bits(got))


@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("code", ALL_CODES, ids=lambda c: c.name)
def test_native_codec_equals_the_torch_definition(code, scale_dtype, block):
    data = _values(max(SIZES), block, code.signed, seed=block)
    key = 0x9E3779B9
    for n in SIZES:
        x = data[:n].contiguous()
        first = 5 * n + 3
        drawn = random16(torch.arange(first, first + n), key)
        for noise, native_noise in ((None, None), (drawn, drawn), (drawn, native_codec.CountedBits(first, key))):
            want_codes, want_scales = _pair(x, code, block, scale_dtype)
            encode(x, code, block, want_codes, want_scales, noise)
            got_codes, got_scales = _pair(x, code, block, scale_dtype)
            native_codec.encode(x, code, block, got_codes, got_scales, native_noise)
            assert torch.equal(_bits(want_codes), _bits(got_codes)), (n, noise is None)
            assert torch.equal(_bits(want_scales), _bits(got_scales)), (n, noise is None)
        _same_decoded(decode(want_codes, want_scales, code, block, n),
                      native_codec.decode(want_codes, want_scales, code, block, n), scale_dtype)


@pytest.mark.parametrize("code", ALL_CODES, ids=lambda c: c.name)
def test_every_code_byte_decodes_as_torch_decodes_it(code):
    """Codes the encoder never writes (fp8 NaN and infinity codes, int8's -128) included."""
    codes = torch.arange(256, dtype=torch.uint8).view(code.storage)   # 4-bit: every pair of nibbles
    numel = 256 if code.bits == 8 else 512
    scales = torch.tensor([0.75, -2.0, 3.0e-39, 1.0e30, math.inf, 0.0, -0.0, 1.5] * 2)[:scales_shape(numel, 32)[0]]
    want = decode(codes, scales, code, 32, numel)
    assert torch.equal(_bits(want), _bits(native_codec.decode(codes, scales, code, 32, numel)))


@pytest.mark.parametrize("code", [c for c in ALL_CODES if c.storage.is_floating_point], ids=lambda c: c.name)
def test_fp8_codes_decode_exactly_with_denormals_flushed(code):
    """fp8 codes decode through their fp16 patterns, subnormal ones included (every subnormal e4m3fn
    code is an fp16 subnormal there); F16C converts those exactly whatever MXCSR's flush-to-zero
    and denormals-are-zero bits say, which ``torch.set_flush_denormal(True)`` sets on this thread
    (the codec runs one unit here, on the calling thread)."""
    codes = torch.arange(256, dtype=torch.uint8).view(code.storage)
    scales = torch.ones(8)
    want = decode(codes, scales, code, 32, 256)
    assert (want.abs() < 2.0 ** -6).sum() > 8   # the subnormal codes and zeros
    if not torch.set_flush_denormal(True):
        pytest.fail("torch.set_flush_denormal is not supported on this x86-64 CPU")
    try:
        got = native_codec.decode(codes, scales, code, 32, 256)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(_bits(want), _bits(got))


def test_random_bits_across_a_multiple_of_2_to_the_32():
    """CountedBits draws random16 of the global index, whose high 32 bits change mid-tensor."""
    code = CODES[torch.uint8]
    n, first, key = 3000, (1 << 32) - 1234, 77
    x = _values(n, 64, False, seed=3)
    x = torch.where(x.isfinite(), x, 1.0)
    want_codes, want_scales = _pair(x, code, 64, torch.bfloat16)
    encode(x, code, 64, want_codes, want_scales, random16(torch.arange(first, first + n), key))
    got_codes, got_scales = _pair(x, code, 64, torch.bfloat16)
    native_codec.encode(x, code, 64, got_codes, got_scales, native_codec.CountedBits(first, key))
    assert torch.equal(want_codes, got_codes) and torch.equal(want_scales, got_scales)


def test_many_tensors_in_one_call_on_several_threads():
    code, block = CODES[torch.int8], 32
    xs = [_values(n, block, True, seed=n) for n in (70000, 1, 4097, 33)]
    want = []
    for x in xs:
        c, s = _pair(x, code, block, torch.float16)
        encode(x, code, block, c, s, random16(torch.arange(x.numel()) + 11, 5))
        want.append((c, s))
    got = [_pair(x, code, block, torch.float16) for x in xs]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native_codec.encode_many([native_codec.Encoding(x, c, s, native_codec.CountedBits(11, 5))
                                  for x, (c, s) in zip(xs, got)], code, block)
    finally:
        torch.set_num_threads(threads)
    for (wc, ws), (gc, gs) in zip(want, got):
        assert torch.equal(wc, gc) and torch.equal(_bits(ws), _bits(gs))


def _adamw_run(backend: str, steps: int = 3, rounding: str = "stochastic", state_dtype: dict | None = None,
               mode: str = "kahan", shapes=((1,), (33,), (300, 7)), **kw):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).bfloat16()) for s in shapes]
    state_dtype = state_dtype or {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
    opt = lo.AdamW(params, lr=1e-2, backend=backend, chunk_size=512, seed=3, state_dtype=state_dtype, coded_min_numel=0,
                   state_rounding=rounding, mode=mode, **kw)
    for t in range(steps):
        g = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
        opt.step()
    return params, opt


def _states(run) -> list[torch.Tensor]:
    params, opt = run
    return [*(p.detach() for p in params),
            *(v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor))]


def _same_runs(a, b) -> None:
    _same_tensors(_states(a), _states(b))


def _same_tensors(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert same_bits_or_nan(x, y)


WIDE = {"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": torch.uint4}


@pytest.mark.parametrize("rounding, state_dtype", [("stochastic", None), ("nearest", WIDE)])
def test_the_coded_step_is_the_same_with_and_without_the_native_codec(monkeypatch, rounding, state_dtype):
    native_codec.COUNTS.encoded = native_codec.COUNTS.decoded = 0
    fast = _adamw_run("foreach", rounding=rounding, state_dtype=state_dtype, state_block=32)
    elements = 1 + 33 + 2100
    # two states, three steps, decoded and encoded: every element through the native codec
    assert native_codec.COUNTS.encoded == native_codec.COUNTS.decoded == 2 * 3 * elements
    monkeypatch.setattr(coded.native_codec, "available", lambda: False)
    native_codec.COUNTS.encoded = 0
    slow = _adamw_run("foreach", rounding=rounding, state_dtype=state_dtype, state_block=32)
    assert native_codec.COUNTS.encoded == 0
    _same_runs(fast, slow)


SHAPES = ((1,), (33,), (300, 7), (100003,))   # the last one: several work units and a short last block


@pytest.mark.skipif(not lo.backends.native_available(), reason="needs the native kernel")
@pytest.mark.parametrize("mode, rounding, state_dtype, extra", [
    ("kahan", "stochastic", None, {}),
    ("stochastic", "nearest", WIDE, {"state_block": 256, "state_scale_dtype": torch.float16}),
    ("nearest", "stochastic", {"exp_avg": torch.float8_e5m2, "exp_avg_sq": torch.uint8},
     {"state_block": 32, "state_scale_dtype": torch.float32}),
])
def test_the_step_kernel_with_coded_states_equals_the_decode_step_encode_passes(monkeypatch, mode, rounding,
                                                                               state_dtype, extra):
    """The native backend decodes and encodes inside its kernel (native/coded_step.h): the same
    bits as the generic passes of lowp/optim/coded.py, with no work for the separate codec."""
    native_codec.COUNTS.encoded = 0
    fused = _adamw_run("native", 3, rounding, state_dtype, mode, SHAPES, **extra)
    total = 3 * sum(math.prod(s) for s in SHAPES)
    assert native_codec.COUNTS.encoded == 0
    assert (fused[1].backend.fused_elements, fused[1].backend.reference_elements) == (total, 0)
    monkeypatch.setattr(coded_slices, "admitted", lambda kernel, spec, ctx, slices: ([], slices))
    passes = _adamw_run("native", 3, rounding, state_dtype, mode, SHAPES, **extra)
    assert native_codec.COUNTS.encoded == 2 * total
    _same_runs(fused, passes)


@pytest.mark.skipif(not lo.backends.native_available(), reason="needs the native kernel")
@pytest.mark.parametrize("state_dtype, extra", [
    (None, {}),   # int8 / uint8 codes with bf16 scales: the variant whose roundings skip the NaN guard
    (None, {"state_scale_dtype": torch.float16}),
    ({"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": torch.uint4}, {"state_block": 32,
                                                                   "state_scale_dtype": torch.float32}),
])
def test_the_step_kernel_codes_odd_blocks_as_the_passes_do(monkeypatch, state_dtype, extra):
    """Blocks whose scales are 0, subnormal, about 2**-116 (the reciprocal is finite, times 2**16 it
    is not), NaN, or the NaN with every payload bit set (an fp32 or fp16 one widens with low bits
    that a rounding without its NaN guard would carry into the sign), and a NaN gradient let into
    the kernel (``nonfinite="off"``). The gradients of the first three kinds of blocks are 0, about
    1e-38 and about 1e-33, so their new states encode to such scales again (the kernel's slow block
    paths, not only its decoding). The kernel gives the passes' bits, and the other blocks move."""
    block = extra.get("state_block", 64)

    def run():
        params, opt = _adamw_run("native", 1, "stochastic", state_dtype, "kahan", ((100003,), (300, 7)),
                                 nonfinite="off", **extra)
        for p in params:
            for name, v in opt.state[p].items():
                if name.endswith("_scale"):
                    for k, value in enumerate((0.0, 1e-39, 1e-34, math.nan)):
                        v[k::7] = value
                    v.view(torch.int32 if v.dtype == torch.float32 else torch.int16)[4::7] = \
                        0x7FFFFFFF if v.dtype == torch.float32 else 0x7FFF
            g = torch.Generator().manual_seed(7)
            grad = torch.randn(p.shape, generator=g)
            kind = (torch.arange(p.numel()) // block % 7).view(p.shape)
            p.grad = torch.where(kind == 0, 0.0, torch.where(kind == 1, grad * 1e-38,
                                                             torch.where(kind == 2, grad * 1e-33, grad))).bfloat16()
        params[0].grad.view(-1)[2000] = math.nan
        before = [p.detach().clone() for p in params]
        steps = []
        for _ in range(2):
            opt.step()
            steps.append([t.clone() for t in _states((params, opt))])
        assert all((p != b).sum() > p.numel() // 4 for p, b in zip(params, before))
        assert params[0].isnan().any()
        scales = [v for p in params for name, v in opt.state[p].items() if name.endswith("_scale")]
        assert all((s == 0).any() for s in scales)   # zero blocks, encoded by the division path
        if scales[0].dtype != torch.float16:          # fp16 rounds a subnormal fp32 scale up to 2**-24
            first = [opt.state[p]["exp_avg_scale"].float() for p in params]   # (the squares of 1e-38 are 0)
            assert all(((s > 0) & (s < 1.1754944e-38)).any() for s in first)
        return steps
    native_codec.COUNTS.encoded = 0
    fused = run()
    assert native_codec.COUNTS.encoded == 0
    monkeypatch.setattr(coded_slices, "admitted", lambda kernel, spec, ctx, slices: ([], slices))
    passes = run()
    assert native_codec.COUNTS.encoded > 0
    for a, b in zip(fused, passes):   # after each step
        _same_tensors(a, b)


@pytest.mark.skipif(not lo.backends.native_available(), reason="needs the native kernel")
@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8], ids=str)
def test_the_step_kernel_decodes_every_code_byte_as_the_passes_do(monkeypatch, storage):
    """Every byte as a stored first-moment code, under several scales: fp8 NaN and infinity codes,
    subnormal fp8 codes and int8's -128 included, which the encoder never writes but a loaded
    checkpoint may hold. The kernel decodes in registers (fp8 codes through their fp16 patterns),
    the passes with torch's casts; the step's results agree bit for bit (NaNs at the same places)."""
    def run():
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter((torch.randn(1024, generator=gen) * 0.1).bfloat16())
        opt = lo.AdamW([p], lr=1e-2, backend="native", seed=3, coded_min_numel=0, state_dtype={"exp_avg": storage,
                                                                          "exp_avg_sq": torch.uint8})
        for step in range(2):
            p.grad = torch.randn(1024, generator=gen).bfloat16()
            if step == 1:
                state = opt.state[p]
                state["exp_avg"].view(torch.uint8).copy_(torch.arange(256, dtype=torch.uint8).repeat(4))
                state["exp_avg_scale"].copy_(torch.tensor([1.0, 2.0 ** -10, 96.0, 0.375] * 4))
            opt.step()
        return [p.detach(), *(v for v in opt.state[p].values() if isinstance(v, torch.Tensor))], opt

    native_codec.COUNTS.encoded = 0
    fused, opt = run()
    assert native_codec.COUNTS.encoded == 0 and opt.backend.fused_elements == 2 * 1024   # decoded in the kernel
    assert fused[0].isnan().any() == (storage != torch.int8)   # the NaN codes reached the weight
    monkeypatch.setattr(coded_slices, "admitted", lambda kernel, spec, ctx, slices: ([], slices))
    passes, _ = run()
    assert native_codec.COUNTS.encoded == 2 * 2 * 1024
    _same_tensors(fused, passes)


def _coded_run_at_index(backend: str, index: ElementIndex, n: int = 600) -> list[torch.Tensor]:
    """Two AdamW steps (bf16 weights, int8 / uint8 states, Kahan) on one slice whose elements have
    global indices ``index``, through the backend's ``step`` directly (an optimizer's own
    step gives whole tensors index 0): the weight and every state tensor afterwards."""
    gen = torch.Generator().manual_seed(7)
    p = (torch.randn(n, generator=gen) * 0.1).bfloat16()
    opt = lo.AdamW([p], lr=1e-2, weight_decay=0.1, backend=backend, seed=3,
                   state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}, coded_min_numel=0)
    group, mode = opt.param_groups[0], MODES["kahan"]
    state = opt.init_state(group, p, mode)
    states = opt.coded_states(group, p)
    for step in (1, 2):
        state["step"] = step
        s = ParamSlice(p, torch.randn(n, generator=gen).bfloat16(), {k: state[k] for k in opt.state_names(group, p)},
                       state[mode.buffer_name], param_id=0, index=index,
                       scales={c.name: state[scale_name(c.name)] for c in states})
        opt.backend.step(opt, StepContext(group, mode, step, seed=opt.seed, coded=tuple(states)), [s])
    return [p, *(v for v in state.values() if isinstance(v, torch.Tensor))]


@pytest.mark.skipif(not lo.backends.native_available(), reason="needs the native kernel")
@pytest.mark.parametrize("below", [256, 255, 241, 16, 552])
def test_coded_groups_that_end_at_or_cross_two_to_the_32_equal_the_passes(below):
    """The coded step draws one set of stream keys per group of 256 elements unless the group
    crosses a multiple of 2**32 (as the plain step): groups that end exactly at 2**32 - 1, one
    element past it, 16-element blocks that straddle it, and the short last group of the slice
    crossing it in its third block (552) give the passes' bits, which differ from those at
    index 0."""
    index = ElementIndex(offset=(1 << 32) - below)
    native_codec.COUNTS.encoded = 0
    kernel = _coded_run_at_index("native", index)
    assert native_codec.COUNTS.encoded == 0
    _same_tensors(kernel, _coded_run_at_index("foreach", index))
    assert native_codec.COUNTS.encoded > 0
    assert not all(torch.equal(x, y) for x, y in zip(kernel, _coded_run_at_index("native", ElementIndex())))


def test_the_kernels_last_check_refuses_codes_and_scales_that_do_not_fit():
    """coded_slices.check_coded_args, which both kernels run before reading codes and scales: scales
    of two dtypes in one call, a scale tensor one block short, or memory on a device the kernel
    does not address raise, and a direct native launch with them changes nothing."""
    gen = torch.Generator().manual_seed(7)
    p = (torch.randn(640, generator=gen) * 0.1).bfloat16()
    opt = lo.AdamW([p], lr=1e-2, state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}, coded_min_numel=0)
    group, mode = opt.param_groups[0], MODES["kahan"]
    state = opt.init_state(group, p, mode)
    states = opt.coded_states(group, p)
    codes = {c.name: c.code for c in states}

    def item(**scales):
        grad = torch.randn(640, generator=gen).bfloat16()
        return ParamSlice(p, grad, {k: state[k] for k in opt.state_names(group, p)},
                          state[mode.buffer_name], param_id=0, index=ElementIndex(),
                          scales={c.name: scales.get(c.name, state[scale_name(c.name)]) for c in states})

    coded_slices.check_coded_args(("cpu",), [item()], codes, 64)
    bad = [[item(exp_avg=state["exp_avg_scale"].float())],                # two scale dtypes in one call
           [item(), item(exp_avg_sq=state["exp_avg_sq_scale"].float())],  # two scale dtypes over the items
           [item(exp_avg=state["exp_avg_scale"][:-1])]]                   # one block short
    for items in bad:
        with pytest.raises(RuntimeError, match="the codes or scales of a coded state"):
            coded_slices.check_coded_args(("cpu",), items, codes, 64)
    with pytest.raises(RuntimeError, match="the codes or scales of a coded state"):
        coded_slices.check_coded_args(("cuda",), [item()], codes, 64)
    if lo.backends.native_available():
        before = [p.clone(), *(v.clone() for v in state.values() if isinstance(v, torch.Tensor))]
        kernel = lo.backends.get_backend("native").kernel
        with pytest.raises(RuntimeError, match="the codes or scales of a coded state"):
            kernel.coded_launch(opt.spec, StepContext(group, mode, 1, seed=opt.seed, coded=tuple(states)), bad[0])
        after = [p, *(v for v in state.values() if isinstance(v, torch.Tensor))]
        assert all(torch.equal(x, y) for x, y in zip(before, after))


@pytest.mark.skipif(not lo.backends.native_available(), reason="needs the native kernel")
def test_slices_the_kernel_cannot_take_go_through_the_passes_in_the_same_step():
    """A transposed (non-contiguous) weight takes the generic passes, the others the kernel."""
    def run(backend):
        gen = torch.Generator().manual_seed(4)
        params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).bfloat16()) for s in [(40, 30), (5000,)]]
        params[0] = torch.nn.Parameter(params[0].detach().t())
        opt = lo.AdamW(params, lr=1e-2, backend=backend, seed=3, coded_min_numel=0, state_dtype={"exp_avg": torch.int8,
                                                                              "exp_avg_sq": torch.uint8})
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()
        return params, opt
    native_codec.COUNTS.encoded = 0
    fused = run("native")
    assert native_codec.COUNTS.encoded == 2 * 2 * 1200   # the transposed one, two states, two steps
    _same_runs(run("eager"), fused)


def _bad_calls():
    code = CODES[torch.int8]
    x = torch.randn(100)
    codes = torch.empty(100, dtype=torch.int8)
    scales = torch.empty(4, dtype=torch.bfloat16)
    buf = torch.empty(100)
    enc = native_codec.encode
    return [
        ("values", lambda: enc(x.double(), code, 32, codes, scales, None)),
        ("values", lambda: enc(torch.randn(200)[::2], code, 32, codes, scales, None)),
        ("codes", lambda: enc(x, code, 32, codes.view(torch.uint8), scales, None)),
        ("codes", lambda: enc(x, code, 32, codes[:99], scales, None)),
        ("scales", lambda: enc(x, code, 32, codes, scales[:3], None)),
        ("scales", lambda: enc(x, code, 32, codes, scales.to(torch.int16), None)),
        ("noise", lambda: enc(x, code, 32, codes, scales, torch.zeros(99, dtype=torch.int32))),
        ("noise", lambda: enc(x, code, 32, codes, scales, torch.zeros(100, dtype=torch.int64))),
        ("noise", lambda: enc(x, code, 32, codes, scales, native_codec.CountedBits(0, 1 << 32))),
        ("noise", lambda: enc(x, code, 32, codes, scales, native_codec.CountedBits((1 << 63) - 50, 1))),
        ("block", lambda: enc(x, code, 48, codes, scales, None)),
        ("code", lambda: enc(x, "int8", 32, codes, scales, None)),
        # a Code that is not one of CODES: a bf16 "fp8" table would hold 128 entries, not 256
        ("code: expected one of lowp.optim.codes.CODES",
         lambda: native_codec.decode(torch.zeros(100, dtype=torch.bfloat16), scales,
                                     dataclasses.replace(CODES[torch.float8_e4m3fn], storage=torch.bfloat16), 32, 100)),
        ("jobs", lambda: enc(x, code, 32, x[:25].view(torch.int8), scales, None)),
        ("out", lambda: native_codec.decode(codes, scales, code, 32, 100, torch.empty(100, dtype=torch.float64))),
        ("out", lambda: native_codec.decode(codes, scales, code, 32, 100, torch.empty(200)[::2])),
        ("scales", lambda: native_codec.decode(codes, scales[:2], code, 32, 100)),
        ("jobs", lambda: native_codec.decode(buf.view(torch.int8)[:100], scales, code, 32, 100, buf)),
        ("numel", lambda: native_codec.decode(codes, scales, code, 32, 0)),
    ]


@pytest.mark.parametrize("k", range(len(_bad_calls())))
def test_odd_inputs_are_refused_with_a_clear_error_before_anything_is_written(k):
    name, call = _bad_calls()[k]
    with pytest.raises(ValueError, match=name):
        call()


def test_memory_that_could_crash_is_refused_in_a_subprocess():
    """A freed storage (size 0, as FSDP leaves it) and a storage shorter than the shape: refused
    with a ValueError, never read or written (run in a subprocess: a crash shows as a signal)."""
    script = textwrap.dedent("""
        import torch
        from lowp.optim.codes import CODES
        from lowp.optim.kernels.native import codec as native_codec
        code = CODES[torch.int8]
        x = torch.randn(1 << 16)
        codes = torch.empty(1 << 16, dtype=torch.int8)
        scales = torch.empty(1 << 11, dtype=torch.float32)
        freed = torch.empty(1 << 16, dtype=torch.int8)
        freed.untyped_storage().resize_(0)
        short = torch.randn(1 << 16)
        short.untyped_storage().resize_(1 << 10)
        for args in [(x, code, 32, freed, scales, None), (short, code, 32, codes, scales, None)]:
            try:
                native_codec.encode(*args)
            except ValueError as e:
                print("refused:", str(e).split(":")[0])
        try:
            native_codec.decode(freed, scales, code, 32, 1 << 16)
        except ValueError as e:
            print("refused:", str(e).split(":")[0])
    """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:3] == ["refused: jobs[0].codes", "refused: jobs[0].values",
                                             "refused: jobs[0].codes"]
