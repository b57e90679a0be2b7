"""`vramplan snapshot FILE`: formats, --plot, and a malicious pickle that must not run."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from show_fixtures import MiB, recorded_snapshot, training_log
from vramplan.cli.main import main
from vramplan.snapshot.export import write_predicted_snapshot

pytest.importorskip("vramplan.snapshot.reader", reason="the restricted unpickler has not landed yet")


@pytest.fixture()
def snap_file(tmp_path):
    p = tmp_path / "recorded.pickle"
    p.write_bytes(pickle.dumps(recorded_snapshot()))
    return p


def test_table(snap_file, capsys):
    assert main(["snapshot", str(snap_file)]) == 0
    out = capsys.readouterr().out
    for text in ("peak allocated", "14.00 MiB", "Largest allocations", "model.py:1:forward",
                 "Out-of-memory events", "Segments at the reserved peak"):
        assert text in out


def test_json_snapshot_reads_like_the_pickle(snap_file, tmp_path, capsys):
    """The JSON form, gzip-compressed and under a pickle's name, analyses identically."""
    import gzip

    twin = tmp_path / "twin.pickle"
    twin.write_bytes(gzip.compress(json.dumps(recorded_snapshot()).encode()))
    outs = []
    for f in (snap_file, twin):
        assert main(["snapshot", str(f), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        d.pop("file")
        outs.append(d)
    assert outs[0] == outs[1] and outs[0]["peak_allocated"] == 14 * MiB


def test_json_and_markdown(snap_file, capsys):
    assert main(["snapshot", str(snap_file), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["peak_allocated"] == 14 * MiB and d["peak_reserved"] == 20 * MiB
    assert d["breakdown_at_peak"]["activations"] == 8 * MiB and d["file"] == str(snap_file)
    assert main(["snapshot", str(snap_file), "--format", "markdown", "--top", "1"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("### vramplan snapshot") and "| 8.00 MiB | activations |" in md


@pytest.mark.parametrize("suffix", [".png", ".svg", ".html"])
def test_plot(snap_file, tmp_path, capsys, suffix):
    out = tmp_path / f"s{suffix}"
    assert main(["snapshot", str(snap_file), "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000
    assert "plot written" in capsys.readouterr().err


def test_predicted_snapshot_round_trip(tmp_path, capsys):
    p = tmp_path / "predicted.pickle"
    write_predicted_snapshot(training_log(), p)
    assert main(["snapshot", str(p), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["breakdown_at_peak"]["optimizer"] == 86 * MiB and d["rules"] == {"vp": d["rules"]["vp"]}


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_malicious_pickle_does_not_run(tmp_path, capsys):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": _Evil(marker)}))
    assert main(["snapshot", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err
    assert not marker.exists()


@pytest.mark.parametrize("args", [["--top", "0"], ["--plot", "x.jpg"], ["--device", "3"]])
def test_user_mistakes_exit_2(snap_file, capsys, args):
    assert main(["snapshot", str(snap_file), *args]) == 2
    assert "\n" not in capsys.readouterr().err.strip()


def test_missing_and_garbage_files(tmp_path, capsys):
    assert main(["snapshot", str(tmp_path / "nope.pickle")]) == 2
    junk = tmp_path / "junk.pickle"
    junk.write_bytes(b"not a pickle at all")
    assert main(["snapshot", str(junk)]) == 2
    assert capsys.readouterr().err.count("error:") == 2
