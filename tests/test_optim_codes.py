"""Block-scaled low-bit states (lowp/optim/codes.py, lowp/optim/coded.py): the codes against
exact references (torch's own fp8 casts, every grid value, all 2**16 random draws), and the
optimizers with coded states on every backend, bit for bit, through checkpoints and gradient release."""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch

import lowp.optim as lo
from lowp.arith import sqrt_rn
from lowp.optim.codes import CODES, SCALE_DTYPES, code_for, codes_shape, decode, encode, scales_shape
from lowp.optim.registry import optimizers
from interpreted import run_interpreted
from fused_helpers import assert_fused

NATIVE = lo.backends.native_available()
ALL_CODES = list(CODES.values())


def _values(n: int, seed: int = 0, signed: bool = True) -> torch.Tensor:
    """Values over many binades, with a zero block and exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-8, 2, generator=gen)
    x[:64] = 0.0
    x[100:110] = 0.0
    return x if signed else x.square()


def _coded(x: torch.Tensor, code, block: int = 64, scale_dtype=torch.bfloat16, noise=None):
    codes = torch.empty(codes_shape(code, x.shape), dtype=code.storage)
    scales = torch.empty(scales_shape(x.numel(), block), dtype=scale_dtype)
    encode(x, code, block, codes, scales, noise)
    return codes, scales


def _grid(code) -> torch.Tensor:
    """Every value a code can hold (nonnegative half for unsigned codes), as fp32."""
    if code.storage.is_floating_point:
        values = torch.arange(256, dtype=torch.uint8).view(code.storage).float()
        return values[values.isfinite()].unique()
    return torch.arange(-code.top if code.signed else 1, code.top + 1)   # unsigned codes never hold 0


def _code_values(codes: torch.Tensor, code, n: int) -> torch.Tensor:
    """The codes as fp32 numbers (4-bit ones unpacked, low nibble first; a signed nibble is two's
    complement)."""
    if code.bits == 4:
        nibbles = torch.stack([codes & 15, codes >> 4], 1).reshape(-1)[:n].to(torch.int32)
        return (nibbles - ((nibbles & 8) << 1) if code.signed else nibbles).float()
    return codes.reshape(-1).float()


@pytest.mark.parametrize("code", ALL_CODES, ids=lambda c: c.name)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=str)
def test_nearest_codes_are_the_nearest_grid_values(code, scale_dtype):
    x = _values(4000, signed=code.signed)
    codes, scales = _coded(x, code, scale_dtype=scale_dtype)
    t = x if code.signed else sqrt_rn(x)
    s = scales.float().repeat_interleave(64)[:x.numel()]
    # the scale: the smallest value of its dtype at or above the block's peak / top
    peak = torch.cat([t.abs(), torch.zeros(-x.numel() % 64)]).view(-1, 64).amax(1)
    want = peak / code.top
    assert (scales.float() >= want).all()
    lower = torch.nextafter(scales, torch.zeros_like(scales)).float()
    assert ((lower < want) | (scales == 0)).all()
    # the codes: the grid value nearest to t / s (ties cannot occur in these data but are allowed)
    y = torch.where(s > 0, t / s, 0.0)
    grid = _grid(code)
    if not code.signed:
        assert (_code_values(codes, code, x.numel()) >= 1).all()
    best = (y[:, None] - grid[None, :]).abs().min(dim=1).values
    assert torch.equal((y - _code_values(codes, code, x.numel())).abs(), best)
    if code.storage.is_floating_point:   # torch's own cast rounds to nearest even: the same codes
        assert torch.equal(codes.view(torch.uint8), y.to(code.storage).view(torch.uint8))


@pytest.mark.parametrize("code", ALL_CODES, ids=lambda c: c.name)
def test_decode_is_code_times_scale(code):
    x = _values(1000, 1, signed=code.signed)
    codes, scales = _coded(x, code, block=32, scale_dtype=torch.float32)
    y = _code_values(codes, code, 1000) * scales.repeat_interleave(32)[:1000]
    assert torch.equal(decode(codes, scales, code, 32, 1000), y if code.signed else y * y)


@pytest.mark.parametrize("code", ALL_CODES, ids=lambda c: c.name)
def test_stochastic_rounding_is_unbiased_over_every_draw(code):
    """One block, every one of the 2**16 random draws: the mean code is t / s to 16 bits."""
    x = _values(64, 2, signed=code.signed)[None, :].expand(1 << 16, 64).contiguous()
    x[:, 0] = 3.0   # the same peak in every copy of the block (so the same scale)
    noise = torch.arange(1 << 16, dtype=torch.int32)[:, None].expand(1 << 16, 64).contiguous()
    codes, scales = _coded(x, code, noise=noise)
    assert (scales == scales[0]).all()
    decoded = decode(codes, scales, code, 64, x.numel()).view(1 << 16, 64).double()
    q = (decoded if code.signed else decoded.sqrt()) / scales[0].double()
    y = (x[0].double() if code.signed else x[0].double().sqrt()) / scales[0].double()
    a = y.abs().float()
    spacing = code.spacing(a).double()
    want = y if code.signed else y.clamp_min(1.0)   # unsigned codes store values below one step as one step
    assert ((q.mean(0) - want).abs() <= spacing * 2.0 ** -16 + 1e-12 * y.abs()).all()
    assert len(q.unique()) > len(y.unique())   # it did round both ways


def test_nonfinite_values_spoil_their_block_only():
    x = _values(256, 3)
    x[70] = math.inf
    x[200] = math.nan
    code = CODES[torch.int8]
    codes, scales = _coded(x, code)
    y = decode(codes, scales, code, 64, 256)
    assert y[64:128].isnan().all() and y[192:].isnan().all()
    assert y[:64].isfinite().all() and y[128:192].isfinite().all()


@pytest.mark.parametrize("n", [1, 2, 63, 65, 127, 1001])
def test_four_bit_codes_pack_two_per_byte(n):
    code = CODES[torch.uint4]
    x = _values(n, 4, signed=False)
    codes, scales = _coded(x, code, block=32)
    assert codes.shape == ((n + 1) // 2,) and codes.dtype == torch.uint8
    y = decode(codes, scales, code, 32, n)
    assert y.shape == (n,)
    if n > 1:   # each element is decoded from its own nibble: change one element, the rest stay
        x2 = x.clone()
        x2[n // 2] = 0.0
        c2, s2 = _coded(x2, code, block=32)
        y2 = decode(c2, s2, code, 32, n)
        same_block = torch.arange(n) // 32 == (n // 2) // 32
        assert torch.equal(y2[~same_block], y[~same_block])


def test_code_for_names_codes_and_not_floats():
    assert code_for(torch.int8).name == "int8" and code_for(torch.float8_e5m2).name == "e5m2"
    assert code_for(torch.bfloat16) is None and code_for(None) is None


# ---- optimizers with coded states -----------------------------------------------------------

SHAPES = [(1,), (33,), (64,), (65, 7), (3000,)]


def _state_dtype(cls, wide: bool = False) -> dict:
    """8-bit codes for every state (uint8 for nonnegative ones); ``wide``: fp8 e4m3 and uint4."""
    group = cls([torch.zeros(1)]).param_groups[0]
    names = cls.spec.states(group)
    if wide:
        return {n: torch.uint4 if n in cls.spec.nonnegative else torch.float8_e4m3fn for n in names}
    return {n: torch.uint8 if n in cls.spec.nonnegative else torch.int8 for n in names}


def _steps(params, opt, first: int, last: int) -> None:
    """Steps ``first .. last - 1``, each with its own gradients."""
    for t in range(first, last):
        gen = torch.Generator().manual_seed(1000 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()


def _run(cls, backend: str, steps: int = 4, chunk_size: int = 1 << 17, mode: str = "kahan", wide: bool = False,
         shapes: list[tuple[int, ...]] = SHAPES, **kw):
    gen = torch.Generator().manual_seed(0)
    params = [(torch.randn(s, generator=gen) * 0.1).bfloat16() for s in shapes]
    opt = cls(params, lr=1e-2, backend=backend, chunk_size=chunk_size, mode=mode, seed=7,
              state_dtype=_state_dtype(cls, wide), **{"coded_min_numel": 0, **kw})
    _steps(params, opt, 0, steps)
    return params, opt


def _same(a, b) -> None:
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y), f"weights differ in {int((x != y).sum())} of {x.numel()}"
        for name, value in oa.state[x].items():
            if isinstance(value, torch.Tensor):
                other = ob.state[y][name]
                assert value.dtype == other.dtype, name
                assert torch.equal(value.view(torch.uint8) if value.element_size() == 1 else value,
                                   other.view(torch.uint8) if other.element_size() == 1 else other), name


CODED = [cls for cls in optimizers() if cls.spec is not None and cls.spec.rule is not None and cls.spec.states]


@pytest.mark.parametrize("cls", CODED, ids=lambda c: c.__name__)
def test_every_backend_and_chunking_gives_the_same_coded_run(cls):
    ref = _run(cls, "eager")
    _same(ref, _run(cls, "foreach", chunk_size=1000))
    if NATIVE:
        native = _run(cls, "native", chunk_size=300)
        _same(ref, native)
        assert_fused(native[1], 4 * sum(math.prod(s) for s in SHAPES))


@pytest.mark.skipif(not NATIVE, reason="needs the native kernel (x86-64 with g++)")
def test_fp8_and_four_bit_states_on_the_native_kernel():
    _same(_run(lo.AdamW, "eager", wide=True), _run(lo.AdamW, "native", wide=True))


def test_compiled_kernel_with_coded_states():
    ref = _run(lo.AdamW, "eager", steps=2)
    compiled = _run(lo.AdamW, "compiled", steps=2)
    _same(ref, compiled)
    assert compiled[1].backend.fused_elements > 0


def test_triton_kernel_with_coded_states_through_the_interpreter():
    """The Triton kernel on decoded pieces (interpreted on the CPU, in a subprocess: TRITON_INTERPRET
    must be set before triton is imported)."""
    pytest.importorskip("triton")
    assert "OK" in run_interpreted(__file__, timeout=300)


def _triton_case() -> None:
    ref = _run(lo.AdamW, "eager", steps=2)
    triton = _run(lo.AdamW, "triton", steps=2)
    _same(ref, triton)
    assert triton[1].backend.fused_elements > 0
    print("OK")


def test_states_are_one_byte_and_blocks_of_scales():
    params, opt = _run(lo.AdamW, "eager", steps=1, state_block=128, state_scale_dtype=torch.float16)
    p = params[-1]
    state = opt.state[p]
    assert state["exp_avg"].dtype == torch.int8 and state["exp_avg"].shape == p.shape
    assert state["exp_avg_sq"].dtype == torch.uint8
    assert state["exp_avg_scale"].dtype == torch.float16 and state["exp_avg_scale"].shape == (math.ceil(3000 / 128),)
    params, opt = _run(lo.AdamW, "eager", steps=1, wide=True)
    wide = opt.state[params[-1]]
    assert wide["exp_avg_sq"].shape == (1500,) and wide["exp_avg"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("backend", ["eager", "native"] if NATIVE else ["eager"])
def test_coded_min_numel_keeps_small_parameters_states_in_16_bits(backend):
    """``coded_min_numel=64``: the parameters of 1 and 33 elements keep bf16 states, those of 64
    and more codes; the same bits as the two groups one would write by hand (the small
    parameters last, so every parameter keeps its position and its random streams); a
    checkpoint resumes it bit for bit."""
    shapes = [(64,), (65, 7), (3000,), (1,), (33,)]
    threshold = _run(lo.AdamW, backend, shapes=shapes, coded_min_numel=64)
    params, opt = threshold
    assert [opt.state[p]["exp_avg"].dtype for p in params] == [torch.int8] * 3 + [torch.bfloat16] * 2
    assert all("exp_avg_sq_scale" not in opt.state[p] for p in params[3:])
    gen = torch.Generator().manual_seed(0)
    by_hand = [(torch.randn(s, generator=gen) * 0.1).bfloat16() for s in shapes]
    groups = lo.AdamW([{"params": by_hand[:3]}, {"params": by_hand[3:], "state_dtype": None}], lr=1e-2,
                      backend=backend, mode="kahan", seed=7, state_dtype=_state_dtype(lo.AdamW),
                      coded_min_numel=0)
    _steps(by_hand, groups, 0, 4)
    _same(threshold, (by_hand, groups))
    if backend == "native":
        assert_fused(opt, 4 * sum(math.prod(s) for s in shapes))
    full = _run(lo.AdamW, backend, steps=6, shapes=shapes, coded_min_numel=64)
    copies = [p.detach().clone() for p in params]
    again = lo.AdamW(copies, lr=1e-2, backend=backend, mode="kahan", seed=7, state_dtype=_state_dtype(lo.AdamW),
                      coded_min_numel=0)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))   # the saved group brings coded_min_numel back
    assert again.param_groups[0]["coded_min_numel"] == 64
    _steps(copies, again, 4, 6)
    _same(full, (copies, again))


def _decoded(state: dict, name: str, code: torch.dtype, block: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The reference decode of a coded state (``q * s``, squared for unsigned codes) rounded to
    nearest into ``dtype``."""
    from lowp.optim.codes import code_for, decode
    values = decode(state[name].reshape(-1), state[f"{name}_scale"].reshape(-1), code_for(code), block, numel)
    return values.to(dtype)


