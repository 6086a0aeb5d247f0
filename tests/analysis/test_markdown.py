from leanlm.analysis.markdown import replace_section


def test_replace_section_appends_then_replaces_in_place(tmp_path):
    path = tmp_path / "report.md"
    path.write_text("# Title\n\nintro\n")
    replace_section(path, "serving", "first")
    replace_section(path, "other", "x")
    replace_section(path, "serving", "second\n")
    assert path.read_text() == (
        "# Title\n\nintro\n\n<!-- serving:begin -->\nsecond\n<!-- serving:end -->\n"
        "\n<!-- other:begin -->\nx\n<!-- other:end -->\n"
    )
    replace_section(tmp_path / "new.md", "s", "body")
    assert (tmp_path / "new.md").read_text() == "<!-- s:begin -->\nbody\n<!-- s:end -->\n"
