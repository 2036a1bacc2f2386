"""``lowp formats`` lists the block formats (lowp.blocks presets) after the element formats."""
from __future__ import annotations

from lowp.blocks import BLOCK_PRESETS
from lowp.cli import main


def test_formats_lists_block_presets(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert "fp8_e4m3fn" in out and "65504" in out            # the element table is still there
    block_part = out[out.index("Block formats"):]
    for name in BLOCK_PRESETS:
        assert name in block_part
    row = next(line for line in block_part.splitlines() if line.startswith("nvfp4 "))
    assert row.split()[1:4] == ["fp4_e2m1", "16", "e4m3"] and row.split()[-1] == "4.5"


def test_formats_blocks_csv_and_markdown(capsys):
    assert main(["formats", "--blocks", "--csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "preset,element,block,scale_format,scale_rounding,overflow,bits_per_element"
    assert "mxfp8_e4m3,fp8_e4m3fn,32,e8m0,floor,saturate,8.25" in lines
    assert len(lines) == 1 + len(BLOCK_PRESETS)
    assert main(["formats", "--csv"]) == 0                    # without --blocks: the element formats only
    assert capsys.readouterr().out.startswith("name,bits")
    assert main(["formats", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| mxfp4 | fp4_e2m1 | 32 | e8m0 | floor | saturate | 4.25 |" in out
    assert "| fp16 |" in out
