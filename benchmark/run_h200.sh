#!/usr/bin/env bash
# What the device call runs on the H200 (see docs/results.md for the exact `run` tool call).
#
#   bash benchmark/run_h200.sh [parity|speed|tool|demo|fingerprints|wan-parity|wan-speed|wan|
#                               qwen21-unit|qwen21-parity|qwen21-speed|ltx2-unit|ltx2|kernels|
#                               alpha-update|all]
#
# Several targets separated by commas run in one go, in this file's order (one wheel install).
#
# kernels: the fork's train_parity fused-kernel and CUDA-graph unit tests on CUDA (each kernel
# bitwise against its eager chain, every graph replay against the eager forward, with controls),
# then benchmark/gpu_kernels.py (each kernel timed at Qwen-Image's per-block shapes).
# PARITY_ARGS go to gpu_parity.py, SPEED_ARGS to speed.py (e.g. --extra-shapes 512x1,1024x2).
#
# wan: wan-parity, then wan-speed (one device call for both). qwen21-unit: the fork's Qwen-Image 2.1
# unit tests (their whole-forward test needs CUDA); qwen21-parity runs them too. ltx2: the fork's
# LTX-2 unit tests (ltx2-unit: those alone), benchmark/gpu_parity_ltx2.py, then
# `speed.py --family ltx-2`.
#
# demo: `sglang-train-parity demo --device cuda` (DEMO_MODEL_ID: the tiny model, default Qwen-Image,
# e.g. Wan2.2-T2V-A14B-Diffusers), the real `sglang serve` on the GPU (train_parity,
# then default) with benchmark/demo_site's harness in every process (benchmark/server_harness.py);
# not part of `all`; without DEMO_MODEL_ID it also runs `fingerprints` (benchmark/fingerprint_cost.py:
# what per-step rollout fingerprints cost at real Qwen-Image sizes).
#
# alpha-update: benchmark/server_alpha_update.py, the real `sglang serve` (train_parity, CUDA graphs)
# on the tiny Qwen-Image: an adapter pushed twice as the same CUDA tensors over IPC, the second
# time with another lora_alpha (its A/B stay in their storage), each rollout bitwise against the
# trainer's recompute, then a 50-step rollout; not part of `all`.
#
# Needs the carried wheel folder .whl/ (git-ignored; made by benchmark/prepare_wheels.sh): the fork
# built for cp312 from the pinned upstream wheel, diffusers 0.42.1 and the small pure/cp312 packages
# importing sglang's diffusion runtime needs there. Results and logs go to $OUT (the device tool's
# folder that comes back) or /tmp/out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
targets=${1:-all}
wants() { [[ ",$targets," == *",$1,"* ]]; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 3; }
export PYTHONPATH=/tmp/site
{
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
    python3 -m pip list 2>/dev/null | grep -i -E "^(torch|triton|peft|transformers|diffusers|sglang|numpy|safetensors|pydantic|typing.extensions) "
    sha256sum .whl/sglang-*.whl
} 2>&1 | tee "$OUT/env.txt"

rc=0
if wants parity || wants all; then
    timeout "${PARITY_TIMEOUT:-250}" python3 benchmark/gpu_parity.py --out "$OUT/gpu_parity.json" \
        --budget-s "${PARITY_BUDGET:-170}" ${PARITY_ARGS:-} >"$OUT/gpu_parity.log" 2>&1
    prc=$?
    echo "gpu_parity exit $prc"; rc=$((rc | prc))
    grep -E "^(train_parity|alpha96|default) |^default |^stand-in|^passed|^FAILED|^ERROR|Error|error:" "$OUT/gpu_parity.log" | tail -40
fi
if wants wan-parity || wants wan; then
    timeout "${WAN_PARITY_TIMEOUT:-480}" python3 benchmark/gpu_parity_wan.py --out "$OUT/gpu_parity_wan.json" \
        --budget-s "${WAN_PARITY_BUDGET:-380}" ${WAN_PARITY_ARGS:-} >"$OUT/gpu_parity_wan.log" 2>&1
    wrc=$?
    echo "gpu_parity_wan exit $wrc"; rc=$((rc | wrc))
    grep -E "^wan|^passed|^FAILED|Error|error:" "$OUT/gpu_parity_wan.log" | tail -30
