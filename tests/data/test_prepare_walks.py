"""Prepare's walk of its sources follows symbolic links, reads each directory once (a link loop
under `**` ends instead of hanging), and never drops input without a word: the summary line
counts the files read and the files skipped, each reason with an example path."""

from __future__ import annotations

import os

import pytest

from ndtrain.data import sources as sources_mod
from ndtrain.data import walk as walk_mod
from ndtrain.data.prepare import main as prepare_main
from ndtrain.data.manifest import read_manifest


def _tree(tmp_path):
    """corpus/ with one file of its own, a symlinked subfolder holding two, two links back to
    corpus/ itself (a loop: Python's glob walks 2^40 paths through two of them) and a file that
    is not text."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "b.txt").write_text("bee " * 20)
    (elsewhere / "c.txt").write_text("sea " * 20)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("ay " * 20)
    (corpus / "notes.bin").write_bytes(b"\0\1")
    os.symlink(elsewhere, corpus / "linked")
    os.symlink(corpus, corpus / "loop1")
    os.symlink(".", corpus / "loop2")
    return corpus


def test_a_symlinked_folder_is_read_and_a_loop_is_reported(tmp_path):
    corpus = _tree(tmp_path)
    skipped = sources_mod.Skipped()
    files, _ = sources_mod.collect([str(corpus)], skipped)
    names = sorted(os.path.basename(f.path) for f in files)
    assert names == ["a.txt", "b.txt", "c.txt"], names  # before: the linked folder's 2 of 3 were dropped
    assert skipped.read == 3
    text = skipped.describe()
    assert "link(s) to a folder already read" in text and "loop" in text, text
    assert "notes.bin" in text, text


@pytest.mark.timeout(60)
def test_a_double_star_glob_through_a_link_loop_ends(tmp_path):
    corpus = _tree(tmp_path)
    skipped = sources_mod.Skipped()
    files, _ = sources_mod.collect([str(corpus / "**" / "*.txt")], skipped)
    # Each file once, whatever the number of ways the loop offers to reach it.
    assert sorted(os.path.basename(f.path) for f in files) == ["a.txt", "b.txt", "c.txt"]
    assert "a loop" in skipped.describe()
    # What Python's glob matches without links, this matches too (hidden names excluded).
    plain = tmp_path / "plain"
    (plain / "x" / "y").mkdir(parents=True)
    (plain / ".hidden").mkdir()
    for rel in ("top.txt", "x/one.txt", "x/y/two.txt", ".hidden/no.txt", "x/.no.txt", "x/y/three.md"):
        (plain / rel).write_text("t")
    import glob

    for pattern in ("**/*.txt", "**", "x/**/*.txt", "*/**/*.md", "x/**/", "**/y/*"):
        want = sorted(os.path.normpath(p) for p in glob.glob(str(plain / pattern), recursive=True))
        got = sorted(os.path.normpath(p) for p in walk_mod.expand(str(plain / pattern), sources_mod.Skipped()))
        assert got == want, pattern


def test_the_summary_line_counts_files_read_and_skipped(tmp_path, capsys):
    corpus = _tree(tmp_path)
    assert prepare_main([str(corpus), "--out", str(tmp_path / "out")]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and line.startswith("prepared ")
    assert "3 file(s) read" in line and "notes.bin" in line and "loop" in line, line
    assert len(read_manifest(tmp_path / "out")["sources"]) == 3


def test_a_broken_link_is_counted_not_a_traceback(tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.txt").write_text("fine " * 10)
    os.symlink(tmp_path / "gone.txt", corpus / "dangling.txt")
    os.symlink(tmp_path / "gone-dir", corpus / "dangling-dir")
    skipped = sources_mod.Skipped()
    files, _ = sources_mod.collect([str(corpus)], skipped)
    assert [os.path.basename(f.path) for f in files] == ["a.txt"]
    text = skipped.describe()
    assert text.startswith("skipped 2 broken link(s)") and "dangling" in text, text
