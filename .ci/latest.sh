#!/usr/bin/env bash
# `make test-latest`: the suite's framework tests against the newest releases of the frameworks
# users upgrade to (accelerate, transformers, peft, trl, lightning), one at a time on top of the
# pinned set (requirements/dev-constraints.txt) and then all together, in their own venv. It says
# which ones break; it does not fail (a new release is news, not a regression of ours: pin, fix,
# then move the pin). Needs the package index.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${VENV:-.venv-latest}
PKGS=${PKGS:-"accelerate transformers peft trl lightning"}
TESTS=${TESTS:-"tests/test_script_run.py tests/test_script_launch.py tests/test_emulate.py tests/test_zoo.py tests/test_models_build.py tests/test_loop_knobs.py"}
quiet() { grep -v "^WARNING: Location" || true; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip 2>&1 | quiet
  "$VENV/bin/pip" install -q torch==2.13.0 2>&1 | quiet
fi
"$VENV/bin/pip" install -q -c requirements/dev-constraints.txt -e '.[dev]' 2>&1 | quiet
pinned() { grep -i -E "^$1==" requirements/dev-constraints.txt | cut -d= -f3; }
installed() { "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null; }
run_tests() {  # prints "passed" or "N failed"
  local out
  out=$("$VENV/bin/pytest" -q -p no:cacheprovider -n 2 $TESTS 2>&1 | tail -1)
  if echo "$out" | grep -q "failed\|error"; then echo "$out" | grep -o -E "[0-9]+ (failed|error)[s]?" | paste -sd' '; else echo "passed"; fi
}
report=()
for pkg in $PKGS; do
  "$VENV/bin/pip" install -q -U "$pkg" 2>&1 | quiet
  new=$(installed "$pkg")
  if [ "$new" = "$(pinned "$pkg")" ]; then
    report+=("$pkg $new: the pinned version is the newest")
  else
    report+=("$pkg $(pinned "$pkg") -> $new: $(run_tests)")
  fi
  "$VENV/bin/pip" install -q -c requirements/dev-constraints.txt -e '.[dev]' "$pkg==$(pinned "$pkg")" 2>&1 | quiet
done
# shellcheck disable=SC2086
"$VENV/bin/pip" install -q -U $PKGS 2>&1 | quiet
report+=("all of them together: $(run_tests)")
"$VENV/bin/pip" install -q -c requirements/dev-constraints.txt -e '.[dev]' 2>&1 | quiet
echo "test-latest: the newest releases against the pinned set (requirements/dev-constraints.txt)"
for line in "${report[@]}"; do echo "  $line"; done
