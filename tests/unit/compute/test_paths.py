"""Where the compute admin operations may read and write (giaannd/compute/paths.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from giaannd.compute.paths import NotAnExport, PathOutside, check_export_target, resolve_inside
from giaannd.errors import InputError
from giaannd.model.export import JSONL_FIELDS, JSONL_FIELDS_V1, is_jsonl_export, write_jsonl
from giaannd.model.rowstore import RowStore
from giaannd.model.train import train_batch
from giaannd.model.vocab import Vocabulary
from tests.oracle.sentences import worked_example


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "allowed" / "sub").mkdir(parents=True)
    (tmp_path / "outside.txt").write_text("secret\n")
    (tmp_path / "allowed" / "in.txt").write_text("ok\n")
    (tmp_path / "allowed" / "link-out").symlink_to(tmp_path / "outside.txt")
    (tmp_path / "allowed" / "link-in").symlink_to(tmp_path / "allowed" / "in.txt")
    (tmp_path / "allowed" / "dir-out").symlink_to(tmp_path)
    return tmp_path / "allowed"


@pytest.mark.parametrize(("value", "expected"), [
    ("in.txt", "in.txt"),
    ("sub/new.jsonl", "sub/new.jsonl"),  # need not exist yet (an export)
    ("./sub/../in.txt", "in.txt"),
    ("link-in", "in.txt"),  # a link that stays inside is followed
    (".", "."),
])
def test_resolve_inside_accepts_paths_that_stay_inside(root: Path, value: str, expected: str) -> None:
    assert resolve_inside(value, root, what="corpus", knob="k") == (root / expected).resolve()
    assert resolve_inside(str(root / value), root, what="corpus", knob="k") == (root / expected).resolve()


@pytest.mark.parametrize("value", [
    "../outside.txt", "link-out", "dir-out/outside.txt", "sub/../../outside.txt", "/etc/passwd",
    "/proc/self/mem", "..",
])
def test_resolve_inside_refuses_paths_that_leave(root: Path, value: str) -> None:
    with pytest.raises(PathOutside) as info:
        resolve_inside(value, root, what="corpus", knob="compute.corpus-dir")
    message = str(info.value)
    assert value in message and str(root) in message and "compute.corpus-dir" in message


def test_resolve_inside_names_where_a_link_leads(root: Path) -> None:
    with pytest.raises(PathOutside, match=r"link-out \(resolves to .*outside\.txt\)"):
        resolve_inside("link-out", root, what="corpus", knob="k")


def test_is_jsonl_export_recognises_export_lines_only(tmp_path: Path) -> None:
    old = '{"source_lemma": "a", "source_word": "b", "segment": 1, "target_lemma": "c", "target_word": "d", ' \
          '"strength": 1.0}\n'
    line = '{"source_lemma": "a", "source_word": "b", "source_prime": false, "segment": 1, "target_lemma": "c", ' \
           '"target_word": "c", "target_prime": true, "strength": 1.0}\n'
    assert JSONL_FIELDS_V1 == ("source_lemma", "source_word", "segment", "target_lemma", "target_word", "strength")
    cases = {"export": (line * 3, True), "export-before-prime-fields": (old * 3, True), "empty": ("", True),
             "token": ("0123456789abcdef\n", False), "json-other": ('{"ring": []}\n', False),
             "reordered": (line.replace('"segment": 1, ', ""), False),
             "old-reordered": (old.replace('"segment": 1, ', ""), False), "binary": ("\x00\xff", False)}
    for name, (text, expected) in cases.items():
        path = tmp_path / name
        path.write_bytes(text.encode("latin-1"))
        assert is_jsonl_export(path) is expected, name


def test_is_jsonl_export_recognises_what_write_jsonl_writes(tmp_path: Path) -> None:
    s = worked_example()
    vocab = Vocabulary()
    for lemma in s.column_lemma:
        vocab.add_column(lemma)
    for t, w in enumerate(s.words):
        if not s.is_concept[t]:
            vocab.add_feature(w)
    path = tmp_path / "x.jsonl"
    assert write_jsonl(RowStore.from_batch(train_batch([s]).rows), vocab, path) > 0
    assert tuple(json.loads(path.read_text().splitlines()[0])) == JSONL_FIELDS
    assert is_jsonl_export(path)


def test_check_export_target(tmp_path: Path) -> None:
    check_export_target(tmp_path / "new.jsonl", overwrite=False)  # new: fine
    (tmp_path / "old.jsonl").write_text("")
    check_export_target(tmp_path / "old.jsonl", overwrite=False)  # empty: a previous (empty) export
    (tmp_path / "notes").write_text("mine\n")
    with pytest.raises(NotAnExport, match="notes exists and is not a previous export"):
        check_export_target(tmp_path / "notes", overwrite=False)
    check_export_target(tmp_path / "notes", overwrite=True)
    with pytest.raises(InputError, match="is a directory"):
        check_export_target(tmp_path, overwrite=True)
    with pytest.raises(InputError, match="does not exist"):
        check_export_target(tmp_path / "no" / "x.jsonl", overwrite=True)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InputError, match="not a regular file"):  # never opened: it would block
        check_export_target(tmp_path / "fifo", overwrite=False)
