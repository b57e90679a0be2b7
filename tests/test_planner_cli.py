"""`vramplan fit` / `vramplan plan` end to end (analytic method: fast, real catalogs) and the
report docs for fit / plan / ranking."""

from __future__ import annotations

import json

import pytest

from test_planner_fakes import GPUS, INSTANCES, LLAMA, SMALL, screen_for
from vramplan.cli.main import main
from vramplan.planner.fit import fit
from vramplan.planner.plan import plan
from vramplan.planner.rank import rank_gpus
from vramplan.report.plan import PLAN_COLUMNS, fit_doc, plan_doc, ranking_doc
from vramplan.report.render import to_markdown, to_text
from vramplan.workload import Workload


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_fit_json_fields(capsys):
    code, out, _ = _run(capsys, "fit", "llama-3.1-8b", "--gpu", "h100-sxm", "--peft", "lora",
                        "--checkpointing", "full", "--method", "analytic", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["max_batch"] >= 1 and d["max_seq"] >= 2048
    assert d["evaluations"]["traces"] == 0 and d["evaluations"]["total"] >= 2
    at = d["boundary"]["batch"]["at"]
    assert at["device_used"] <= d["usable"] < d["boundary"]["batch"]["above"]["device_used"]


def test_fit_table_and_markdown(capsys):
    for fmt in ("table", "markdown"):
        code, out, _ = _run(capsys, "fit", "llama-3.2-1b", "--gpu", "h100-sxm", "--method", "analytic",
                            "--format", fmt)
        assert code == 0 and "max batch" in out and "max seq" in out


def test_fit_without_gpu_is_one_line_exit_2(capsys):
    code, _, err = _run(capsys, "fit", "llama-3.1-8b", "--method", "analytic")
    assert code == 2 and err.startswith("error: fit needs a GPU") and err.count("\n") == 1


def test_plan_json_and_table(capsys):
    code, out, _ = _run(capsys, "plan", "llama-3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--method",
                        "analytic", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["candidates"] >= 200 and d["plans"] and all(p["fits"] for p in d["plans"])
    assert all(p["usd_per_hour"] is not None and p["price_source"] for p in d["plans"])
    code, out, _ = _run(capsys, "plan", "llama-3.1-8b", "--gpu", "h100-sxm", "--method", "analytic",
                        "--format", "markdown")
    assert code == 0 and "| # | plan |" in out and "price from runpod" in out


def test_plan_emit_deepspeed_prints_only_json_on_stdout(capsys):
    code, out, err = _run(capsys, "plan", "llama-3.1-8b", "--gpu", "a100-sxm4-80gb", "--gpus", "8",
                          "--method", "analytic", "--emit", "deepspeed")
    assert code == 0
    cfg = json.loads(out)
    assert "zero_optimization" in cfg and cfg["train_micro_batch_size_per_gpu"] >= 1
    assert err.startswith("plan 1: ")


def test_plan_impossible_target_is_one_line_exit_2(capsys):
    code, out, err = _run(capsys, "plan", "llama-3.1-70b", "--gpu", "rtx-4060", "--method", "analytic")
    assert code == 2 and out == ""
    assert err.startswith("error: no plan fits on 1× rtx-4060") and "nearest:" in err and err.count("\n") == 1


def test_plan_budget_too_low_and_unpriced(capsys):
    code, _, err = _run(capsys, "plan", "llama-3.1-8b", "--gpu", "h100-sxm", "--method", "analytic",
                        "--budget", "0.5")
    assert code == 2 and "cheapest that fits" in err
    code, _, err = _run(capsys, "plan", "llama-3.2-1b", "--gpu", "rtx-4060", "--method", "analytic",
                        "--budget", "1")
    assert code == 2 and "no on-demand price" in err


def test_plan_bad_numbers_exit_2(capsys):
    for argv in (["--gpus", "0"], ["--budget", "-1"], ["--global-batch", "0"], ["--pick", "999", "--emit", "fsdp"]):
        code, _, err = _run(capsys, "plan", "llama-3.2-1b", "--gpu", "h100-sxm", "--method", "analytic", *argv)
        assert code == 2 and err.startswith("error:"), argv


def test_rank_gpus_json(capsys):
    code, out, _ = _run(capsys, "plan", "llama-3.2-1b", "--rank-gpus", "--method", "analytic", "--json")
    assert code == 0
    d = json.loads(out)
    costs = [r["usd_per_mtok"] for r in d["ranked"] if r["usd_per_mtok"] is not None]
    assert costs == sorted(costs) and d["price_sources"]


# ---------------------------------------------------------------------------- docs on fakes
def test_docs_render_in_every_format():
    from test_planner_fakes import H100, FakeEstimator

    f = fit(SMALL, Workload(), gpu=H100, method="trace", estimator=FakeEstimator())
    p = plan(SMALL, Workload(batch=2), gpu=H100, screen=screen_for(SMALL), instances=INSTANCES, max_gpus=8)
    r = rank_gpus(LLAMA, Workload(batch=1), gpus=list(GPUS.values()), instances=INSTANCES,
                  screen=screen_for(LLAMA), method="analytic")
    for doc in (fit_doc(f), plan_doc(p, top=5), ranking_doc(r)):
        text, md = to_text(doc, width=200), to_markdown(doc)
        assert doc.title in text and doc.title in md
    table = plan_doc(p, top=5).sections[0]
    assert table.columns == PLAN_COLUMNS and len(table.rows) == min(5, len(p.plans))
    assert all(len(row) == len(PLAN_COLUMNS) for row in table.rows)
    assert "traces" in to_text(fit_doc(f), width=200)


@pytest.mark.parametrize("argv", [["fit", "--help"], ["plan", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and "--gpu" in capsys.readouterr().out
