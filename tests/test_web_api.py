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
LOCAL = "http://127.0.0.1:8765"
"""The page's address (the server answers only to this machine's names)."""
CLI = ["gpt2", "--batch", "2", "--seq", "512", "--gpu", "rtx-4090"]


@pytest.fixture(scope="module")
def client():
    # threads instead of worker processes: the same code path, without spawning interpreters
    app = create_app(executor=cf.ThreadPoolExecutor(max_workers=1), warm=False)
    with TestClient(app, base_url=LOCAL) as c:
        yield c


def cli_json(capsys, *argv):
    assert main(list(argv)) == 0
    out, _ = capsys.readouterr()
    return json.loads(out)


def cli_error(capsys, *argv):
    assert main(list(argv)) == 2
    _, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]  # (after any note: lines)
    assert len(lines) == 1, err
    return lines[0].removeprefix("error: ").strip()


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


def test_the_preference_objectives_reach_the_estimate(client, capsys):
    """The page offers DPO and KTO (issue 32): the query keys are the CLI's flags."""
    for objective, reference in (("dpo", "adapters"), ("kto", "precomputed")):
        q = (f"model=llama-3.2-1b&task=train&batch=2&seq=512&peft=lora&objective={objective}&reference={reference}"
             "&gpu=h100&method=analytic")
        r = client.get(f"/api/estimate?{q}")
        assert r.status_code == 200, r.text
        assert r.json() == cli_json(capsys, "estimate", "llama-3.2-1b", "--task", "train", "--batch", "2", "--seq",
                                    "512", "--peft", "lora", "--objective", objective, "--reference", reference,
                                    "--gpu", "h100", "--method", "analytic", "--json")
        assert r.json()["workload"]["objective"] == objective


def test_a_video_denoisers_frames_reach_the_estimate(client, capsys):
    """The diffusion view's `frames` (issue 32: Wan 2.1's step is a video's) is the CLI's --frames."""
    q = "model=wan2.1-t2v-1.3b&task=infer&frames=10&image-size=256&image-height=160&gpu=h100-sxm&method=trace"
    r = client.get(f"/api/estimate?{q}")
    assert r.status_code == 200, r.text
    got = r.json()
    assert got == cli_json(capsys, "estimate", "wan2.1-t2v-1.3b", "--task", "infer", "--frames", "10", "--image-size",
                           "256", "--image-height", "160", "--gpu", "h100-sxm", "--method", "trace", "--json")
    assert any("9 frames" in n and "rounded" in n for n in got["notes"]), got["notes"]


def test_grpo_with_a_colocated_vllm_reaches_the_estimate(client, capsys):
    """The page offers GRPO's rollout knobs (issue 32); vLLM's start-up refusal is in the answer."""
    base = ("model=llama-3.1-8b&task=train&recipe=trl-grpo&peft=lora&batch=8&seq=1536&prompt=512&rollout=vllm"
            "&gpu=h100&method=analytic")
    flags = ["estimate", "llama-3.1-8b", "--task", "train", "--recipe", "trl-grpo", "--peft", "lora", "--batch", "8",
             "--seq", "1536", "--prompt", "512", "--rollout", "vllm", "--gpu", "h100", "--method", "analytic"]
    r = client.get(f"/api/estimate?{base}")
    assert r.status_code == 200, r.text
    cli = cli_json(capsys, *flags, "--json")
    assert cli.pop("to_fit")["flags"] == "--vllm-max-len 1536"  # (the page's fix is on its Fit tab)
    assert r.json() == cli
    assert not r.json()["fits"] and "max seq len (131072)" in r.json()["refused"]
    r = client.get(f"/api/estimate?{base}&vllm-max-len=1536&vllm-sleep=true")
    assert r.status_code == 200, r.text
    assert r.json() == cli_json(capsys, *flags, "--vllm-max-len", "1536", "--vllm-sleep", "--json")
    assert r.json()["fits"] and "refused" not in r.json()
    # the library's spelling of a page key is not ignored
    r = client.get(f"/api/estimate?{base}&vllm_max_len=1536")
    assert r.status_code >= 400 and "vllm-max-len" in r.text, r.text


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


# ---------------------------------------------------------------------- issue 29, item 7: who may ask, and how much
def _app_client(**kw):
    return TestClient(create_app(executor=cf.ThreadPoolExecutor(max_workers=1), warm=False, **kw), base_url=LOCAL)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8765", "127.0.0.1.evil.example", "localhost.evil"])