fi
if wants qwen21-unit || wants qwen21-parity; then
    # with the stand-ins for the packages the image lacks; the image's own pytest plugins are
    # not for this pytest
    site=$(python3 -c "import sglang, os; print(os.path.dirname(sglang.__file__))")
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "${QWEN21_UNIT_TIMEOUT:-120}" python3 -c 'import sys; sys.path.insert(0, ".")
from benchmark import gpu_standins; gpu_standins.install()
import pytest; sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-c", "/dev/null", "--rootdir", "/tmp", *sys.argv[1:]]))' \
        "$site/multimodal_gen/test/unit/test_qwen_image21_train_parity.py" >"$OUT/qwen21_unit.log" 2>&1
    urc=$?
    echo "qwen21 unit tests exit $urc"; rc=$((rc | urc))
    tail -3 "$OUT/qwen21_unit.log"
fi
if wants qwen21-parity; then
    timeout "${QWEN21_PARITY_TIMEOUT:-400}" python3 benchmark/gpu_parity_qwen21.py --out "$OUT/gpu_parity_qwen21.json" \
        --budget-s "${QWEN21_PARITY_BUDGET:-300}" >"$OUT/gpu_parity_qwen21.log" 2>&1
    qrc=$?
    echo "gpu_parity_qwen21 exit $qrc"; rc=$((rc | qrc))
    grep -E "^qwen-image|^passed|^FAILED|Error|error:" "$OUT/gpu_parity_qwen21.log" | tail -30
fi
if wants qwen21-speed; then
    timeout "${QWEN21_SPEED_TIMEOUT:-540}" python3 benchmark/speed.py --family qwen-image-2.1 \
        --out "$OUT/speed_qwen21.json" --steps "${QWEN21_SPEED_STEPS:-10}" --warmup 2 \
        --variants "${SPEED_VARIANTS:-train_parity,default,diffusers}" >"$OUT/speed_qwen21.log" 2>&1
    src=$?
    echo "speed (qwen-image-2.1) exit $src"; rc=$((rc | src))
    grep -E "median|^variant|^train_parity|^default|^diffusers|_over_|family_gap|step_output|^ERROR|Error" "$OUT/speed_qwen21.log" | tail -30
fi
if wants kernels; then
    site=$(python3 -c "import sglang, os; print(os.path.dirname(sglang.__file__))")
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "${KERNELS_UNIT_TIMEOUT:-240}" python3 -c 'import sys; sys.path.insert(0, ".")
from benchmark import gpu_standins; gpu_standins.install()
import pytest; sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-c", "/dev/null", "--rootdir", "/tmp", *sys.argv[1:]]))' \
        "$site"/multimodal_gen/test/unit/test_train_parity_kernels*.py \
        "$site/multimodal_gen/test/unit/test_train_parity_graphs.py" \
        "$site/multimodal_gen/test/unit/test_side_stream.py" >"$OUT/kernels_unit.log" 2>&1
    krc=$?
    echo "kernel unit tests exit $krc"; rc=$((rc | krc))
    tail -3 "$OUT/kernels_unit.log"
    timeout "${KERNELS_TIMEOUT:-180}" python3 benchmark/gpu_kernels.py --out "$OUT/kernels_h200.json" \
        >"$OUT/gpu_kernels.log" 2>&1
    grc=$?
    echo "gpu_kernels exit $grc"; rc=$((rc | grc))
    grep -E "^b[12] |^Q/K adv|^gates|^passed|^FAILED|Error" "$OUT/gpu_kernels.log" | tail -30
fi
if wants ltx2 || wants ltx2-unit; then
    # the fork's LTX-2 unit tests (their whole-forward test needs CUDA); ltx2: then the parity run
    # at real widths and the speed at full depth
    site=$(python3 -c "import sglang, os; print(os.path.dirname(sglang.__file__))")
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "${LTX2_UNIT_TIMEOUT:-120}" python3 -c 'import sys; sys.path.insert(0, ".")
from benchmark import gpu_standins; gpu_standins.install()
import pytest; sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-c", "/dev/null", "--rootdir", "/tmp", *sys.argv[1:]]))' \
        "$site/multimodal_gen/test/unit/test_ltx2_train_parity.py" >"$OUT/ltx2_unit.log" 2>&1
    urc=$?
    echo "ltx2 unit tests exit $urc"; rc=$((rc | urc))
    tail -3 "$OUT/ltx2_unit.log"
