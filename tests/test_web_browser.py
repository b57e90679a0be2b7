"""The page in a real headless browser (Playwright driving the system's Chromium) against a
real ``vramplan web`` server: choose a model, change the batch, and the page's figures are
those of ``vramplan estimate --json``; the URL round-trips; a bad value shows the CLI's
message beside its field; the trace streams in after a visible "tracing…" state.

Skipped (with the reason) without the playwright wheel or a Chromium at CHROMIUM
(default /usr/bin/chromium). Set VRAMPLAN_ARTIFACTS to keep the screenshot elsewhere than
the test's temporary folder.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytest.importorskip("uvicorn", reason="the web extra is not installed (pip install 'vramplan[web]')")
if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)

from vramplan.cli.main import main  # noqa: E402
from vramplan.units import GiB  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - the local test server
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vramplan.cli.main", "web", "--port", str(port), "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:  # up, and its worker has imported torch
            try:
                if _get(f"{base}/api/status")["warmed"] >= 1:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vramplan web did not start: {proc.stdout.read() if proc.stdout else ''}")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not errors, errors


def cli_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr()[0])


def cli_error(capsys, *argv):
    assert main(list(argv)) == 2
    return capsys.readouterr()[1].removeprefix("error: ").strip()


def renders(pg) -> int:
    return pg.evaluate("window.__vramplan.renders")


def wait_render(pg, before: int) -> None:
    pg.wait_for_function(f"window.__vramplan.renders > {before}", timeout=30_000)


def wait_shown(pg, **workload) -> None:
    """Until the page shows the answer for these workload values (a render of older inputs
    may land first: blur fires the previous field's change event)."""
    cond = " && ".join(f"s.workload[{k!r}] === {json.dumps(v)}" for k, v in workload.items())
    pg.wait_for_function(f"(() => {{ const s = window.__vramplan.shown; return !!s && {cond}; }})()", timeout=30_000)


def figures(pg) -> dict:
    return {k: int(pg.get_attribute(f"#fig-{k.replace('_', '-')}", "data-bytes"))
            for k in ("allocated", "reserved", "device_used")}


def test_choose_model_change_batch_figures_equal_cli(server, page, capsys):
    pg = page
    pg.goto(f"{server}/?gpu=rtx-4090&method=analytic")
    pg.wait_for_function("window.__vramplan.firstAnalyticMs !== null")
    first_ms = pg.evaluate("window.__vramplan.firstAnalyticMs")
    print(f"first analytic answer {first_ms:.0f} ms after navigation start")
    pg.wait_for_selector("#batch")  # the form is built from the catalog's fields

    # choose a model whose 1,024 positions do not hold the default 2,048 tokens: the CLI's message
    pg.fill("#model", "gpt2")
    pg.wait_for_function("document.getElementById('err-seq').textContent.length > 0")
    assert pg.text_content("#err-seq") == cli_error(capsys, "estimate", "gpt2", "--gpu", "rtx-4090", "--method", "analytic")
    assert "invalid" in (pg.get_attribute("#seq", "class") or "")

    pg.fill("#seq", "512")
    wait_shown(pg, seq=512)
    pg.fill("#batch", "4")
    wait_shown(pg, batch=4, seq=512)
    assert "batch=4" in pg.url and "model=gpt2" in pg.url and "seq=512" in pg.url

    want = cli_json(capsys, "estimate", "gpt2", "--batch", "4", "--seq", "512", "--gpu", "rtx-4090",
                    "--method", "analytic", "--json")
    assert figures(pg) == {k: want["peak"][k] for k in ("allocated", "reserved", "device_used")}
    assert pg.text_content("#fig-allocated") == f"{want['peak']['allocated'] / GiB:,.2f} GiB"
    assert pg.text_content("#fig-device-used") == f"{want['peak']['device_used'] / GiB:,.2f} GiB"
    assert pg.get_attribute("#verdict", "data-fits") == str(want["fits"]).lower()
    assert pg.text_content("#max-batch") == str(want["max_batch"])
    # the stacked bar's segments are the breakdown (+ allocator cache, + overhead)
    for key, b in want["breakdown"].items():
        assert pg.locator(f"#bar rect[data-key={key}]").count() == (1 if b else 0), key
    assert pg.text_content("#cli") == "vramplan estimate gpt2 --batch 4 --seq 512 --gpu rtx-4090 --method analytic --json"

    # the URL round-trips: a fresh page on the same address shows the same answer and inputs
    url = pg.url
    other = pg.context.new_page()
    other.goto(url)
    other.wait_for_function("window.__vramplan.renders > 0")
    other.wait_for_selector("#batch")
    assert figures(other) == figures(pg)
    assert other.input_value("#batch") == "4" and other.input_value("#seq") == "512"
    assert other.input_value("#model") == "gpt2" and other.input_value("#gpu") == "rtx-4090"
    assert other.url == url
    other.close()

    # no GPU is a state of its own: the link keeps it
    pg.select_option("#gpu", "")
    pg.wait_for_function("document.getElementById('verdict').textContent === 'no GPU chosen'")
    assert "gpu=&" in pg.url or pg.url.endswith("gpu=")
    other = pg.context.new_page()
    other.goto(pg.url)
    other.wait_for_function("window.__vramplan.renders > 0")
    assert other.text_content("#verdict") == "no GPU chosen"
    other.close()
    pg.select_option("#gpu", "rtx-4090")
    wait_shown(pg, batch=4)

    # a bad value: the CLI's one-line message beside the field, the last good figures stay
    pg.fill("#batch", "0")
    pg.wait_for_function("document.getElementById('err-batch').textContent.length > 0")
    assert pg.text_content("#err-batch") == cli_error(capsys, "estimate", "gpt2", "--batch", "0", "--seq", "512",
                                                      "--method", "analytic")
    assert "stale" in pg.get_attribute("#results", "class") and pg.is_visible("#stale")
    pg.fill("#batch", "3")
    wait_shown(pg, batch=3)
    assert "stale" not in pg.get_attribute("#results", "class") and pg.text_content("#err-batch") == ""


def test_trace_streams_in_and_screenshot(server, page, capsys, tmp_path):
    pg = page
    pg.goto(f"{server}/?model=gpt2&seq=512&batch=2&gpu=rtx-4090")
    pg.wait_for_function("window.__vramplan.firstAnalyticMs !== null")
    analytic = figures(pg)
    pg.wait_for_function("document.getElementById('status').textContent === 'tracing…'", timeout=10_000)
    pg.wait_for_function("window.__vramplan.traces > 0", timeout=180_000)
    want = cli_json(capsys, "estimate", "gpt2", "--seq", "512", "--batch", "2", "--gpu", "rtx-4090", "--json")
    assert want["method"] == "trace"
    assert pg.text_content("#method-used") == "trace"
    assert figures(pg) == {k: want["peak"][k] for k in ("allocated", "reserved", "device_used")}
    assert figures(pg) != analytic
    pg.wait_for_function("document.getElementById('timeline').dataset.kind === 'timeline'", timeout=30_000)
    assert pg.locator("#timeline polygon").count() >= 3
    assert pg.locator("#top-modules tr").count() > 2
    out = Path(os.environ.get("VRAMPLAN_ARTIFACTS", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(out / "web.png"), full_page=False)
    assert (out / "web.png").stat().st_size > 10_000

    # fit, plans and GPUs views; a plan applies with one click
    pg.click("#tabs button[data-tab=fit]")
    pg.wait_for_selector("#fit-max-batch", timeout=30_000)
    fit = cli_json(capsys, "fit", "gpt2", "--seq", "512", "--batch", "2", "--gpu", "rtx-4090", "--method", "analytic", "--json")
    assert pg.text_content("#fit-max-batch") == str(fit["max_batch"])
    pg.click("#tabs button[data-tab=plans]")
    pg.wait_for_selector("table.plans button[data-plan]", timeout=60_000)
    assert pg.locator("table.plans a.btn[href*='fmt=deepspeed']").count() >= 1
    assert pg.locator("#front g.point").count() == pg.locator("table.plans button[data-plan]").count()
    n = renders(pg)
    pg.click("table.plans button[data-plan='0']")
    wait_render(pg, n)
    assert "gpu=rtx-4090" in pg.url


def test_no_tracebacks_or_downloads_of_code(server):
    # the server answers every request in JSON and keeps running
    for path in ("/api/estimate?model=%00", "/api/estimate?model=gpt2&batch=" + "9" * 400, "/api/rank?model=x",
                 "/api/download/emit?model=gpt2&fmt=deepspeed&pick=x"):
        req = urllib.request.Request(server + path)
        try:
            urllib.request.urlopen(req, timeout=60)  # noqa: S310
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
            assert e.code in (400, 500) and "\n" not in body["error"], (path, body)
    assert _get(f"{server}/api/status")["warmed"] >= 1



TINY = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 4096}


def test_dropped_config_travels_in_the_link(server, page, capsys, tmp_path):
    pg = page
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY, indent=2))
    pg.goto(f"{server}/?gpu=rtx-4090&method=analytic&seq=256&batch=2")
    pg.wait_for_selector("#batch")
    pg.set_input_files("#config-file", str(cfg))
    pg.wait_for_function("(() => { const s = window.__vramplan.shown; return !!s && s.model === 'tiny.json'; })()",
                         timeout=30_000)
    assert "config=" in pg.url
    assert "tiny.json" in pg.text_content("#config-info")
    want = cli_json(capsys, "estimate", str(cfg), "--seq", "256", "--batch", "2", "--gpu", "rtx-4090",
                    "--method", "analytic", "--json")
    assert figures(pg) == {k: want["peak"][k] for k in ("allocated", "reserved", "device_used")}
    other = pg.context.new_page()  # the link alone reproduces it
    other.goto(pg.url)
    other.wait_for_function("window.__vramplan.renders > 0")
    assert figures(other) == figures(pg)
    other.close()
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 8}')
    pg.set_input_files("#config-file", str(bad))
    pg.wait_for_function("document.getElementById('err-config').textContent.length > 0")
    assert "missing required key 'model_type'" in pg.text_content("#err-config")


