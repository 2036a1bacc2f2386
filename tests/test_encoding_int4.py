"""The ``int4`` encoding (lowp.optim.encodings.int4): signed 4-bit block codes, two per byte.

The codec tests (test_codes_native, test_optim_codes) enumerate ``CODES`` and run it already
(native encode/decode against the torch definition, every byte decoded). Here: its grid and
storage by hand, an AdamW run whose two moments are 4-bit (``int4`` first, ``uint4`` second)
equal on the reference, the native kernel (proven to have run) and the Triton kernel (through
its interpreter, in a subprocess), and a checkpoint of it resuming bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch

import lowp.optim as lo
from lowp.optim.codes import decode, encode
from lowp.optim.encodings import CODES
from interpreted import run_interpreted
from fused_helpers import assert_fused
from test_optim_codes import _steps as steps_between

NATIVE = lo.backends.native_available()
INT4 = CODES[torch.int4]  # type: ignore[attr-defined]
FOUR_BIT = {"exp_avg": torch.int4, "exp_avg_sq": torch.uint4}  # type: ignore[attr-defined]
SHAPES = [(1,), (33,), (64,), (65, 7), (3000,)]


def test_int4_grid_and_nibbles():
    """Every value of -7..7 times a power-of-two scale is stored exactly, as two's complement
    nibbles, element 2k in the low nibble of byte k (an odd count pads a zero nibble)."""
    x = torch.arange(-7, 8, dtype=torch.float32) * 0.25          # peak 1.75 = 7 * 0.25: scale 0.25
    codes = torch.empty(8, dtype=torch.uint8)
    scales = torch.empty(1, dtype=torch.bfloat16)
    encode(x, INT4, 32, codes, scales, None)
    assert float(scales[0]) == 0.25
    assert torch.equal(decode(codes, scales, INT4, 32, 15), x)
    assert int(codes[0]) == (0x9 | (0xA << 4)) and int(codes[7]) == 0x7   # -7, -6 ... 7 and the pad


def test_int4_rounds_stochastically_without_bias():
    """A block whose scale is 1 holds 0.3 as code 0 or 1, 1 with probability 0.3; a block of
    0.3 alone holds it as 7 times its scale."""
    x = torch.full((4096,), 0.3)
    x[0] = 7.0                                                    # block 0: scale 1
    codes = torch.empty(2048, dtype=torch.uint8)
    scales = torch.empty(64, dtype=torch.float32)
    noise = torch.randint(0, 1 << 16, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    encode(x, INT4, 64, codes, scales, noise)
    y = decode(codes, scales, INT4, 64, 4096)
    first = y[1:64]
    assert set(torch.unique(first).tolist()) == {0.0, 1.0}
    assert abs(float(first.mean()) - 0.3) < 0.15                  # 63 draws of P(1) = 0.3: sd 0.058
    torch.testing.assert_close(y[64:], x[64:], rtol=2 ** -20, atol=0.0)


def _run(backend: str, steps: int = 4, **kw):
    gen = torch.Generator().manual_seed(0)
    params = [(torch.randn(s, generator=gen) * 0.1).bfloat16() for s in SHAPES]
    opt = lo.AdamW(params, lr=1e-2, backend=backend, chunk_size=300, mode="stochastic", seed=7,
                   state_dtype=FOUR_BIT, coded_min_numel=0, **kw)
    steps_between(params, opt, 0, steps)
    return params, opt


def _same(a, b) -> None:
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
        for name, value in oa.state[x].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.view(torch.uint8) if value.element_size() == 1 else value,
                                   ob.state[y][name].view(torch.uint8) if value.element_size() == 1
                                   else ob.state[y][name]), name


def test_four_bit_moments_are_half_a_byte_each():
    params, opt = _run("eager", steps=1)
    state = opt.state[params[-1]]
    assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg"].numel() == 1500
    assert state["exp_avg_sq"].numel() == 1500
    m = decode(state["exp_avg"], state["exp_avg_scale"], INT4, 64, 3000)
    assert (m < 0).any() and (m > 0).any()                        # a signed state, stored signed


@pytest.mark.skipif(not NATIVE, reason="needs the native kernel (x86-64 with g++)")
def test_native_step_with_int4_moments_is_the_reference():
    ref = _run("eager")
    native = _run("native")
    _same(ref, native)
    assert_fused(native[1], 4 * sum(torch.Size(s).numel() for s in SHAPES))


def test_a_checkpoint_with_int4_moments_resumes_bit_for_bit():
    whole = _run("foreach", steps=4)
    params, opt = _run("foreach", steps=2)
    saved = copy.deepcopy(opt.state_dict())
    fresh_params = [p.detach().clone() for p in params]
    fresh = lo.AdamW(fresh_params, lr=1e-2, backend="foreach", chunk_size=300, mode="stochastic", seed=99,
                     state_dtype=FOUR_BIT, coded_min_numel=0)
    fresh.load_state_dict(saved)
    steps_between(fresh_params, fresh, 2, 4)
    _same(whole, (fresh_params, fresh))


def test_triton_step_with_int4_moments_is_the_reference():
    """The generated Triton kernel through its interpreter (in a subprocess: TRITON_INTERPRET is
    read at import)."""
    pytest.importorskip("triton")
    assert run_interpreted(__file__).strip().endswith("OK")


if __name__ == "__main__":
    import interpreter_fma
    interpreter_fma.install()  # Triton < 3.9 rounds the interpreter's fma twice
    triton = _run("triton", steps=2)
    _same(_run("eager", steps=2), triton)
    assert triton[1].backend.fused_elements > 0
    print("OK")
