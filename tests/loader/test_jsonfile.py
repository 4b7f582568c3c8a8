"""loader/jsonfile.read_json: each way a JSON file can be bad is an error of the caller's type whose message names
the file (or the caller's label) and the cause."""

from __future__ import annotations

import os

import pytest

from kda_rt.loader.jsonfile import read_json


class NamedError(Exception):
    pass


@pytest.mark.parametrize(("content", "message"), [
    (None, "gone.json: not here"),
    (b"\xff\xfe{}", "gone.json: not valid JSON ('utf-8' codec can't decode"),
    ('{"a": 1,\n  oops}', "gone.json:2:3: not valid JSON (Expecting property name"),
    ("[" * 100_000, "gone.json: not valid JSON (maximum recursion depth exceeded: nested too deeply)"),
    ("1" * 5000, "gone.json: not valid JSON (Exceeds the limit"),
    ("[1, 2]", "gone.json: top level must be a JSON object, got list"),
], ids=["missing", "not-utf8", "syntax", "deep", "long-int", "list"])
def test_each_failure_is_named(tmp_path, content, message):
    path = tmp_path / "gone.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(NamedError) as exc:
        read_json(path, NamedError, missing="not here")
    assert str(exc.value).startswith(str(path)) and message in str(exc.value), str(exc.value)


def test_label_directory_and_non_objects(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"x": [1, 2.5, "s"]}')
    assert read_json(path) == {"x": [1, 2.5, "s"]}
    path.write_text("[3]")
    assert read_json(path, want_object=False) == [3]
    with pytest.raises(ValueError, match=r"^--config 'c\.json': top level must be a JSON object, got list$"):
        read_json(path, label="--config 'c.json'")
    with pytest.raises(ValueError, match=r": cannot read \(Is a directory\)$"):
        read_json(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this OS")
def test_fifo_is_refused_not_read(tmp_path):
    """A named pipe in place of config.json (or any JSON file) is refused at once: opening it for reading would block
    until a writer came."""
    path = tmp_path / "config.json"
    os.mkfifo(path)
    with pytest.raises(NamedError, match=r"config\.json: not a regular file$"):
        read_json(path, NamedError)


def test_dangling_link_is_named_as_one(tmp_path):
    """A link to a missing file (a hub cache snapshot whose blob was pruned) says so (was: the caller's `missing`
    text: config.json 'not found (is DIR a Kimi Linear checkpoint directory?)', which points at the wrong cause)."""
    path = tmp_path / "config.json"
    path.symlink_to(tmp_path / "blobs" / "abc")
    with pytest.raises(NamedError, match=r"config\.json: a link to a missing file$"):
        read_json(path, NamedError, missing="not found (is it a checkpoint directory?)")
