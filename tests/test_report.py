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


# ---- only regular files are replaced -----------------------------------------------------------

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")


@needs_fifo
def test_atomic_path_target_swapped_for_a_named_pipe_is_not_replaced(tmp_path):
    """The target was a regular file when the write began and is a named pipe when the block
    ends: the check right before ``os.replace`` refuses, removes the temporary file and leaves
    the pipe."""
    import stat

    from lowp.report import UnsafeOutputError

    path = tmp_path / "r.csv"
    path.write_text("old\n")
    with pytest.raises(UnsafeOutputError, match=r"r\.csv.* is a named pipe \(FIFO\), not a regular file"):
        with atomic_path(path) as tmp:
            with open(tmp, "w") as fh:
                fh.write("new\n")
            path.unlink()
            os.mkfifo(path)
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and os.listdir(tmp_path) == ["r.csv"]


@pytest.mark.parametrize("kind", ["symlink", "folder", "fifo"])
def test_write_atomic_refuses_a_target_that_is_not_a_regular_file(kind, tmp_path):
    from lowp.report import UnsafeOutputError

    target = tmp_path / "report.md"
    (tmp_path / "real.md").write_text("keep\n")
    if kind == "symlink":
        target.symlink_to(tmp_path / "real.md")
    elif kind == "folder":
        target.mkdir()
    elif hasattr(os, "mkfifo"):
        os.mkfifo(target)
    else:
        pytest.skip("needs os.mkfifo")
    with pytest.raises(UnsafeOutputError, match="report.md"):
        write_atomic(target, "new\n")
    assert sorted(os.listdir(tmp_path)) == ["real.md", "report.md"] and (tmp_path / "real.md").read_text() == "keep\n"
    assert os.path.islink(target) == (kind == "symlink")


def test_non_regular_kind_names_each_kind(tmp_path):
    from lowp.report import non_regular_kind

    (tmp_path / "f").write_text("x")
    (tmp_path / "l").symlink_to(tmp_path / "f")
    assert non_regular_kind(tmp_path / "f") is None
    assert non_regular_kind(tmp_path / "missing") is None
    assert non_regular_kind(tmp_path / "f" / "below-a-file") is None
    assert non_regular_kind(tmp_path / "l") == "a symbolic link"
    assert non_regular_kind(tmp_path) == "a folder"
    if os.path.exists("/dev/null"):
        assert non_regular_kind("/dev/null") == "a character device"


@needs_fifo
def test_staged_folder_moves_nothing_onto_an_entry_that_is_not_a_regular_file(tmp_path):
    """One of the run's files would land on a named pipe: none of them is moved in, the pipe
    and the earlier files stay, and the staging folder is removed."""
    import stat

    from lowp.report import UnsafeOutputError

    out = tmp_path / "out"
    out.mkdir()
    (out / "a.csv").write_text("a1")
    os.mkfifo(out / "b.csv")
    with pytest.raises(UnsafeOutputError, match=r"b\.csv.*named pipe"):
        with staged_folder(out) as stage:
            (tmp_path / stage / "a.csv").write_text("a2")
            (tmp_path / stage / "b.csv").write_text("b2")
    assert (out / "a.csv").read_text() == "a1" and stat.S_ISFIFO(os.lstat(out / "b.csv").st_mode)
    assert os.listdir(tmp_path) == ["out"]


@needs_fifo
def test_staged_folder_refuses_an_out_that_is_not_a_folder(tmp_path):
    import stat

    from lowp.report import UnsafeOutputError

    os.mkfifo(tmp_path / "out")
    with pytest.raises(UnsafeOutputError, match="not a folder"):
        with staged_folder(tmp_path / "out") as stage:
            (tmp_path / stage / "a.csv").write_text("a")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "out").st_mode) and os.listdir(tmp_path) == ["out"]


def test_staged_folder_resolves_a_symbolic_link_to_a_folder(tmp_path):
    """The files go into the folder the link points to (the link stays a link), staged next to
    that folder so that ``os.replace`` stays on one file system."""
    real = tmp_path / "elsewhere" / "real"
    real.mkdir(parents=True)
    (tmp_path / "out").symlink_to(real)
    with staged_folder(tmp_path / "out") as stage:
        assert os.path.dirname(stage) == os.path.realpath(real.parent)
        (tmp_path / stage / "a.csv").write_text("a")
    assert os.path.islink(tmp_path / "out") and (real / "a.csv").read_text() == "a"
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "out"] and os.listdir(real.parent) == ["real"]
