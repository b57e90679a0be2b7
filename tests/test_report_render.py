from vramplan.report.doc import Doc, KeyValues, Notes, Table
from vramplan.report.render import to_markdown, to_text


def _doc():
    return Doc("Title", [
        Table(["name", "GiB"], [["a|b", "1.00"], ["c", "2.00"]], footer=["total", "3.00"]),
        KeyValues([("peak phase", "backward")]),
        Notes(["one", "two"]),
    ], subtitle="sub")


def test_markdown_table_is_valid_and_escaped():
    md = to_markdown(_doc())
    lines = md.splitlines()
    assert lines[0] == "### Title"
    header = next(i for i, line in enumerate(lines) if line.startswith("| name"))
    assert lines[header + 1] == "|:--|--:|"
    assert "a\\|b" in md and "**total**" in md and "- **peak phase**: backward" in md
    # every table row has the same number of cells as the header
    rows = [line for line in lines if line.startswith("|")]
    assert len({line.count(" | ") for line in rows if not line.startswith("|:")}) == 1


def test_text_render_has_all_values():
    text = to_text(_doc())
    for s in ("Title", "a|b", "3.00", "backward", "two"):
        assert s in text


def test_brackets_in_cells_are_text_not_rich_markup():
    import io

    from vramplan.report.render import emit

    doc = Doc("T", [Table(["layout", "GiB"], [["[dp] x [tp]", "1.00"]]), KeyValues([("[bold]k", "[red]v")]),
                    Notes(["[dim]n"])])
    buf = io.StringIO()
    emit(doc, "table", buf)
    for text in (to_text(doc), buf.getvalue()):
        assert "[dp] x [tp]" in text and "[bold]k" in text and "[red]v" in text and "[dim]n" in text