def test_a_foreign_host_header_is_refused(client, host):
    # a DNS-rebinding page reaches 127.0.0.1 under its own name: the Host header says which
    for path in ("/", "/api/estimate?model=gpt2&seq=512&method=analytic", "/api/catalog", "/static/app.js"):
        r = client.get(path, headers={"Host": host})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["field"] is None and "answers only to" in r.json()["error"]
    r = client.post("/api/config?name=tiny.json", content=json.dumps(TINY).encode(), headers={"Host": host})
    assert r.status_code == 400


@pytest.mark.parametrize("host", ["127.0.0.1:8765", "localhost:8765", "LOCALHOST", "[::1]:8765", "localhost."])
def test_this_machines_names_are_answered(client, host):
    assert client.get("/api/estimate?model=gpt2&seq=512&method=analytic", headers={"Host": host}).status_code == 200


def test_the_host_given_to_listen_on_is_answered():
    with _app_client(host="192.168.1.7") as c:
        assert c.get("/api/catalog", headers={"Host": "192.168.1.7:8765"}).status_code == 200
        assert c.get("/api/catalog", headers={"Host": "192.168.1.8:8765"}).status_code == 400
    with _app_client(host="gpu-box.lan") as c:
        assert c.get("/api/catalog", headers={"Host": "gpu-box.lan:8765"}).status_code == 200
    with _app_client(host="0.0.0.0") as c:  # every address: any IP, never a name that is not this machine's
        assert c.get("/api/catalog", headers={"Host": "10.1.2.3:8765"}).status_code == 200
        assert c.get("/api/catalog", headers={"Host": "[fe80::1]:8765"}).status_code == 200
        assert c.get("/api/catalog", headers={"Host": "evil.example:8765"}).status_code == 400


def test_a_post_from_another_origin_is_refused(client):
    body = json.dumps(TINY).encode()
    for origin in ("http://evil.example", "http://127.0.0.1:9999", "null"):
        r = client.post("/api/config?name=tiny.json", content=body, headers={"Origin": origin})
        assert r.status_code == 403, origin
        assert r.json()["field"] is None and "origin" in r.json()["error"]
    assert client.post("/api/config?name=tiny.json", content=body, headers={"Origin": LOCAL}).status_code == 200
    assert client.post("/api/config?name=tiny.json", content=body).status_code == 200  # curl sends none


def test_another_sites_scripts_cannot_spend_this_machines_cpu(client):
    # fetch()/<img> from another site: refused; a link opened from another site (navigation): answered
    q = "/api/estimate?model=gpt2&seq=512&method=analytic"
    r = client.get(q, headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"})
    assert r.status_code == 403
    assert client.get(q, headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}).status_code == 200
    assert client.get(q, headers={"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"}).status_code == 200


def test_costly_requests_are_refused_at_once_with_their_field(client):
    import time

    t0 = time.monotonic()
    for q in (f"gpus={2**40}", "gpus=4097"):
        for view in ("plan", "rank"):
            r = client.get(f"/api/{view}?{BASE}&{q}")
            assert r.status_code == 400, r.text
            assert r.json()["field"] == "gpus" and "4,096" in r.json()["error"]
    assert client.get(f"/api/plan?{BASE}&gpus={2**60}").json()["field"] == "gpus"
    deep = {**TINY, "num_hidden_layers": 10_000}
    r = client.post("/api/config?name=deep.json", content=json.dumps(deep).encode())
    assert r.status_code == 400 and r.json()["field"] == "config" and "10,000 layers" in r.json()["error"]
    link = client.get(f"/api/estimate?model=deep.json&config={encode_config(json.dumps(deep))}&method=trace")
    assert link.status_code == 400 and link.json()["field"] == "config"
    wide = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "num_local_experts": 5_000,
            "num_experts_per_tok": 2}
    r = client.post("/api/config?name=wide.json", content=json.dumps(wide).encode())
    assert r.status_code == 400 and "5,000 experts per layer" in r.json()["error"]
    assert time.monotonic() - t0 < 30  # refused, not computed (a 2**40-GPU search held a worker 64 s)
    assert client.get("/api/estimate?model=gpt2&config=" + "A" * 40_000).status_code == 400  # no 40 KB query parsed