def test_a_changed_coded_min_numel_is_named_before_anything_changes():
    """Codes made before the threshold rose, or 16-bit states before it fell, are refused by the
    step with the reason, changing nothing; a state_dict round trip brings them to the group's
    storage both ways: 16-bit states encoded into codes, codes decoded into bf16 states (the
    reference decode rounded to nearest), as does loading a checkpoint saved with the other
    threshold. A lowp checkpoint saved before the option existed keeps its codes: it was made
    with codes at every size, which its group then gets (coded_min_numel=0)."""
    p = torch.nn.Parameter(torch.randn(100).bfloat16())
    eight = _state_dtype(lo.AdamW)
    coded = lo.AdamW([p], state_dtype=eight, coded_min_numel=0, seed=1)
    p.grad = torch.randn(100).bfloat16()
    coded.step()
    want = {n: _decoded(coded.state[p], n, eight[n], 64, 100, torch.bfloat16) for n in eight}
    sd = copy.deepcopy(coded.state_dict())
    old = copy.deepcopy(sd)
    del old["param_groups"][0]["coded_min_numel"]   # as saved before the option existed
    small = lo.AdamW([p], state_dtype=eight, seed=1)
    small.load_state_dict(old)
    assert small.param_groups[0]["coded_min_numel"] == 0 and small.state[p]["exp_avg"].dtype == torch.int8
    sd["param_groups"][0]["coded_min_numel"] = 4096   # saved with the other threshold
    small.load_state_dict(sd)
    assert small.param_groups[0]["coded_min_numel"] == 4096
    assert not [k for k in small.state[p] if k.endswith("_scale")]
    for n in eight:
        assert small.state[p][n].dtype == torch.bfloat16 and torch.equal(small.state[p][n], want[n]), n
    small.step()
    before = p.detach().clone()
    small.param_groups[0]["coded_min_numel"] = 0
    with pytest.raises(ValueError, match=r"a torch.bfloat16 state where the group stores int8 codes .*encodes it"):
        small.step()
    assert torch.equal(p, before) and small.state[p]["step"] == 2
    small.load_state_dict(small.state_dict())
    assert small.state[p]["exp_avg"].dtype == torch.int8 and "exp_avg_scale" in small.state[p]
    small.step()
    assert small.state[p]["step"] == 3
    codes, before = copy.deepcopy(small.state[p]), p.detach().clone()
    small.param_groups[0]["coded_min_numel"] = 101   # up again: the codes are refused, then decoded
    with pytest.raises(ValueError, match=r"\['exp_avg'\]: block-scaled codes where the group keeps a 16-bit "
                                         r"state .*decodes them"):
        small.step()
    assert torch.equal(p, before) and small.state[p]["step"] == 3
    small.load_state_dict(small.state_dict())
    for n in eight:
        assert torch.equal(small.state[p][n], _decoded(codes, n, eight[n], 64, 100, torch.bfloat16)), n
    small.step()
    assert small.state[p]["step"] == 4