def test_a_model_without_a_formula_is_traced(server, page, capsys):
    pg = page
    pg.goto(f"{server}/?model=resnet-50&gpu=rtx-4090&batch=8")
    pg.wait_for_function("window.__vramplan.traces > 0", timeout=180_000)
    want = cli_json(capsys, "estimate", "resnet-50", "--batch", "8", "--gpu", "rtx-4090", "--json")
    assert want["method"] == "trace"
    assert figures(pg) == {k: want["peak"][k] for k in ("allocated", "reserved", "device_used")}
    assert pg.text_content("#status") == "trace" and not pg.is_visible("#stale")


def test_recipe_fills_the_form_and_an_explicit_value_wins(server, page, capsys):
    pg = page
    pg.goto(f"{server}/?model=llama-3.1-8b&gpu=h100-sxm&method=analytic")
    pg.wait_for_selector("#recipe")
    before = renders(pg)
    pg.select_option("#recipe", "torchtune")
    wait_render(pg, before)
    # the form shows the recipe's defaults, and the answer is the CLI's with --recipe torchtune
    assert pg.input_value("#loss") == "chunked" and pg.is_checked("#optimizer-in-backward")
    assert pg.input_value("#precision") == "bf16"
    wait_shown(pg, recipe="torchtune", loss="chunked", optimizer_in_backward=True)
    want = cli_json(capsys, "estimate", "llama-3.1-8b", "--recipe", "torchtune", "--gpu", "h100-sxm",
                    "--method", "analytic", "--json")
    assert figures(pg) == {k: want["peak"][k] for k in ("allocated", "reserved", "device_used")}
    assert "recipe=torchtune" in pg.url and "loss=" not in pg.url
    # vramplan's own default, given explicitly, beats the recipe's; a switch turned off is sent as off
    pg.click("#more summary")
    pg.select_option("#loss", "full")
    wait_shown(pg, loss="full")
    pg.uncheck("#optimizer-in-backward")
    wait_shown(pg, loss="full", optimizer_in_backward=False)
    assert "loss=full" in pg.url and "optimizer-in-backward=0" in pg.url
    assert pg.text_content("#cli") == ("vramplan estimate llama-3.1-8b --loss full --no-optimizer-in-backward "
                                       "--recipe torchtune --gpu h100-sxm --method analytic --json")
    # back to the plain loop: the recipe's defaults the user kept give way
    pg.select_option("#recipe", "plain")
    wait_shown(pg, recipe="plain")
    assert pg.input_value("#precision") == "auto" and "recipe=" not in pg.url