def test_a_request_past_the_time_budget_answers_400_and_frees_its_worker():
    # real worker processes: the trace is stopped at the budget, its worker replaced
    app = create_app(workers=1, warm=False, budget_s=0.05)
    with TestClient(app, base_url=LOCAL) as c:
        r = c.get("/api/estimate?model=gpt2&seq=128&method=trace")
        assert r.status_code == 400, r.text
        assert r.json() == {"error": "this request needs more than 0.05 s of work, the page's limit per request "
                                     "(run the same command line in a terminal: it has no such limit)", "field": None}
        status = c.get("/api/status").json()
        assert status["over_budget"] == 1 and status["running"] == 0
        assert c.get("/api/estimate?model=gpt2&seq=128&method=analytic").status_code == 200


# ---------------------------------------------------------------------- issue 29, item 8: errors where they belong
def test_an_error_naming_several_fields_goes_to_the_one_the_user_set():
    from vramplan.errors import VramplanError
    from vramplan.web.params import field_of

    e = VramplanError("the simulated allocator ran out of address space (check the sizes (--batch, --seq, "
                      "--image-size, or the event sizes))")
    assert field_of(e, frozenset({"seq"})) == "seq"
    assert field_of(e, frozenset({"batch", "task"})) == "batch"
    assert field_of(e) is None  # not under --batch because it is named first: above the figures
    assert field_of(e, frozenset({"batch", "seq"})) is None
    assert field_of(VramplanError("bad (use `seq=128`)")) == "seq"


def test_a_trace_that_runs_out_of_address_space_marks_the_sequence(client):
    r = client.get("/api/estimate?model=llama-3.2-1b&seq=1000000000&method=trace")
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "seq", r.json()


def test_a_config_no_one_can_build_is_refused_when_dropped(client):
    evil = {"model_type": "evil", "hidden_size": 64, "num_hidden_layers": 2}
    r = client.post("/api/config?name=evil.json", content=json.dumps(evil).encode())
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "config" and "unknown model_type 'evil'" in r.json()["error"]
    r = client.get(f"/api/estimate?model=evil.json&config={encode_config(json.dumps(evil))}")
    assert r.status_code == 400 and r.json()["field"] == "config"
    resnet = {"model_type": "resnet", "depths": [1, 1], "hidden_sizes": [8, 16], "embedding_size": 8}
    assert client.post("/api/config?name=r.json", content=json.dumps(resnet).encode()).status_code == 200


def test_messages_name_the_page_not_the_command_line(client):
    r = client.get("/api/fit?model=llama-3.1-405b&gpu=rtx-3060&task=train")
    assert r.status_code == 400
    msg = r.json()["error"]
    assert "does not fit" in msg and "the Plans tab" in msg, msg
    assert "vramplan " not in msg and "max_gpus" not in msg and "allow_peft" not in msg
    r = client.get("/api/estimate?model=zzqqxx&method=analytic")
    assert r.json()["field"] == "model" and "vramplan models" not in r.json()["error"]
    assert "type in the model box" in r.json()["error"]
    r = client.get("/api/estimate?model=gpt2&gpu=zzqqxx&method=analytic")
    assert r.json()["field"] == "gpu" and "`vramplan" not in r.json()["error"]


def test_page_wording_of_core_messages():
    from vramplan.errors import PlanError
    from vramplan.web.params import field_of, page_message

    e = PlanError("x does not fit on 1× g", hint="try `vramplan plan x --gpu g` (checkpointing, `allow_peft`, "
                  "`max_gpus=N`); see `vramplan models` for the list; or `vramplan trace model.py`")
    assert page_message(e) == ("x does not fit on 1× g (try the Plans tab (checkpointing, --allow-peft, --gpus N); "
                               "type in the model box to search the catalog; or `vramplan trace model.py` in a terminal)")
    assert field_of(e) is None  # it names two fields, neither set by the request
    assert field_of(e, frozenset({"gpus"})) == "gpus"


# ---------------------------------------------------------------------- issue 29, item 10: serving, all configs
SERVE_CLI = ["serve-plan", "llama-3.1-8b", "--gpu", "h100-sxm"]