@pytest.mark.parametrize("scale, why", [(-1.0, "negative"), (float("nan"), "NaN")])
def test_codes_to_decode_with_bad_scales_are_refused(scale, why):
    """Codes decoded on load bring their block scales' checks with them: a negative scale (which
    would flip the sign of decoded moments) or a NaN one is refused by name, nothing loaded."""
    p = torch.nn.Parameter(torch.randn(100).bfloat16())
    opt = lo.AdamW([p], state_dtype=_state_dtype(lo.AdamW), coded_min_numel=0, seed=1)
    p.grad = torch.randn(100).bfloat16()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["coded_min_numel"] = 4096
    sd["state"][0]["exp_avg_scale"][0] = scale
    before = copy.deepcopy(opt.state[p])
    with pytest.raises(ValueError, match=rf"'exp_avg_scale' of the codes to decode: .*{why}"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["coded_min_numel"] == 0
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("codes, decodes", [("8-bit", True), ("4-bit", False)])
def test_codes_decode_when_state_dtype_no_longer_names_them(codes, decodes):
    """A group switched from codes to ``state_dtype=torch.bfloat16``: the round trip decodes
    codes whose storage dtype and sizes name their code (int8 bytes; uint8 bytes of one per
    element: uint8), and refuses by name, changing nothing, bytes that more than one code fits
    (two 4-bit codes per byte: int4 or uint4)."""
    p = torch.nn.Parameter(torch.randn(100).bfloat16())
    asked = _state_dtype(lo.AdamW) if codes == "8-bit" else {"exp_avg": torch.int4, "exp_avg_sq": torch.uint4}
    opt = lo.AdamW([p], state_dtype=asked, coded_min_numel=0, seed=1)
    p.grad = torch.randn(100).bfloat16()
    opt.step()
    saved = copy.deepcopy(opt.state[p])
    opt.param_groups[0]["state_dtype"] = torch.bfloat16
    if not decodes:
        with pytest.raises(ValueError, match=r"\['exp_avg'\]: block-scaled codes where the group keeps a 16-bit"):
            opt.load_state_dict(opt.state_dict())
        assert all(torch.equal(opt.state[p][k], v) for k, v in saved.items() if isinstance(v, torch.Tensor))
        return
    opt.load_state_dict(opt.state_dict())
    for n, code in asked.items():
        assert torch.equal(opt.state[p][n], _decoded(saved, n, code, 64, 100, torch.bfloat16)), n
    opt.step()
    assert opt.state[p]["step"] == 2 and opt.state[p]["exp_avg"].dtype == torch.bfloat16


def test_codes_keep_the_rows_of_a_parameter_whose_rows_hold_whole_blocks():
    """Codes and scales keep the leading dimensions when the last one holds whole blocks (so a
    shard of rows holds its own blocks), else they are flat; the bytes are those of the flat
    layout either way, so a checkpoint saved flat loads, and a wrong element count is refused."""
    shapes = [(65, 7), (3, 128)]
    params, opt = _run(lo.AdamW, "foreach", steps=2, wide=True, shapes=shapes)
    flat, rows = opt.state[params[0]], opt.state[params[1]]   # blocks of 64
    assert rows["exp_avg"].shape == (3, 128) and rows["exp_avg_sq"].shape == (3, 64)
    assert rows["exp_avg_scale"].shape == rows["exp_avg_sq_scale"].shape == (3, 2)
    assert flat["exp_avg_sq"].shape == (228,) and flat["exp_avg_scale"].shape == (8,)
    full = _run(lo.AdamW, "foreach", steps=4, wide=True, shapes=shapes)
    sd = copy.deepcopy(opt.state_dict())
    for name in ("exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        sd["state"][1][name] = sd["state"][1][name].reshape(-1)
    copies = [p.detach().clone() for p in params]
    again = lo.AdamW(copies, lr=1e-2, backend="foreach", mode="kahan", seed=7,
                     state_dtype=_state_dtype(lo.AdamW, wide=True), coded_min_numel=0)
    again.load_state_dict(sd)
    assert again.state[copies[1]]["exp_avg_scale"].shape == (3, 2)
    _steps(copies, again, 2, 4)
    _same(full, (copies, again))
    sd["state"][1]["exp_avg_scale"] = sd["state"][1]["exp_avg_scale"][:5]
    with pytest.raises(ValueError, match="'exp_avg_scale': 5 elements, expected 6"):
        again.load_state_dict(sd)


def test_resume_from_a_checkpoint_is_bit_identical():
    full = _run(lo.AdamW, "foreach", steps=6)
    params, opt = _run(lo.AdamW, "foreach", steps=3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    copies = [p.detach().clone() for p in params]
    again = lo.AdamW(copies, lr=1e-2, backend="foreach", mode="kahan", seed=7, state_dtype=_state_dtype(lo.AdamW),
                     coded_min_numel=0)
    again.load_state_dict(torch.load(buf))
    _steps(copies, again, 3, 6)
    _same(full, (copies, again))


def test_float_states_of_a_checkpoint_are_encoded_on_load():
    gen = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(500, generator=gen).bfloat16())
    plain = lo.AdamW([p], lr=1e-2, seed=7)
    p.grad = torch.randn(500, generator=gen).bfloat16()
    plain.step()
    coded = lo.AdamW([p], lr=1e-2, seed=7, state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
                     coded_min_numel=0)
    sd = plain.state_dict()
    sd["param_groups"][0].update(state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}, coded_min_numel=0)
    coded.load_state_dict(sd)
    state = coded.state[p]
    assert state["exp_avg"].dtype == torch.int8 and "exp_avg_scale" in state
    m = decode(state["exp_avg"], state["exp_avg_scale"], CODES[torch.int8], 64, 500)
    want = plain.state[p]["exp_avg"].float()
    peak = want.abs().amax()
    assert (m - want).abs().max() <= peak / 127    # within one code step of the largest block


def test_second_moment_keeps_decaying_only_with_stochastic_rounding():
    """beta2 = 0.999 shrinks v by 0.1% a step, below one 8-bit code step: to nearest it stalls."""
    out = {}
    for rounding in ("stochastic", "nearest"):
        gen = torch.Generator().manual_seed(2)
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = lo.AdamW([p], lr=0.0, coded_min_numel=0, state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
                       state_rounding=rounding, backend="native" if NATIVE else "foreach", seed=1)
        p.grad = torch.randn(4096, generator=gen)
        opt.step()
        state = opt.state[p]
        v0 = decode(state["exp_avg_sq"], state["exp_avg_sq_scale"], CODES[torch.uint8], 64, 4096).double()
        p.grad = torch.zeros(4096)
        for _ in range(1000):
            opt.step()
        v = decode(state["exp_avg_sq"], state["exp_avg_sq_scale"], CODES[torch.uint8], 64, 4096).double()
        out[rounding] = float(v.sum() / v0.sum())
    assert abs(out["stochastic"] / 0.999 ** 1000 - 1) < 0.05
    assert out["nearest"] > 0.9


def test_gradient_release_with_coded_states_equals_the_step():
    from lowp.optim.release import release_gradients
    runs = []
    for release in (False, True):
        gen = torch.Generator().manual_seed(3)
        torch.manual_seed(3)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).bfloat16()
        opt = lo.AdamW(net.parameters(), lr=1e-2, seed=2, coded_min_numel=0, state_dtype={"exp_avg": torch.int8,
                                                                      "exp_avg_sq": torch.uint4})
        handle = release_gradients(opt) if release else None
        for _ in range(3):
            loss = net(torch.randn(5, 8, generator=gen).bfloat16()).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        if handle is not None:
            handle.remove()
        runs.append((list(net.parameters()), opt))
    _same(*runs)