fi
if wants ltx2; then
    timeout "${LTX2_PARITY_TIMEOUT:-240}" python3 benchmark/gpu_parity_ltx2.py --out "$OUT/gpu_parity_ltx2.json" \
        --budget-s "${LTX2_PARITY_BUDGET:-170}" >"$OUT/gpu_parity_ltx2.log" 2>&1
    lrc=$?
    echo "gpu_parity_ltx2 exit $lrc"; rc=$((rc | lrc))
    grep -E "^ltx-2|^passed|^FAILED|Error|error:" "$OUT/gpu_parity_ltx2.log" | tail -20
    timeout "${LTX2_SPEED_TIMEOUT:-300}" python3 benchmark/speed.py --family ltx-2 \
        --out "$OUT/speed_ltx2.json" --steps "${LTX2_SPEED_STEPS:-5}" --warmup 2 \
        --variants "${SPEED_VARIANTS:-train_parity,default,ltx-core}" >"$OUT/speed_ltx2.log" 2>&1
    src=$?
    echo "speed (ltx-2) exit $src"; rc=$((rc | src))
    grep -E "median|^variant|^train_parity|^default|^ltx-core|_over_|family_gap|step_output|^ERROR|Error" "$OUT/speed_ltx2.log" | tail -30
fi
if wants wan-speed || wants wan; then
    timeout "${WAN_SPEED_TIMEOUT:-540}" python3 benchmark/speed.py --family wan --out "$OUT/speed_wan.json" \
        --steps "${WAN_SPEED_STEPS:-3}" --warmup 1 --variants "${SPEED_VARIANTS:-train_parity,default,diffusers}" \
        >"$OUT/speed_wan.log" 2>&1
    src=$?
    echo "speed (wan) exit $src"; rc=$((rc | src))
    grep -E "median|^variant|^train_parity|^default|^diffusers|_over_|family_gap|step_output|^ERROR|Error" "$OUT/speed_wan.log" | tail -30
fi
if wants speed || wants all; then
    timeout "${SPEED_TIMEOUT:-320}" python3 benchmark/speed.py --out "$OUT/${SPEED_NAME:-speed}.json" \
        --variants "${SPEED_VARIANTS:-train_parity,default,diffusers}" ${SPEED_ARGS:-} >"$OUT/${SPEED_NAME:-speed}.log" 2>&1
    src=$?
    echo "speed exit $src"; rc=$((rc | src))
    grep -E "median|^variant|^train_parity|^default|^diffusers|_over_|family_gap|step_output|^ERROR|Error" "$OUT/${SPEED_NAME:-speed}.log" | tail -30
fi
if wants fingerprints || { wants demo && [ -z "${DEMO_MODEL_ID:-}" ]; }; then
    # what rollout fingerprints cost per step at real Qwen-Image sizes (60 blocks' LoRA r64 adapters)
    timeout "${FINGERPRINT_TIMEOUT:-150}" python3 -c 'import runpy, sys; sys.path.insert(0, ".")
from benchmark import gpu_standins; gpu_standins.install()
sys.argv = ["fingerprint_cost.py", *sys.argv[1:]]
runpy.run_path("benchmark/fingerprint_cost.py", run_name="__main__")' \
        --device cuda --out "$OUT/fingerprint_cost.json" >"$OUT/fingerprint_cost.log" 2>&1
    frc=$?
    echo "fingerprint cost exit $frc"; rc=$((rc | frc))
    grep -E "per step|adapter checksum|Error" "$OUT/fingerprint_cost.log" | tail -5
fi
if wants demo; then
    # The client and both servers run benchmark/demo_site/sitecustomize.py (stand-ins, logged native
    # fallbacks of the text encoder and VAE, DefaultPathHarness for the default DiT only); every
    # harness record goes to harness.jsonl. The default server gets upstream's SDPA attention backend
    # (sgl_kernel's FA3 is not installed); train_parity sets torch_sdpa itself.
    export SGLANG_TP_HARNESS_LOG="$OUT/harness.jsonl"
    : >"$SGLANG_TP_HARNESS_LOG"
    PYTHONPATH="$PWD/benchmark/demo_site:$PYTHONPATH" timeout "${DEMO_TIMEOUT:-480}" python3 -c 'import sys
