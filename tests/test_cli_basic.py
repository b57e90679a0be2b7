import subprocess
import sys

import pytest

from vramplan.cli.main import main


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["estimate"])  # missing MODEL
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def test_bad_choice_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "llama-3.1-8b", "--precision", "fp7"])
    assert e.value.code == 2
    assert "\n" not in capsys.readouterr().err.strip()


def test_console_script_starts_without_torch():
    code = "import sys; from vramplan.cli.main import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _commands(parser) -> list[str]:
    import argparse

    return list(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


def test_a_command_line_builds_only_its_subcommand_and_help_lists_all(capsys):
    from vramplan.cli.main import build_parser

    everything = _commands(build_parser())
    assert {"estimate", "fit", "plan", "serve-plan"} <= set(everything)
    assert _commands(build_parser(["estimate", "gpt2"])) == ["estimate"]
    # --help first, or a command whose name is not its module's: every subcommand is built
    assert _commands(build_parser(["--help", "estimate"])) == everything
    assert _commands(build_parser(["serve-plan"])) == everything
    with pytest.raises(SystemExit) as e:
        main(["--help", "estimate"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in everything)


def test_version_is_looked_up_only_when_asked(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("vramplan ")
    code = ("import sys; from vramplan.cli.main import build_parser; build_parser(); "
            "print('importlib.metadata' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