@pytest.mark.parametrize("second", [torch.uint8, torch.uint4], ids=str)
def test_a_tiny_second_moment_never_decodes_to_zero(second):
    """One large gradient beside tiny ones in a block: a tiny second moment coded as 0 would make
    Adam's step m / eps (1e4 times lr here); the unsigned codes keep every step about lr."""
    p = torch.zeros(64)
    p.grad = torch.full((64,), 1e-4)
    p.grad[0] = 1.0
    opt = lo.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, backend="foreach",   # fp8 m: 1e-5 stays nonzero
                   state_dtype={"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": second}, coded_min_numel=0)
    for _ in range(3):
        opt.step()
    assert p.abs().max() <= 2 * 3 * 1e-3   # three Adam steps of about lr each (without the fix: 1e-3 / eps)


@pytest.mark.parametrize("make, arg", [
    (lambda p: lo.AdamW(p, state_dtype={"exp_avg": torch.uint8}), "state_dtype['exp_avg']"),
    (lambda p: lo.Lion(p, state_dtype=torch.uint4), "state_dtype"),
    (lambda p: lo.Adafactor(p, state_dtype=torch.int8), "state_dtype"),
    (lambda p: lo.AdamW(p, state_block=100), "state_block"),
    (lambda p: lo.AdamW(p, state_scale_dtype=torch.int8), "state_scale_dtype"),
])
def test_codes_a_state_cannot_hold_are_refused(make, arg):
    with pytest.raises(ValueError, match=arg.replace("[", r"\[").replace("]", r"\]")):
        make([torch.nn.Parameter(torch.zeros(4, 4))])


