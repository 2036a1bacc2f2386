"""Bad input to the report tables (a row whose length differs from the headers is an error) and
the atomic writes every command uses."""
import errno
import os

import pytest

from lowp.report import atomic_path, csv_text, markdown_table, staged_folder, text_table, write_atomic


@pytest.mark.parametrize("table", [text_table, markdown_table, csv_text])
@pytest.mark.parametrize("row", [[1], [1, 2, 3]])
def test_row_length_mismatch_raises(table, row):
    with pytest.raises(ValueError, match=r"rows: expected 2 cells per row .* row 1 has"):
        table(["a", "b"], [[0, 0], row])


@pytest.mark.parametrize("table", [text_table, markdown_table, csv_text])
def test_matching_rows_keep_every_cell(table):
    out = table(["a", "b"], [["x1", "y1"], ["x2", None]])
    assert "x1" in out and "y1" in out and "x2" in out


# ---- atomic writes --------------------------------------------------------------------------------

def test_write_atomic_replaces_the_file(tmp_path):
    path = tmp_path / "r.csv"
    write_atomic(path, "old\n")
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["r.csv"]
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"


def test_full_disk_keeps_the_old_report_whole(tmp_path, monkeypatch):
    """ENOSPC while the new content is flushed: the old file is untouched, no temporary file is left."""
    path = tmp_path / "r.md"
    path.write_text("old report\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        write_atomic(path, "new report " * 1000)
    assert path.read_text() == "old report\n" and os.listdir(tmp_path) == ["r.md"]


def test_atomic_path_keeps_the_extension_and_cleans_up_on_error(tmp_path):
    path = tmp_path / "plot.png"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            assert tmp.endswith(".png") and os.path.dirname(tmp) == str(tmp_path)
            open(tmp, "wb").write(b"half")
            raise RuntimeError("plotting failed")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["plot.png"]
    with atomic_path(path) as tmp:
        open(tmp, "wb").write(b"new")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["plot.png"]


def test_staged_folder_moves_all_files_in_or_none(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.csv").write_text("a1")
    (out / "keep.csv").write_text("k")
    with pytest.raises(KeyboardInterrupt):
        with staged_folder(out) as stage:
            (tmp_path / stage / "a.csv").write_text("a2")
            (tmp_path / stage / "b.csv").write_text("b2")
            raise KeyboardInterrupt
    assert sorted(os.listdir(out)) == ["a.csv", "keep.csv"] and (out / "a.csv").read_text() == "a1"
    assert os.listdir(tmp_path) == ["out"]
    with staged_folder(out) as stage:
        (tmp_path / stage / "a.csv").write_text("a2")
        (tmp_path / stage / "b.csv").write_text("b2")
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a.csv": "a2", "b.csv": "b2", "keep.csv": "k"}
    assert os.listdir(tmp_path) == ["out"]
