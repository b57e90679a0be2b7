"""The web page's endpoints, through Starlette's TestClient: the same JSON as the CLI's --json,
the CLI's one-line messages tagged with the field, no crash on any request."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import threading

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from vramplan.cli.main import main  # noqa: E402
from vramplan.web import work  # noqa: E402
from vramplan.web.app import create_app  # noqa: E402
from vramplan.web.jobs import Jobs, Stale  # noqa: E402
from vramplan.web.params import encode_config, fields, parse_workload  # noqa: E402
from vramplan.workload import Parallel, Workload  # noqa: E402

BASE = "model=gpt2&batch=2&seq=512&gpu=rtx-4090"
CLI = ["gpt2", "--batch", "2", "--seq", "512", "--gpu", "rtx-4090"]


@pytest.fixture(scope="module")
def client():
    # threads instead of worker processes: the same code path, without spawning interpreters
    app = create_app(executor=cf.ThreadPoolExecutor(max_workers=1), warm=False)
    with TestClient(app) as c:
        yield c


def cli_json(capsys, *argv):
    assert main(list(argv)) == 0
    out, _ = capsys.readouterr()
    return json.loads(out)


def cli_error(capsys, *argv):
    assert main(list(argv)) == 2
    _, err = capsys.readouterr()
    assert err.startswith("error: ")
    return err.removeprefix("error: ").strip()


def test_estimate_is_the_cli_json(client, capsys):
    r = client.get(f"/api/estimate?{BASE}&method=analytic")
    assert r.status_code == 200
    assert r.json() == cli_json(capsys, "estimate", *CLI, "--method", "analytic", "--json")


def test_workload_flags_reach_the_estimate(client, capsys):
    q = ("model=llama-3.2-1b&task=train&batch=3&seq=1024&precision=bf16&optimizer=adamw-8bit&checkpointing=full"
         "&peft=lora&lora-rank=8&lora-targets=all-linear&gpu=a100-80gb&dp=2&zero=2&method=analytic")
    r = client.get(f"/api/estimate?{q}")
    assert r.status_code == 200, r.text
    expected = cli_json(capsys, "estimate", "llama-3.2-1b", "--task", "train", "--batch", "3", "--seq", "1024",
                        "--precision", "bf16", "--optimizer", "adamw-8bit", "--checkpointing", "full",
                        "--peft", "lora", "--lora-rank", "8", "--lora-targets", "all-linear", "--gpu", "a100-80gb",
                        "--dp", "2", "--zero", "2", "--method", "analytic", "--json")
    assert r.json() == expected


def test_trace_estimate_timeline_and_snapshot(client, capsys, tmp_path):
    q = "model=gpt2&batch=1&seq=128&gpu=rtx-4090&method=trace"
    r = client.get(f"/api/estimate?{q}")
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["method"] == "trace"
    assert got == cli_json(capsys, "estimate", "gpt2", "--batch", "1", "--seq", "128", "--gpu", "rtx-4090",
                           "--method", "trace", "--json")
    t = client.get(f"/api/timeline?{q}").json()
    assert t["kind"] == "timeline" and len(t["x"]) > 10
    # the stacked tensor bytes peak just below the allocated peak (+ overhead): the allocator's
    # rounding is in the peak, not in the per-tensor timeline
    totals = [sum(col[i] for col in t["stacked"].values()) for i in range(len(t["x"]))]
    top = got["peak"]["allocated"] + got["breakdown"]["overhead"]
    assert 0.98 * top <= max(totals) <= top
    assert max(t["lines"]["reserved + overhead"]) == got["peak"]["reserved"] + got["breakdown"]["overhead"]
    assert t["levels"] == {f"{got['gpu']['full_name']} usable": got["gpu"]["usable"]}
    snap = client.get(f"/api/download/snapshot?{q}")
    assert snap.status_code == 200
    assert "attachment" in snap.headers["content-disposition"]
    path = tmp_path / "s.pickle"
    path.write_bytes(snap.content)
    from vramplan.snapshot.reader import load_snapshot

    loaded = load_snapshot(path)
    assert loaded["device_traces"][0] and loaded["segments"]


def test_analytic_timeline_is_the_plot_data(client):
    from vramplan.report.plot import report_data

    t = client.get(f"/api/timeline?{BASE}&method=analytic").json()
    import vramplan

    rep = vramplan.estimate("gpt2", Workload(batch=2, seq=512), gpu="rtx-4090", method="analytic")
    d = report_data(rep)
    assert t["kind"] == "phases"
    assert t["stacked"] == {k: list(v) for k, v in d.stacked.items()}
    assert [s[2] for s in t["spans"]] == [str(p.phase) for p in rep.phases]


def test_fit_and_plan_are_the_cli_json(client, capsys):
    r = client.get(f"/api/fit?{BASE}")
    assert r.status_code == 200, r.text
    assert r.json() == cli_json(capsys, "fit", *CLI, "--method", "analytic", "--json")
    r = client.get(f"/api/plan?{BASE}&sort=cost")
    assert r.status_code == 200, r.text
    assert r.json() == cli_json(capsys, "plan", *CLI, "--method", "analytic", "--sort", "cost", "--json")


def test_gpu_ranking_is_the_cli_json(client, capsys):
    r = client.get(f"/api/rank?{BASE}&gpus=1")
    assert r.status_code == 200, r.text
    got = r.json()
    assert got == cli_json(capsys, "plan", "gpt2", "--batch", "2", "--seq", "512", "--rank-gpus", "--gpus", "1",
                           "--method", "analytic", "--json")
    assert got["ranked"] and all(o["fits"] for o in got["ranked"])


def test_emitted_config_is_the_cli_text(client, capsys):
    r = client.get(f"/api/download/emit?{BASE}&fmt=deepspeed&pick=1")
    assert r.status_code == 200, r.text
    assert "ds_config" in r.headers["content-disposition"]
    assert main(["plan", *CLI, "--method", "analytic", "--emit", "deepspeed", "--pick", "1"]) == 0
    out, _ = capsys.readouterr()
    assert r.text == out
    bad = client.get(f"/api/download/emit?{BASE}&fmt=yaml")
    assert bad.status_code == 400 and bad.json()["field"] == "fmt"


def test_report_download(client, capsys):
    r = client.get(f"/api/download/report?{BASE}&method=analytic")
    assert r.status_code == 200
    assert r.headers["content-disposition"] == 'attachment; filename="vramplan-gpt2.json"'
    assert json.loads(r.content) == cli_json(capsys, "estimate", *CLI, "--method", "analytic", "--json")


@pytest.mark.parametrize(("query", "argv", "field"), [
    ("batch=0", ["--batch", "0"], "batch"),
    ("zero=5", ["--zero", "5"], "zero"),
    ("gpu=h1000", ["--gpu", "h1000"], "gpu"),
    ("seq=4096", ["--seq", "4096"], "seq"),
    ("task=infer&peft=lora", ["--task", "infer", "--peft", "lora"], "task"),
    ("checkpoint-fraction=1.5", ["--checkpoint-fraction", "1.5"], "checkpoint-fraction"),
])
def test_bad_input_is_the_cli_message_beside_its_field(client, capsys, query, argv, field):
    r = client.get(f"/api/estimate?model=gpt2&method=analytic&{query}")
    assert r.status_code == 400
    body = r.json()
    assert body["field"] == field
    assert body["error"] == cli_error(capsys, "estimate", "gpt2", "--method", "analytic", *argv)
    assert "\n" not in body["error"]


@pytest.mark.parametrize(("query", "field", "words"), [
    ("model=gpt3", "model", "did you mean gpt2"),
    ("model=/etc/passwd", "model", "unknown model"),  # no local paths from a page
    ("model=someone/some-model", "model", "unknown model"),  # no Hub downloads
    ("model=gpt2&batch=two", "batch", "--batch must be an integer, got 'two'"),
    ("model=gpt2&seq=128&batch=" + "9" * 400, "batch", "is too large"),
    ("model=gpt2&sp=maybe", "sp", "--sp is on or off"),
    ("model=gpt2&method=guess", "method", "invalid method"),
    ("model=gpt2&config=%%%", "config", "damaged"),
    ("", "model", "no model chosen"),
    ("model=resnet-50&method=analytic", "method", "not a transformer the analytic method knows"),
])
def test_bad_query_values(client, query, field, words):
    r = client.get(f"/api/estimate?{query}")
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field
    assert words in r.json()["error"]


def test_search_options_are_checked(client):
    for q, field in (("gpus=0", "gpus"), ("budget=-1", "budget"), ("budget=x", "budget"), ("sort=fast", "sort")):
        r = client.get(f"/api/plan?{BASE}&{q}")
        assert r.status_code == 400 and r.json()["field"] == field, r.text
    r = client.get("/api/fit?model=gpt2&seq=512")
    assert r.status_code == 400 and "needs a GPU" in r.json()["error"]


TINY = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 4096}


def test_config_upload_is_data_and_round_trips_through_the_link(client, capsys, tmp_path):
    r = client.post("/api/config?name=tiny.json", content=json.dumps(TINY, indent=2).encode())
    assert r.status_code == 200, r.text
    up = r.json()
    assert up["name"] == "tiny.json" and up["family"] == "dense" and up["params"] > 0
    est = client.get(f"/api/estimate?model=tiny.json&config={up['config']}&batch=2&seq=256&method=analytic")
    assert est.status_code == 200, est.text
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    expected = cli_json(capsys, "estimate", str(path), "--batch", "2", "--seq", "256", "--method", "analytic", "--json")
    got = est.json()
    assert got["model"] == "tiny.json" and expected["model"] == str(path)
    assert {**got, "model": None} == {**expected, "model": None}
    assert up["config"] == encode_config(json.dumps(TINY, separators=(",", ":")))


@pytest.mark.parametrize(("body", "words"), [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "must hold a JSON object"),
    (b'{"hidden_size": 8}', "missing required key 'model_type'"),
    (b"\xff\xfe\x00", "not UTF-8"),
    (b" " * (256 * 1024 + 1), "accepts up to"),
    (json.dumps({**TINY, "auto_map": {"AutoModel": "evil.Model"}, "hidden_size": "big"}).encode(), "config"),
])
def test_bad_uploads_are_refused_with_one_line(client, body, words):
    r = client.post("/api/config", content=body)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "config"
    assert words in r.json()["error"]
    assert "\n" not in r.json()["error"]


def test_an_internal_error_is_500_with_one_line(client, monkeypatch):
    def boom(q):
        raise RuntimeError("kaboom\nsecond line")

    monkeypatch.setattr(work, "_estimate", boom)
    r = client.get("/api/estimate?model=gpt2&seq=512&batch=7&method=analytic")
    assert r.status_code == 500
    assert r.json()["error"] == "internal error (RuntimeError: kaboom)"
    monkeypatch.undo()
    assert client.get("/api/estimate?model=gpt2&seq=512&batch=7&method=analytic").status_code == 200


def _boot(html: str) -> dict:
    start = html.index('<script id="boot" type="application/json">') + len('<script id="boot" type="application/json">')
    return json.loads(html[start:html.index("</script>", start)])


def test_the_page_carries_its_first_answer(client, capsys):
    r = client.get(f"/?{BASE}")
    assert r.status_code == 200
    boot = _boot(r.text)
    assert boot["first"] == {"status": 200, "body": cli_json(capsys, "estimate", *CLI, "--method", "analytic", "--json")}
    assert boot["catalog"] == client.get("/api/catalog").json()
    assert boot["defaults"]["model"] in {m["alias"] for m in boot["catalog"]["models"]}
    # style and script are inlined (one response), and still served as files
    for name in ("app.js", "style.css"):
        f = client.get(f"/static/{name}")
        assert f.status_code == 200 and f.text.strip()[:200] in r.text
    bad = _boot(client.get("/?model=gpt2&batch=0").text)["first"]
    assert bad == {"status": 400, "body": {"error": "--batch must be a positive integer, got 0", "field": "batch"}}
    assert _boot(client.get("/").text)["first"]["status"] == 200  # the defaults give an answer


def test_page_and_static_files(client):
    cat = client.get("/api/catalog").json()
    assert {m["alias"] for m in cat["models"]} >= {"gpt2", "llama-3.1-8b"}
    assert any(g["key"] == "rtx-4090" for g in cat["gpus"])
    assert [f["key"] for f in cat["fields"]] == [f.key for f in fields()]
    assert client.get("/api/nothing").status_code == 404


def test_every_workload_field_has_a_query_key():
    import dataclasses

    names = {f.name for f in fields()}
    assert names == ({f.name for f in dataclasses.fields(Workload)} - {"parallel"}) | {
        f.name for f in dataclasses.fields(Parallel)}
    w = Workload(task="train", batch=3, seq=100, precision="bf16", checkpointing="full", peft="qlora",
                 lora_targets=("all-linear",), parallel=Parallel(dp=4, zero=3, offload_params=True))
    q = {}
    for f in fields():
        v = getattr(w.parallel if f.parallel else w, f.name)
        q[f.key] = ",".join(v) if isinstance(v, tuple) else ("1" if v is True else "0" if v is False else str(getattr(v, "value", v)))
    assert parse_workload(q) == w


def test_a_newer_job_cancels_the_waiting_one():
    gate = threading.Event()
    pool = cf.ThreadPoolExecutor(max_workers=1)
    jobs = Jobs(pool)

    def slow(x):
        gate.wait(10)
        return work.Outcome(value=x)

    async def scenario():
        first = asyncio.ensure_future(jobs.run("trace", "a", slow, 1))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(jobs.run("trace", "b", slow, 2))  # waits behind the first
        await asyncio.sleep(0.05)
        third = asyncio.ensure_future(jobs.run("trace", "c", slow, 3))  # the user moved on again
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(first, second, third, return_exceptions=True)

    a, b, c = asyncio.run(scenario())
    pool.shutdown()
    assert a.value == 1  # already running: finishes, and is cached
    assert isinstance(b, Stale)
    assert c.value == 3
    assert jobs.cached("a").value == 1 and jobs.cached("b") is None


def test_cli_web_refuses_a_bad_port(capsys):
    import socket

    assert main(["web", "--port", "0"]) == 2
    assert "--port" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["web", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot listen on 127.0.0.1:") and "--port" in err


def test_a_dead_worker_is_replaced():
    import os

    jobs = Jobs(workers=1)  # real spawned worker processes

    async def scenario():
        dead = await jobs.run("trace", "die", os._exit, 3)
        alive = await jobs.run("trace", "ok", work.Outcome, 5)
        return dead, alive

    try:
        dead, alive = asyncio.run(scenario())
    finally:
        jobs.close()
    assert dead.bug and "worker process stopped" in dead.error
    assert alive.value == 5


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vramplan.errors import WorkloadError  # noqa: E402


@st.composite
def workloads(draw):
    kw = {}
    for f in fields():
        if not draw(st.booleans()):
            continue
        if f.kind == "enum":
            kw[f.name] = draw(st.sampled_from(f.choices))
        elif f.kind == "bool":
            kw[f.name] = draw(st.booleans())
        elif f.kind == "int":
            kw[f.name] = draw(st.integers(0, 4096))
        elif f.kind == "float":
            kw[f.name] = draw(st.floats(0.05, 1.0))
        elif f.kind == "list":
            kw[f.name] = tuple(draw(st.lists(st.sampled_from(["q_proj", "v_proj", "all-linear"]), min_size=1, max_size=3)))
    par = {f.name: kw.pop(f.name) for f in fields() if f.parallel and f.name in kw}
    try:
        w = Workload(**kw, parallel=Parallel(**par))
    except WorkloadError:
        return Workload()
    from vramplan.recipes import allows

    return w if allows(w) else Workload()  # a knob its recipe cannot run is refused by the form, by design


def _as_query(w: Workload) -> dict[str, str]:
    q = {}
    for f in fields():
        v = getattr(w.parallel if f.parallel else w, f.name)
        if isinstance(v, tuple):
            q[f.key] = ",".join(v)
        elif isinstance(v, bool):
            q[f.key] = "1" if v else "0"
        else:
            q[f.key] = str(getattr(v, "value", v))
    return q


@given(workloads())
def test_query_round_trips_any_valid_workload(w):
    assert parse_workload(_as_query(w)) == w


def test_field_of_reads_an_errors_own_field():
    from vramplan.errors import VramplanError
    from vramplan.web.params import field_of

    class Tagged(VramplanError):
        def __init__(self, msg, field):
            super().__init__(msg)
            self.field = field

    assert field_of(Tagged("x", "lora_rank")) == "lora-rank"
    assert field_of(Tagged("x", "parallel.dp")) == "dp"
    assert field_of(Tagged("bad --seq", "no_such_thing")) == "seq"  # falls back to the message
    assert field_of(VramplanError("invalid ZeRO stage 7")) == "zero"
    assert field_of(VramplanError("something else")) is None