def test_a_checkpoint_without_scales_is_refused_before_anything_changes():
    params, opt = _run(lo.AdamW, "foreach", steps=1)
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][0]["exp_avg_scale"]
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="exp_avg_scale"):
        opt.load_state_dict(sd)
    sd["state"][0]["exp_avg_scale"] = torch.zeros(3, dtype=torch.float32)
    with pytest.raises(ValueError, match="exp_avg_scale"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    for key in before["state"]:
        for name, value in before["state"][key].items():
            assert torch.equal(value, after["state"][key][name])


if __name__ == "__main__":
    import interpreter_fma
    interpreter_fma.install()  # Triton < 3.9 rounds the interpreter's fma twice
    _triton_case()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("states", [{"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
                                    {"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": torch.float8_e4m3fn},
                                    {"exp_avg": torch.int8, "exp_avg_sq": torch.uint4}],  # type: ignore[attr-defined]
                         ids=["int8-uint8", "e4m3", "int8-uint4"])
def test_coded_states_on_gpu_match_the_cpu_definition(states):
    """An AdamW run with block-scaled states on CUDA (the Triton kernel, the default there) ends
    with the weights, codes and scales of the same run on the CPU, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen).bfloat16() for n in (5000, 37, 1 << 20, 1027)]
    # the last tensor's gradients are tiny: subnormal states and scales, blocks that divide
    grads = [[(torch.randn(p.shape, generator=gen) * (1e-36 if i == 3 else 1.0)).bfloat16()
              for i, p in enumerate(start)] for _ in range(3)]

    def run(device):
        params = [p.to(device) for p in start]
        opt = lo.AdamW(params, lr=1e-2, weight_decay=0.1, seed=1, state_dtype=states, coded_min_numel=0)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.to(device)
            opt.step()
        return params, opt

    gpu, gpu_opt = run("cuda")
    assert gpu_opt.backend.fused_elements == 3 * sum(p.numel() for p in start)  # decoded inside the Triton kernel
    cpu, cpu_opt = run("cpu")
    for p, q in zip(gpu, cpu):
        assert torch.equal(p.cpu(), q)
        for key, value in cpu_opt.state[q].items():
            if isinstance(value, torch.Tensor):
                got = gpu_opt.state[p][key].cpu()
                assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                                   value.view(torch.uint8) if value.element_size() == 1 else value), key


def test_layout_helpers_name_bad_arguments():
    """A block outside BLOCK_SIZES, or a plain tensor where a DTensor parameter is expected, is a
    clear error, not a ZeroDivisionError, a negative shape or an AttributeError."""
    from lowp.optim import sharding
    from lowp.optim.codes import stored_shapes
    for block in (0, -64, 48):
        with pytest.raises(ValueError, match="block"):
            stored_shapes(CODES[torch.int8], (4, 64), block)
    with pytest.raises(TypeError, match="DTensor"):
        sharding.coded_placements(torch.zeros(4, 64), 64)
    with pytest.raises(TypeError, match="DTensor"):
        sharding.new_tensor(torch.zeros(4, 64), (4, 64), torch.int8, ())
