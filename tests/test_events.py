import json

import pytest

from vramplan.errors import VramplanError
from vramplan.events import Action, Category, EventLog


def test_roundtrip_jsonl(tmp_path):
    log = EventLog()
    log.alloc(1, 1024, category=Category.PARAMETER, module="layer.0", op="aten.empty", desc="f32[256]")
    log.alloc(2, 4096, stream=1, category=Category.ACTIVATION, phase=1)
    log.free(1)
    log.append(Action.EMPTY_CACHE)
    p = tmp_path / "e.jsonl"
    log.write_jsonl(p)
    back = EventLog.read_jsonl(p)
    assert list(back.rows()) == list(log.rows())
    assert back.strings[back.module[0]] == "layer.0"


def test_issue_format_minimal_rows(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text('{"action": "alloc", "id": 7, "size": 1048576, "stream": 0}\n\n{"action": "free", "id": 7}\n')
    log = EventLog.read_jsonl(p)
    assert list(log.action) == [Action.ALLOC, Action.FREE]
    assert log.size[0] == 1048576


@pytest.mark.parametrize("line,match", [
    ("not json", "not valid JSON"),
    (json.dumps({"action": "explode"}), "unknown action"),
    (json.dumps({"action": "alloc", "id": "x", "size": 1}), "integers"),
    (json.dumps({"action": "alloc", "id": 1, "size": -5}), ">= 0"),
    (json.dumps([1, 2]), "JSON object"),
])
def test_bad_lines_name_the_line(tmp_path, line, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(VramplanError, match=match) as e:
        EventLog.read_jsonl(p)
    assert ":1:" in str(e.value)


def test_extend_reinterns_and_offsets():
    a, b = EventLog(), EventLog()
    a.alloc(1, 10, module="x")
    b.alloc(1, 20, module="y")
    a.extend(b, id_offset=100)
    assert list(a.id) == [1, 101]
    assert [a.strings[i] for i in a.module] == ["x", "y"]


def test_every_category_has_a_bucket():
    from vramplan.results import BREAKDOWN_KEYS

    assert {c.bucket for c in Category} <= set(BREAKDOWN_KEYS)