@pytest.mark.parametrize(("query", "argv"), [
    ("", []),
    ("&serve-engine=sglang&max-model-len=8192&max-num-seqs=64", ["--engine", "sglang", "--max-model-len", "8192",
                                                           "--max-num-seqs", "64"]),
    ("&tp=2&memory-fraction=0.8&kv-cache-dtype=fp8&avg-request-len=2048",
     ["--tp", "2", "--memory-fraction", "0.8", "--kv-cache-dtype", "fp8", "--avg-request-len", "2048"]),
    ("&serve-engine=tgi&quantization=awq", ["--engine", "tgi", "--quantization", "awq"]),
    ("&engine=fsdp&dp=2&batch=0", []),  # the page sends its other inputs too: the layout's framework, even a bad batch
])
def test_serving_view_is_the_cli_json(client, capsys, query, argv):
    r = client.get(f"/api/serve?model=llama-3.1-8b&gpu=h100-sxm{query}")
    assert r.status_code == 200, r.text
    assert r.json() == cli_json(capsys, *SERVE_CLI, *argv, "--json")


def test_serving_view_takes_speculative_decoding_and_multimodal_limits(client, capsys):
    r = client.get("/api/serve?model=llama-3.1-8b&gpu=h100-sxm&spec-method=eagle&spec-tokens=4")
    assert r.status_code == 200, r.text
    assert r.json() == cli_json(capsys, *SERVE_CLI, "--speculative-config",
                                '{"method": "eagle", "num_speculative_tokens": 4}', "--json")
    assert r.json()["draft_layers"] == 1
    r = client.get("/api/serve?model=qwen2.5-vl-7b&gpu=h100-sxm&limit-videos=0&max-model-len=32768")
    assert r.status_code == 200, r.text
    assert r.json() == cli_json(capsys, "serve-plan", "qwen2.5-vl-7b", "--gpu", "h100-sxm", "--limit-mm-per-prompt",
                                '{"video": 0}', "--max-model-len", "32768", "--json")
    for query, field in (("model=llama-3.1-8b&spec-method=medusa", "spec-method"),
                         ("model=llama-3.1-8b&limit-images=1", "limit-images"),
                         ("model=llama-3.1-8b&spec-method=eagle&spec-tokens=0", "spec-tokens")):
        r = client.get(f"/api/serve?gpu=h100-sxm&{query}")
        assert r.status_code == 400 and r.json()["field"] == field, r.text


def test_serving_view_follows_the_vllm_release_picked(client, capsys):
    """The page's version picker, with vLLM, is serve-plan's --engine-version."""
    r = client.get("/api/serve?model=llama-3.1-8b&gpu=h100-sxm&engine-version=0.10.1.1")
    assert r.status_code == 200, r.text
    assert r.json() == cli_json(capsys, *SERVE_CLI, "--engine-version", "0.10.1.1", "--json")
    assert r.json()["engine_version"] == "0.10.1.1" and r.json()["block_size"] == 16
    assert client.get("/api/serve?model=llama-3.1-8b&gpu=h100-sxm").json()["engine_version"] == "0.34.0"
    r = client.get("/api/serve?model=llama-3.1-8b&gpu=h100-sxm&serve-engine=sglang&engine-version=0.10.1.1")
    assert r.status_code == 400 and r.json()["field"] == "engine-version", r.text  # (a vLLM release is no SGLang one)
    r = client.get("/api/serve?model=llama-3.1-8b&gpu=h100-sxm&kv-offloading-size=8")
    assert r.status_code == 200 and r.json() == cli_json(capsys, *SERVE_CLI, "--kv-offloading-size", "8", "--json")
    assert r.json()["host_kv_tokens"] > 0
    r = client.get("/api/serve?model=llama-3.1-8b&gpu=h100-sxm&kv-offloading-size=8&engine-version=0.12.0")
    assert r.status_code == 400 and r.json()["field"] == "kv-offloading-size", r.text
    versions = client.get("/api/catalog").json()["serve"]["engine_versions"]["vllm"]
    assert versions[0] == "0.34.0" and "0.10.1.1" in versions and versions == sorted(versions, key=lambda v: tuple(
        int(x) for x in v.split(".")), reverse=True)


