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
