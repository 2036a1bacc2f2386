"""The two storage registries (write-back modes, state encodings) are what every backend reads:
each entry's C++ header exists beside its module and matches it, numbers are distinct, and the
generated native sources include exactly the registered headers."""
from __future__ import annotations

import re

from lowp.optim.encodings import CODES
from lowp.optim.encodings.code import HEADERS as CODE_HEADERS
from lowp.optim.kernels.native.source import codec_source
from lowp.optim.writeback import MODES
from lowp.optim.writeback.mode import HEADERS as MODE_HEADERS


def test_every_encoding_has_its_own_kind_and_header():
    kinds = [c.kind for c in CODES.values()]
    assert len(set(kinds)) == len(kinds)
    for code in CODES.values():
        header = (CODE_HEADERS / code.native_header).read_text()
        declared = re.search(r"constexpr int (\w+) = (\d+);", header)
        assert declared is not None and int(declared.group(2)) == code.kind, code.name
        assert f"struct Storage<{declared.group(1)}>" in header
        assert f"BITS = {code.bits};" in header
        assert f"SIGNED = {'true' if code.signed else 'false'}" in header
        assert f"lowp/optim/encodings/{code.name}.py" in header


def test_the_codec_is_generated_from_the_registry():
    source = codec_source()
    includes = re.findall(r'#include "([\w.]+)"', source)
    assert includes == ["codes.h", *(c.native_header for c in CODES.values()), "codes.cpp"]
    assert f"#define LOWP_CODE_KIND_LIST {', '.join(str(c.kind) for c in CODES.values())}" in source


def test_every_mode_has_its_header():
    assert len(set(MODES)) == len(MODES)
    for name, mode in MODES.items():
        assert mode.name == name
        header = (MODE_HEADERS / mode.native_header).read_text()
        assert "load_weight(" in header and "write_back_lanes(" in header
        assert f"lowp/optim/writeback/{name}.py" in header
        assert (mode.buffer_name is None) == (mode.keep is None) == (not mode.buffer_dtypes(mode.dtypes[0]))