@pytest.mark.parametrize(("engine", "version"), [("sglang", "0.4.6"), ("tgi", "3.0.0")])
def test_serving_view_follows_the_sglang_and_tgi_release_picked(client, capsys, engine, version):
    """The picker offers each engine's own releases, newest first (what the page starts on, and
    comes back to when the engine changes); the version picked is serve-plan's --engine-version."""
    from vramplan.pools import sglang_release, tgi_release

    offered = client.get("/api/catalog").json()["serve"]["engine_versions"]
    read = {"sglang": sglang_release, "tgi": tgi_release}[engine]
    assert offered[engine] == list(read.RELEASES) and offered[engine][0] == read.NEWEST and version in offered[engine]
    assert offered["trtllm"] == []  # (one release: the picker is off)
    q = f"/api/serve?model=llama-3.1-8b&gpu=h100-sxm&serve-engine={engine}"
    newest = client.get(q).json()
    assert newest == cli_json(capsys, *SERVE_CLI, "--engine", engine, "--format", "json")
    assert newest["engine_version"] == offered[engine][0]
    r = client.get(f"{q}&engine-version={version}")
    assert r.status_code == 200, r.text
    assert r.json() == cli_json(capsys, *SERVE_CLI, "--engine", engine, "--engine-version", version, "--format", "json")
    assert r.json()["engine_version"] == version and r.json()["tokens"] != newest["tokens"]  # (the release changes it)
    for bad in ("0.34.0", "9.9.9", "latest"):  # another engine's release, one past the newest, not a version
        r = client.get(f"{q}&engine-version={bad}")
        assert r.status_code == 400 and r.json()["field"] == "engine-version", r.text
        assert "\n" not in r.json()["error"]


def test_tensorrt_llm_refuses_a_version_as_the_cli_does(client, capsys):
    r = client.get("/api/serve?model=llama-3.1-8b&gpu=h100-sxm&serve-engine=trtllm&engine-version=1.0")
    assert r.status_code == 400 and r.json()["field"] == "engine-version", r.text
    assert "TensorRT-LLM follows one release" in cli_error(capsys, *SERVE_CLI, "--engine", "trtllm", "--engine-version", "1.0")


def test_serving_view_carries_the_terminals_document(client):
    from vramplan.report.serving import to_doc
    from vramplan.serving import serve_plan

    body = client.get("/api/serve?model=llama-3.1-8b&gpu=h100-sxm&doc=1").json()
    doc = to_doc(serve_plan("llama-3.1-8b", "h100-sxm"))
    assert body["doc"]["title"] == doc.title
    first = body["doc"]["sections"][0]
    assert first["kind"] == "table" and first["rows"] == doc.sections[0].rows and first["footer"] == doc.sections[0].footer
    assert [s["title"] for s in body["doc"]["sections"]] == [s.title for s in doc.sections]


@pytest.mark.parametrize(("query", "field"), [
    ("memory-fraction=1.5", "memory-fraction"), ("memory-fraction=x", "memory-fraction"),
    ("tp=3", "tp"), ("max-model-len=10000000", "max-model-len"), ("max-model-len=0", "max-model-len"),
    ("serve-engine=nope", "serve-engine"), ("kv-cache-dtype=int3", "kv-cache-dtype"), ("serve-engine=tgi&pp=2", "pp"),
    ("max-num-seqs=x", "max-num-seqs"), ("gpu=", None), ("engine-version=0.7.3", "engine-version"),
    ("engine-version=latest", "engine-version"),
])
def test_serving_mistakes_are_marked_on_their_field(client, query, field):
    r = client.get(f"/api/serve?model=llama-3.1-8b&gpu=h100-sxm&{query}")
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field, r.json()
    assert "\n" not in r.json()["error"]


def test_every_emit_format_is_offered_and_downloads(client, capsys):
    from vramplan.planner.emit import FORMATS

    assert client.get("/api/catalog").json()["emit_formats"] == list(FORMATS)
    assert len(FORMATS) >= 5
    for fmt in FORMATS:
        r = client.get(f"/api/download/emit?{BASE}&fmt={fmt}&pick=1")
        assert r.status_code == 200, (fmt, r.text)
        assert main(["plan", *CLI, "--method", "analytic", "--emit", fmt, "--pick", "1"]) == 0
        assert r.text == capsys.readouterr()[0], fmt


@pytest.mark.parametrize(("model", "extra"), [
    ("gpt2", []), ("bert-base", []), ("gpt2", ["--task", "generate", "--new-tokens", "24"]), ("llama-3.2-1b", []),
])
def test_without_seq_a_short_model_gets_its_own_length_as_on_the_cli(client, capsys, model, extra):
    q = "&".join(f"{a.removeprefix('--')}={b}" for a, b in zip(extra[::2], extra[1::2], strict=True))
    r = client.get(f"/api/estimate?model={model}&method=analytic&{q}")
    assert r.status_code == 200, r.text
    assert r.json() == cli_json(capsys, "estimate", model, *extra, "--method", "analytic", "--json")
