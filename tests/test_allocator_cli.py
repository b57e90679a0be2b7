"""`vramplan replay FILE`: event files and snapshots, JSON in integer bytes, one-line errors."""

from __future__ import annotations

import gzip
import json
import pickle

import pytest

from vramplan.cli.main import main

MiB = 1024**2


def run(capsys, *argv):
    code = main(["replay", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def events(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text('{"action": "alloc", "id": 7, "size": 1048576, "stream": 0}\n'
                 '{"action": "alloc", "id": 8, "size": 31457280}\n{"action": "free", "id": 7}\n')
    return p


def test_events_json(capsys, events):
    code, out, _ = run(capsys, events, "--json")
    d = json.loads(out)
    # 1 MiB: small pool, 2 MiB segment; 30 MiB: its own 30 MiB segment
    assert code == 0 and d["max_reserved"] == 32 * MiB and d["max_allocated"] == 31 * MiB
    assert d["segments"] == 2 and d["ooms"] == 0 and d["alloc_retries"] == 0
    assert d["conf"] == "" and d["conf_source"] == "PyTorch defaults"
    assert isinstance(d["fragmentation_at_peak"], float)


def test_events_table_with_conf_and_capacity(capsys, events):
    code, out, _ = run(capsys, events, "--alloc-conf", "expandable_segments:True", "--capacity", "40MiB")
    assert code == 0
    assert "expandable_segments:True" in out and "max_reserved" in out and "ooms" in out


def test_snapshot_comparison(capsys, tmp_path):
    from test_snapshot_reader import hand_trace

    p = tmp_path / "s.pickle.gz"
    p.write_bytes(gzip.compress(pickle.dumps(hand_trace())))
    code, out, _ = run(capsys, p, "--json")
    d = json.loads(out)
    assert code == 0 and d["kind"] == "snapshot" and d["comparison"]["match"]
    assert d["comparison"]["recorded_peak_reserved"] == 52 * MiB == d["max_reserved"]
    code, out, _ = run(capsys, p)
    assert "exact match" in out


def test_snapshot_format_is_read_from_the_content(capsys, tmp_path, events):
    """Pickle, JSON and gzip of either are snapshots whatever their names; a JSON-lines event
    file is events even when named .json or .pickle."""
    from test_snapshot_reader import hand_trace

    snap = hand_trace()
    as_json = json.dumps(snap, indent=1).encode()
    files = {"a.jsonl": pickle.dumps(snap), "b.txt": as_json, "c": gzip.compress(as_json),
             "d.json": b"\xef\xbb\xbf" + json.dumps(snap).encode()}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        code, out, err = run(capsys, tmp_path / name, "--json")
        d = json.loads(out)
        assert code == 0 and d["kind"] == "snapshot" and d["comparison"]["match"], (name, err)
        assert d["comparison"]["matching"] == d["comparison"]["recorded_segment_events"] == 4
    for name in ("events.json", "events.pickle"):
        (tmp_path / name).write_bytes(events.read_bytes())
        code, out, _ = run(capsys, tmp_path / name, "--json")
        assert code == 0 and json.loads(out)["kind"] == "events"


def test_bad_json_snapshot_is_one_line(capsys, tmp_path):
    p = tmp_path / "s.json"
    p.write_text('{"segments": [1, 2,\n')
    code, out, err = run(capsys, p)
    assert code == 2 and "not a readable JSON snapshot" in err and err.count("\n") == 1 and out == ""
    p.write_text('{"segments": "many"}')
    code, out, err = run(capsys, p)
    assert code == 2 and "'segments' is not a list" in err and err.count("\n") == 1


@pytest.mark.parametrize("content,match", [
    (b"not json\n", "not valid JSON"),
    (b"\x80\x04garbage", "not a readable pickle"),
])
def test_bad_files_exit_2_with_one_line(capsys, tmp_path, content, match):
    p = tmp_path / ("bad.jsonl" if content.startswith(b"not") else "bad.pickle")
    p.write_bytes(content)
    code, out, err = run(capsys, p)
    assert code == 2 and match in err and err.count("\n") == 1 and out == ""


def test_missing_file_and_bad_conf(capsys, events, tmp_path):
    code, _, err = run(capsys, tmp_path / "nope.pickle")
    assert code == 2 and "no such file" in err
    code, _, err = run(capsys, events, "--alloc-conf", "max_split_size_mb:10")
    assert code == 2 and "too small" in err and err.count("\n") == 1
