"""Bad input to the report tables: a row whose length differs from the headers is an error."""
import pytest

from lowp.report import csv_text, markdown_table, text_table


@pytest.mark.parametrize("table", [text_table, markdown_table, csv_text])
@pytest.mark.parametrize("row", [[1], [1, 2, 3]])
def test_row_length_mismatch_raises(table, row):
    with pytest.raises(ValueError, match=r"rows: expected 2 cells per row .* row 1 has"):
        table(["a", "b"], [[0, 0], row])


@pytest.mark.parametrize("table", [text_table, markdown_table, csv_text])
def test_matching_rows_keep_every_cell(table):
    out = table(["a", "b"], [["x1", "y1"], ["x2", None]])
    assert "x1" in out and "y1" in out and "x2" in out
