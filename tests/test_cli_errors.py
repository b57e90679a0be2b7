"""Core errors name library fields; the CLI rewrites them into its flags (one mapping, read off
the parser)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from vramplan.cli.main import build_parser, flag_names, main
from vramplan.errors import FIELD_REF, VramplanError, WorkloadError, with_flags
from vramplan.workload import Parallel, Workload

CORE = Path(__file__).resolve().parents[1] / "src" / "vramplan"


def test_with_flags_rewrites_bare_and_valued_references():
    flags = {"tp": "--tp", "sp": "--sp", "method": "--method", "allow_peft": "--allow-peft"}.get
    text = "set `tp=2` or more, or drop `sp`; use `method='trace'`; add `allow_peft=True`; `other` stays"
    assert with_flags(text, flags) == ("set --tp 2 or more, or drop --sp; use --method trace; add --allow-peft; "
                                       "`other` stays")


def test_library_sees_fields_and_the_field_attribute():
    with pytest.raises(WorkloadError) as e:
        Parallel(sp=True)
    assert e.value.field == "sp"
    assert "--" not in str(e.value) and "`tp=2`" in str(e.value)
    with pytest.raises(WorkloadError) as e:
        Workload(optimizer="adamm")
    assert e.value.field == "optimizer" and str(e.value).startswith("invalid `optimizer` 'adamm'")


def test_render_keeps_one_line():
    err = VramplanError("`batch` must be\n positive", hint="use `batch=1`", field="batch")
    assert err.render({"batch": "--batch"}.get) == "--batch must be positive (use --batch 1)"


def test_flag_names_follow_the_parser_dests():
    parser = build_parser()
    plan = flag_names(parser, ["plan", "gpt2"])
    assert plan["max_gpus"] == "--gpus" and plan["new_tokens"] == "--new-tokens"
    assert plan["offload_optimizer"] == "--offload-optimizer"
    rules = flag_names(parser, ["rules", "bandwidth"])
    assert rules["bus_bits"] == "--bus" and rules["rate_gbps"] == "--rate"


@pytest.mark.parametrize("argv, expected", [
    (["estimate", "gpt2", "--batch", "0", "--method", "analytic"], "error: --batch must be a positive integer, got 0"),
    (["estimate", "gpt2", "--sp", "--method", "analytic"], "(set --tp 2 or more, or drop --sp)"),
    (["estimate", "llama-3.2-1b", "--tp", "3", "--method", "analytic"], "error: --tp 3 does not divide"),
    (["plan", "gpt2", "--gpu", "h100", "--gpus", "0"], "error: --gpus must be positive"),
    (["rules", "bandwidth", "--bus", "0", "--rate", "21"], "error: --bus must be a positive number of bits"),
    # issue 12: layouts against GPUs, heads, layers; world size 0; HSDP and engine contradictions
    (["plan", "llama-3.2-1b", "--gpu", "h100", "--gpus", "6", "--tp", "4", "--method", "analytic"],
     "error: tp × pp × cp = 4 × 1 × 1 = 4 GPUs does not divide --gpus 6 (use --gpus of 4, 8, 12"),
    (["plan", "llama-3.2-1b", "--gpu", "h100", "--gpus", "4", "--dp", "4", "--tp", "2", "--method", "analytic"],
     "exceeds --gpus 4 (use --gpus 8, or --dp 2)"),
    (["gpu", "h100", "--world-size", "0"], "error: --world-size must be a positive integer, got 0 (use --world-size 1"),
    (["estimate", "llama-3.2-1b", "--dp", "0", "--method", "analytic"], "error: --dp must be a positive integer"),
    (["estimate", "llama-3.2-1b", "--pp", "20", "--method", "analytic"],
     "error: 20 pipeline stages cannot be cut from 16 layers"),
    (["estimate", "llama-3.2-1b", "--dp", "6", "--zero", "3", "--dp-shard", "4", "--method", "analytic"],
     "error: --dp-shard 4 does not divide --dp 6"),
    (["estimate", "llama-3.2-1b", "--dp", "2", "--zero", "1", "--engine", "fsdp", "--method", "analytic"],
     "error: FSDP has no ZeRO-1"),
    (["estimate", "llama-3.2-1b", "--dp", "2", "--zero", "2", "--engine", "ddp", "--method", "analytic"],
     "error: DDP does not shard"),
])
def test_cli_shows_flags(argv, expected, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "`" not in err.replace("`vramplan", "")


def test_core_messages_name_no_flags():
    """Core modules (all but cli/ and report/) raise messages with field names, not --flags."""
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE).as_posix()
        # web/ is a front end like cli/; serving/ (merged at the end of issue 9) is still to convert
        if rel.startswith(("cli/", "report/", "web/", "serving/")):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(Error\(|hint=|tips\.append|notes\.append)", line) and re.search(r"(?<![\w`])--[a-z]", line):
                if "`vramplan " not in line:  # a whole command line quoted as such is fine
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_every_reference_in_core_messages_is_a_field_some_parser_knows():
    """A `name` reference that no command has a flag for would reach CLI users untranslated."""
    known = {a.dest for _, a in _options(build_parser())}
    unknown = set()
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE).as_posix()
        if rel.startswith(("cli/", "report/")):
            continue
        for line in path.read_text().splitlines():
            if re.search(r"(Error\(|hint=)", line):
                for m in FIELD_REF.finditer(line):
                    if " " not in m.group(0):
                        unknown.add(m.group(1))
    assert unknown <= known, sorted(unknown - known)


def _workload_actions(command: str) -> list[argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return [a for a in sub._actions if a.option_strings and a.dest in _WORKLOAD_FIELDS]


_WORKLOAD_FIELDS = {f.name for f in dataclasses.fields(Workload) if f.name != "parallel"} | {
    f.name for f in dataclasses.fields(Parallel)}


@pytest.mark.parametrize("command", ["estimate", "fit", "plan", "trace", "measure"])
def test_every_workload_flag_shows_its_true_default(command):
    from vramplan.workload import field_docs

    docs = field_docs(Workload) | field_docs(Parallel)
    defaults = {f.name: f.default for f in dataclasses.fields(Workload) if f.name != "parallel"} | {
        f.name: f.default for f in dataclasses.fields(Parallel)}
    actions = _workload_actions(command)
    assert {a.dest for a in actions} == _WORKLOAD_FIELDS  # one flag per field, none missing
    for a in actions:
        want = defaults[a.dest]
        if a.dest in ("precision", "checkpointing"):  # resolved per task / PEFT
            want = "auto"
        elif isinstance(want, bool):
            want = "on" if want else "off"
        elif isinstance(want, tuple):
            want = ",".join(want)
        else:
            want = getattr(want, "value", want)
        assert a.help.endswith(f"(default: {want})"), (a.dest, a.help)
        assert docs[a.dest].replace("%", "%%") in a.help
        # the parsed default builds the Workload's own default
        if not isinstance(defaults[a.dest], bool):
            assert str(a.default) == str(want)


def test_default_flags_build_the_default_workload():
    from vramplan.cli.common import workload_from_args

    args = build_parser().parse_args(["estimate", "llama-3.2-1b"])  # gpt2's default seq is its 1024 (issue 29)
    assert workload_from_args(args) == Workload()


def test_notes_name_flags_in_tables_and_fields_in_json(capsys):
    argv = ["plan", "llama-3.2-1b", "--rank-gpus", "--gpu", "h100", "--gpus", "1", "--method", "analytic",
            "--top", "1"]
    assert main(argv) == 0
    assert "left out (raise --gpus)" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    assert "left out (raise `max_gpus`)" in capsys.readouterr().out


def test_docs_render_field_names_outside_the_cli():
    from vramplan.report.doc import Doc, KeyValues, Notes, Table
    from vramplan.report.render import to_markdown, with_field_names

    doc = Doc("t `seq`", [Table(["a"], [["`tp=2`"]], footer=["`sp`"]), KeyValues([("k", "`pp=4`")]),
                          Notes(["use `method=trace`"])])
    assert "use `method=trace`" in to_markdown(doc)  # a library user's rendering: field names
    flags = {"seq": "--seq", "tp": "--tp", "sp": "--sp", "pp": "--pp", "method": "--method"}.get
    md = to_markdown(with_field_names(doc, flags))
    assert "`" not in md and all(x in md for x in ("t --seq", "--tp 2", "--sp", "--pp 4", "use --method trace"))


def _options(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _options(sub, (*prefix, name))
        elif a.option_strings:
            yield prefix, a


def test_every_option_with_a_default_says_it_in_help():
    missing = []
    for prefix, a in _options(build_parser()):
        if (a.help == argparse.SUPPRESS or a.default in (None, False) or a.nargs == 0
                or isinstance(a, (argparse._HelpAction, argparse._VersionAction))):
            continue  # flags (store_true/const) and options without a default
        if "default" not in (a.help or ""):
            missing.append(f"{' '.join(prefix)} {a.option_strings[0]} (default {a.default!r})")
    assert not missing, missing