from sglang_train_parity.cli import main; sys.argv[0] = "sglang-train-parity"; main()' \
        demo --device cuda --server-site benchmark/demo_site --model-id "${DEMO_MODEL_ID:-Qwen-Image}" \
        --model-dir "/tmp/tiny-${DEMO_MODEL_ID:-Qwen-Image}" \
        --updates 3 --steps "${DEMO_STEPS:-4}" --push-dtypes fp32,bf16,fp32 \
        --default-server-arg=--attention-backend --default-server-arg=torch_sdpa \
        --log-dir "$OUT/demo-logs" --report "$OUT/demo.json" >"$OUT/demo.log" 2>&1
    drc=$?
    echo "demo exit $drc"; rc=$((rc | drc))
    grep -v "^\[server_harness\]" "$OUT/demo.log" | tail -40
    echo "harness records: $(wc -l <"$SGLANG_TP_HARNESS_LOG")"
    python3 - "$SGLANG_TP_HARNESS_LOG" <<'PY'
import collections, json, sys
seen = collections.Counter()
for line in open(sys.argv[1]):
    r = json.loads(line)
    key = (r.get("numerics"), r["event"], r.get("component"), r.get("op") or r.get("standin"),
           r.get("method"), r.get("error"), r.get("to"))
    seen[key] += 1
for key, n in sorted(seen.items(), key=str):
    print(n, "x", " | ".join(str(k) for k in key))
PY
    # what the train_parity server's DiT ran: its startup lines and how many graphs it captured
    grep -h -E "fused kernels on|replays CUDA graphs" "$OUT/demo-logs/server-train_parity.log" | cut -c1-160
    captured=$(grep -c "captured a CUDA graph" "$OUT/demo-logs/server-train_parity.log")
    echo "train_parity server: $captured CUDA graphs captured"
    # why calls ran eagerly (logged once per reason); Qwen-Image's DiT replays graphs from a
    # rollout's second step on, so none captured is a failure (run 46: every forward ran eagerly)
    grep -h "runs eagerly, without a CUDA graph" "$OUT/demo-logs/server-train_parity.log" | cut -c1-200
    if [ "${DEMO_MODEL_ID:-Qwen-Image}" = Qwen-Image ] && [ "$captured" -eq 0 ]; then
        echo "ERROR: the train_parity Qwen-Image server captured no CUDA graph"; rc=1
    fi
    # the server logs' errors, if any
    grep -h -E "Traceback|Error|error:" "$OUT"/demo-logs/server-*.log 2>/dev/null | grep -v "^\[server_harness\]" | sort | uniq -c | sort -rn | head -20
fi
if wants alpha-update; then
    PYTHONPATH="$PWD/benchmark/demo_site:$PYTHONPATH" timeout "${ALPHA_UPDATE_TIMEOUT:-420}" \
        python3 benchmark/server_alpha_update.py --log-dir "$OUT/alpha-logs" \
        --report "$OUT/alpha_update.json" >"$OUT/alpha_update.log" 2>&1
    arc=$?
    echo "server alpha update exit $arc"; rc=$((rc | arc))
    grep -v "^\[server_harness\]" "$OUT/alpha_update.log" | tail -20
    grep -h -E "captured a CUDA graph|runs eagerly, without a CUDA graph|Traceback|Error" \
        "$OUT/alpha-logs/server-train_parity.log" | cut -c1-160 | sort | uniq -c
fi
if wants tool; then
    # the shipped `sglang-train-parity check` on the GPU (real autocast, _native_flash), tiny model
    # built there: server and trainer RoPE tables built alike (cpu, device), then crossed (server on
    # the device, trainer on the CPU), which must fail at rotary_emb and name the option.
    for tables in cpu:cpu device:device device:cpu; do
        server=${tables%%:*}; trainer=${tables##*:}
        timeout "${TOOL_TIMEOUT:-200}" python3 -c 'import sys; sys.path.insert(0, ".")
from benchmark import gpu_standins; gpu_standins.install()
from sglang_train_parity.check import main; main(sys.argv[1:])' \
            --device cuda --train-parity-rope-tables "$server" --trainer-rope-tables "$trainer" \
            --batch-sizes 1,2 --text-lengths 7,13 --image-sizes 128,256x128 --timesteps 999,500 \
            --out-dir "$OUT/parity-check-$server-$trainer" >"$OUT/parity-check-$server-$trainer.log" 2>&1
        trc=$?
        echo "parity check (server tables $server, trainer tables $trainer) exit $trc"
        [ "$server" = "$trainer" ] && rc=$((rc | trc))
        grep -E "^(PASS|FAIL)|^rotary_emb differs first|^case|^b[0-9]" "$OUT/parity-check-$server-$trainer.log" | tail -12
        # eight files come back from the device: keep the crossed run's plot only
        [ "$server" = "$trainer" ] && rm -f "$OUT/parity-check-$server-$trainer/ulp.png"
    done
fi
nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv,noheader
exit $rc
