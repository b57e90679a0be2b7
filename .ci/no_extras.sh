#!/usr/bin/env bash
# A plain `pip install .` (no extras) in a fresh venv: the main commands must answer without
# a traceback. peft, diffusers, matplotlib and nvidia-ml-py are absent there; transformers is a
# base dependency, so a second pass blocks it too (as if it failed to install) and checks that
# `auto` falls back to the analytic method and `--method trace` refuses in one line.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
PY=${PY:-python3}
start=$(date +%s)
work=$(mktemp -d)
export VRAMPLAN_CACHE_DIR="$work/store"  # (the traces it runs stay out of ~/.cache)
trap 'rm -rf "$work"' EXIT
"$PY" -m venv "$work/venv"
bin="$work/venv/bin"
"$bin/pip" install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
"$bin/pip" install -q . 2>&1 | grep -v "^WARNING: Location" || true
"$bin/python" -c "import vramplan" || { echo "no-extras: install failed"; exit 1; }
echo "no-extras: installed in $(( $(date +%s) - start )) s"
# the compiled core of the replay (setup.py) is built where a C compiler is found: say which runs
"$bin/vramplan" --version
cd "$work"  # run the installed package, not the source tree

expect() {  # expect RC CMD...: exit code RC, and no traceback on stderr
    local want=$1; shift
    local rc=0 t0
    t0=$(date +%s)
    "$@" >"$work/out" 2>"$work/err" || rc=$?
    if [ "$rc" != "$want" ] || grep -q "Traceback" "$work/err"; then
        echo "no-extras: FAILED (exit $rc, wanted $want): ${*:3}"; cat "$work/err"; exit 1
    fi
    echo "no-extras: ok (exit $rc, $(( $(date +%s) - t0 )) s): ${*:3}"
}

run() { expect "$1" env "${@:2}"; }
V="$bin/vramplan"
for pass in with-transformers without-transformers; do
    if [ "$pass" = without-transformers ]; then
        mkdir -p "$work/block"
        cat >"$work/block/sitecustomize.py" <<'PYEOF'
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "huggingface_hub"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Block())
PYEOF
        export PYTHONPATH="$work/block"
    fi
    echo "-- $pass"
    run 0 "$V" estimate llama-3.1-8b
    run 0 "$V" estimate llama-3.1-8b --gpu rtx-4090 --peft lora --checkpointing full
    run 0 "$V" fit llama-3.1-8b --gpu h100-sxm --peft lora --method analytic
    run 0 "$V" plan llama-3.1-8b --gpu rtx-4090 --allow-peft --method analytic
    run 0 "$V" models
    run 0 "$V" gpus
    run 0 "$V" cache
    run 2 "$V" estimate llama-3.1-8b --plot "$work/x.png"
    run 0 "$V" serve-plan llama-3.1-8b --gpu h100-sxm --speculative-config '{"method": "eagle", "num_speculative_tokens": 3}'
    if [ "$pass" = with-transformers ]; then
        run 0 "$V" estimate resnet-50
        # (no Pillow without the models extra: Qwen-VL's image sizing is pure Python since qwen_resize,
        # and the plan is the one a Pillow install prints)
        run 0 "$V" serve-plan qwen2.5-vl-3b --gpu l4 --max-model-len 8192
    else
        run 2 "$V" estimate resnet-50
        run 2 "$V" estimate llama-3.1-8b --method trace
        run 2 "$V" serve-plan qwen2.5-vl-3b --gpu l4 --max-model-len 8192
    fi
done
unset PYTHONPATH
# the compiled core is optional: with no working C compiler the install goes on and the Python
# source runs (setup.py lets each extension fail alone; built from a clean copy of the committed
# source: the repository's build/ folder would otherwise bring earlier builds along)
mkdir -p "$work/src" && git -C "$repo" archive HEAD | tar -x -C "$work/src"
CC=false "$bin/pip" install -q --no-deps --force-reinstall "$work/src" 2>&1 | grep -v "^WARNING: Location" || true
"$bin/vramplan" --version | tee "$work/version"
grep -q "loop not built; keyset not built" "$work/version" || { echo "no-extras: FAILED (no compiler: $(cat "$work/version"))"; exit 1; }
run 0 "$V" estimate llama-3.1-8b --method analytic
echo "no-extras: passed in $(( $(date +%s) - start )) s"
