#!/usr/bin/env bash
# One GPU session's checks in one call: every kernel and GPU test file in its own process (an illegal memory access
# poisons the whole process, so one faulting kernel must not hide the others' results), then the benchmarks.
# The device image lacks packages the tests and benchmarks import: fetch their wheels here first with
# benchmarks/fetch_device_wheels.sh, carry them and install them there as that script says.
# Logs and JSON go to $OUT (default ./gpu-out); the per-file logs end up in one $OUT/logs.tgz, as the device tool
# brings back at most 8 files. Usage, from the repository root on the GPU machine:
#   bash benchmarks/gpu_session.sh [tests|kernels|engines|bench|all|ling|agreement|profile|tune|serving|serving-ling|tp|
#                                   structured|spec|pdl|dp|prefill-alloc|new-kernels|conv|epilogues|prefill-graphs|
#                                   prefill-host|prefill-rows|graph-reserve|targets]
# (all = tests + bench; tests = kernels + engines: the two groups of test files, see below; ling = 16 Ling-2.6-flash
# layers with dummy weights and the shared-expert overlap; agreement = Ling decode agreement per lightning
# implementation; profile = the b1, b64, prefill and b1-under-a-JSON-grammar step profiles of the 40-layer
# ZAYA1 run; tune = the fused-MoE tile tables, as $OUT/moe_configs.tgz: their names hold '=' and ',', which the
# device tool does not bring back as files; TUNE_ARGS passes more arguments, e.g. TUNE_ARGS="--tokens 1 2 4";
# serving / serving-ling = serving_benchmark.py on the 40-layer ZAYA1 / 16 Ling-flash layers, which needs guidellm
# and the server's packages installed first from .whl and .whl-serving: see benchmarks/fetch_serving_wheels.sh;
# tp = on nvidia-h200-x2: the TP=2 GPU test, 40-layer ZAYA1 at TP=2, and Ling-2.6-flash at full size (32 layers
# and its MTP layer) at TP=2;
# structured = the structured-output GPU test and the 40-layer ZAYA1 offline benchmark with and without a JSON
# grammar on every request; spec = speculative decoding: its GPU test, then 40-layer ZAYA1 with n-gram drafts and
# 16 Ling-2.6-flash layers with MTP drafts, plain vs speculative vs forced acceptance at batch 1 and 16, greedy;
# pdl = programmatic dependent launch: the kernel-chain benchmark, its GPU test, then the 40-layer ZAYA1 offline
# benchmark at b1 and b64 with HYBRIDSERVE_PDL=0 and =1; dp = on nvidia-h200-x2, the 40-layer ZAYA1 serving benchmark at
# concurrency 64 and 256 with one replica and with --dp 2, which needs the serving wheels as `serving` does;
# prefill-alloc = the 40-layer ZAYA1 prefill scenario, 5 calls on one engine, with the default caching allocator and
# with expandable segments: whether the repeats' slowdown is the allocator's, the clocks' or Python's garbage
# collector's (the JSON has the allocator's retry counters, the clocks and the collections of each call);
# new-kernels = the kernels written without a GPU (the sampler's unsorted draw, the router's 3xTF32 prefill GEMMs,
# the conv's larger prefill token blocks): their test files on the GPU, their micro-benchmarks against the paths
# they replace, and the 40-layer ZAYA1 offline benchmark at b1, b64 and prefill; conv = a change to the CCA conv
# kernel: its two GPU test files side by side, its micro-benchmark (prefill token blocks 32, 64 and 128), then the
# 40-layer ZAYA1 offline benchmark against HF transformers and the floor; epilogues = a change to kernel epilogues
# (the residual norm in the GEMVs, the attention split merge): their kernel and GPU test files, the b1 step profile
# and the 40-layer ZAYA1 offline benchmark without HF; prefill-graphs = the one-row prefill graphs' test files beside
# the decode and verify graphs' and the host-sync test, the b1 profile (its first token, the graph pool), the 40-layer
# offline benchmark with and without prefill graphs at b1; prefill-host = whether the prefill scenario's 16-row eager
# steps are bound by the host or the device: its step profile with the host's share of the whole scenario, one
# 16-row step timed by prefill_host.py, then the prefill-graphs group's test files; prefill-rows = prefill graphs of
# several rows: their two test files, the prefill scenario's profile with its host share, then the 40-layer offline
# benchmark without HF; graph-reserve = the memory plan's trial capture: the graph test files whose pools must fit
# their reserve, then the 40-layer b1 profile (the pool against the reserve, the first token); targets = the 40-layer
# offline benchmark against HF transformers and the floor, then the ZAYA1 kernel and host-sync GPU tests)
set -u
OUT=${OUT:-gpu-out}
what=${1:-all}
mkdir -p "$OUT/logs"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1

# Every pytest call here clears pyproject's addopts (`-o addopts=`): they ask for pytest-xdist workers, which the
# device image lacks, and each file runs in a process of its own here anyway.
export PYTEST="python -m pytest -o addopts= -p no:cacheprovider"  # run_files' inner shells read it too
run_files() {  # run_files PARALLEL FILE...: each file in its own pytest process, its log in $OUT/logs
  local parallel=$1
  shift
  printf '%s\n' "$@" | xargs -P "$parallel" -I{} bash -c \
    'n=$(basename {} .py); timeout --foreground 450 $PYTEST -s {} > "$0/logs/$n.log" 2>&1;
     echo "rc=$?" >> "$0/logs/$n.log"' "$OUT"
}

graph_tests() {  # graph_tests FILE...: run_files 2, then their results and the lines they print about graphs
  run_files 2 "$@"
  grep -H -E ' (passed|failed|error)|^rc=|largest|graph pool|trial capture' "$OUT"/logs/test_*.log
}
profile() {  # profile SCENARIO: the 40-layer step profile of an offline scenario, then its summary lines
  timeout 200 python benchmarks/profile_step.py --layers 40 --scenario "$1" --out "$OUT/profile_$1.json" \
    > "$OUT/logs/profile_$1.log" 2>&1
  grep -E "median_late|profiled:|first token|host share|graph_pool" -A 4 "$OUT/logs/profile_$1.log" | grep -v "^ *\[\|^--"
}

# Engine tests (an LLM each, up to a quarter of the GPU's memory, memory plans that count what the device holds) run
# two at a time, the kernel tests four at a time; `tests` runs both groups side by side, which took longer than 580 s
# on a fresh machine (the device tool's limit is 600 s): run `kernels` and `engines`, one group each, as two calls.
# Each group stops at TESTS_LIMIT seconds (default 520; timeout ends its whole process group, which is why a file's
# own timeout runs in the foreground: in a group of its own it would outlive the group's), so that the summary and
# logs.tgz below still come back from a call that runs out of time: a file cut short shows no rc= line.
engines=$(grep -l "LLM(\|write_two_layer_model" tests/gpu/test_*.py)
bounded_files() {  # bounded_files PARALLEL FILE...: run_files within TESTS_LIMIT seconds
  timeout "${TESTS_LIMIT:-520}" bash -c "$(declare -f run_files); run_files $*"
}
if [[ $what == tests || $what == all || $what == engines ]]; then
  bounded_files 2 $engines &
fi
if [[ $what == tests || $what == all || $what == kernels ]]; then
  bounded_files 4 $(ls tests/ops/test_*.py tests/gpu/test_*.py | grep -vxF "$engines") &
fi
wait
if [[ $what == tests || $what == all || $what == kernels || $what == engines ]]; then
  for f in "$OUT"/logs/test_*.log; do
    printf '%-45s %s  %s\n' "$(basename "$f" .log)" "$(tail -n 1 "$f")" \
      "$(grep -E ' (passed|failed|skipped|error)' "$f" | tail -n 1)"
  done
fi

if [[ $what == bench || $what == all ]]; then
  timeout 300 python benchmarks/decode_launches.py --batch 1 --out "$OUT/launches_b1.json" > "$OUT/logs/launches.log" 2>&1
  grep -E "launches per decode step" "$OUT/logs/launches.log"
  timeout 300 python benchmarks/op_microbench.py --out "$OUT/op_microbench.json" > "$OUT/logs/op_microbench.log" 2>&1
  timeout 500 python benchmarks/offline_throughput.py --layers 40 --scenarios b1 b64 prefill \
    --out "$OUT/offline_40l.json" > "$OUT/logs/offline.log" 2>&1
  grep -A 4 "^scenario" "$OUT/logs/offline.log"
fi

if [[ $what == ling ]]; then
  timeout 300 python benchmarks/ling_moe_overlap.py --out "$OUT/ling_moe_overlap.json" > "$OUT/logs/overlap.log" 2>&1
  tail -n 8 "$OUT/logs/overlap.log"
  timeout 500 python benchmarks/offline_throughput.py --model-type ling --layers 16 --scenarios b1 b64 prefill \
    --out "$OUT/offline_ling16.json" > "$OUT/logs/offline_ling.log" 2>&1
  grep -A 4 "^scenario" "$OUT/logs/offline_ling.log"
fi

if [[ $what == agreement ]]; then
  timeout 300 python benchmarks/ling_decode_agreement.py --out "$OUT/ling_agreement.json" 2>&1 | grep -E "decode .*prefill"
fi

if [[ $what == profile ]]; then
  for run in b1 b64 prefill "b1 --json-grammar"; do
    name=$(echo "$run" | tr -d ' -')
    timeout 250 python benchmarks/profile_step.py --layers 40 --scenario $run --out "$OUT/profile_$name.json" \
      > "$OUT/logs/profile_$name.log" 2>&1
    echo "$run:" && grep -E "median_late|profiled:" "$OUT/logs/profile_$name.log"
  done
fi

if [[ $what == tune ]]; then
  mkdir -p "$OUT/moe_configs"
  timeout 560 python benchmarks/tune_moe.py --out-dir "$OUT/moe_configs" ${TUNE_ARGS:-} > "$OUT/logs/tune.log" 2>&1
  grep -E "compiled|T=|kept|total" "$OUT/logs/tune.log" | cut -c 1-150
  tar czf "$OUT/moe_configs.tgz" -C "$OUT" moe_configs && rm -rf "$OUT/moe_configs"
fi

if [[ $what == serving || $what == serving-ling ]]; then
  model=(--layers 40) && name=zaya1-8b-40layers
  [[ $what == serving-ling ]] && model=(--model-type ling --layers 16) && name=ling-flash-16layers
  python -m pip check 2>&1 | grep -iE "^(guidellm|datasets|pydantic|fastapi|starlette|uvicorn) "  # carried: in need?
  timeout 560 python benchmarks/serving_benchmark.py "${model[@]}" --out "$OUT/serving_$name.json" \
    --raw "$OUT/logs/serving_raw" > "$OUT/logs/serving.log" 2>&1
  rc=$?
  echo "serving_benchmark rc=$rc"
  grep -m 1 "^server ready" "$OUT/logs/serving.log" | cut -c1-200
  grep -m 1 "^lone-request" "$OUT/logs/serving.log"
  sed -n '/^## serving benchmark/,$p' "$OUT/logs/serving.log"
  [[ $rc == 0 ]] || tail -n 40 "$OUT/logs/serving.log"
fi

if [[ $what == tp ]]; then
  timeout 300 $PYTEST -s tests/gpu/test_tp_gpu.py > "$OUT/logs/test_tp_gpu.log" 2>&1
  grep -E "largest|passed|failed|skipped" "$OUT/logs/test_tp_gpu.log"
  timeout 400 python benchmarks/offline_throughput.py --layers 40 --tp 2 --skip-hf --load-format dummy \
    --scenarios b1 b64 prefill --out "$OUT/offline_zaya40_tp2.json" > "$OUT/logs/offline_tp2.log" 2>&1
  grep -A 4 "^scenario" "$OUT/logs/offline_tp2.log"
  timeout 500 python benchmarks/offline_throughput.py --model-type ling --layers 32 --mtp-layer --tp 2 \
    --scenarios b1 b64 prefill --out "$OUT/offline_ling_flash_tp2.json" > "$OUT/logs/offline_ling_tp2.log" 2>&1
  grep -m 1 "memory plan" "$OUT/logs/offline_ling_tp2.log" | cut -c 1-300
  grep -A 4 "^scenario" "$OUT/logs/offline_ling_tp2.log"
fi

if [[ $what == structured ]]; then  # needs xgrammar: pip install --no-deps .whl-agent/*.whl first
  timeout 300 $PYTEST -s tests/gpu/test_structured_gpu.py \
    > "$OUT/logs/test_structured_gpu.log" 2>&1
  grep -E "largest logprob| (passed|failed|skipped|error)" "$OUT/logs/test_structured_gpu.log" | tail -n 3
  timeout 400 python benchmarks/offline_throughput.py --layers 40 --load-format dummy --scenarios b1 b64 \
    --json-grammar --skip-hf --out "$OUT/offline_json.json" > "$OUT/logs/offline_json.log" 2>&1
  grep -A 6 "^scenario" "$OUT/logs/offline_json.log"
fi

if [[ $what == spec ]]; then
  timeout 300 $PYTEST -s tests/gpu/test_speculative_gpu.py \
    > "$OUT/logs/test_speculative_gpu.log" 2>&1
  grep -E "largest|replays|passed|failed|skipped" "$OUT/logs/test_speculative_gpu.log"
  timeout 400 python benchmarks/offline_throughput.py --layers 40 --load-format dummy --skip-hf --temperature 0 \
    --scenarios b1 b16 --speculative-algorithm NGRAM --num-draft-tokens 4 --out "$OUT/spec_zaya40_ngram.json" \
    > "$OUT/logs/spec_zaya.log" 2>&1
  grep -A 3 "plain tok/s" "$OUT/logs/spec_zaya.log" || tail -n 20 "$OUT/logs/spec_zaya.log"
  timeout 400 python benchmarks/offline_throughput.py --model-type ling --layers 16 --temperature 0 \
    --scenarios b1 b16 --speculative-algorithm NEXTN --num-draft-tokens 3 --out "$OUT/spec_ling16_nextn.json" \
    > "$OUT/logs/spec_ling.log" 2>&1
  grep -A 3 "plain tok/s" "$OUT/logs/spec_ling.log" || tail -n 20 "$OUT/logs/spec_ling.log"
fi

if [[ $what == pdl ]]; then
  timeout 120 python benchmarks/pdl_chain.py --out "$OUT/pdl_chain.json" 2>&1 | tail -n 3
  timeout 300 $PYTEST -s tests/gpu/test_pdl_gpu.py > "$OUT/logs/test_pdl_gpu.log" 2>&1
  grep -E "largest|passed|failed|skipped" "$OUT/logs/test_pdl_gpu.log"
  for flag in 0 1; do
    HYBRIDSERVE_PDL=$flag timeout 300 python benchmarks/offline_throughput.py --layers 40 --load-format dummy \
      --skip-hf --scenarios b1 b64 --repeats 5 --out "$OUT/offline_pdl$flag.json" \
      > "$OUT/logs/offline_pdl$flag.log" 2>&1
    echo "HYBRIDSERVE_PDL=$flag" && grep -A 4 "^scenario" "$OUT/logs/offline_pdl$flag.log"
  done
fi

if [[ $what == prefill-alloc ]]; then
  for conf in "" expandable_segments:True; do
    PYTORCH_CUDA_ALLOC_CONF=$conf timeout 200 python benchmarks/offline_throughput.py --layers 40 --load-format dummy \
      --skip-hf --scenarios prefill --repeats 5 --out "$OUT/prefill_alloc${conf:+_expandable}.json" \
      > "$OUT/logs/prefill_alloc${conf:+_expandable}.log" 2>&1
    python - "$OUT/prefill_alloc${conf:+_expandable}.json" "${conf:-default allocator}" <<'PY'
import json, sys
entry = json.load(open(sys.argv[1]))["scenarios"]["prefill"]
print(sys.argv[2], [round(r) for r in entry["ours_tok_s_runs"]], entry.get("gpu_after_runs"), entry["gc_runs"])
PY
  done
fi

if [[ $what == new-kernels ]]; then
  for f in tests/ops/test_sampling_kernel.py tests/ops/test_zaya_router_kernel.py tests/ops/test_conv_kernel.py \
           tests/gpu/test_zaya_kernels_gpu.py; do
    n=$(basename $f .py)
    timeout 300 $PYTEST $f > "$OUT/logs/$n.log" 2>&1
    echo "$n: $(grep -E ' (passed|failed|error)' "$OUT/logs/$n.log" | tail -n 1)"
  done
  timeout 200 python benchmarks/op_microbench.py --ops zaya_router conv --out "$OUT/op_microbench_new.json" \
    > "$OUT/logs/op_microbench_new.log" 2>&1
  grep -E "prefill|eda route T=(2048|8192)" "$OUT/logs/op_microbench_new.log"
  timeout 400 python benchmarks/offline_throughput.py --layers 40 --load-format dummy --skip-hf \
    --scenarios b1 b64 prefill --out "$OUT/offline_new_kernels.json" > "$OUT/logs/offline_new.log" 2>&1
  grep -A 4 "^scenario" "$OUT/logs/offline_new.log"
fi

if [[ $what == conv ]]; then
  run_files 2 tests/ops/test_conv_kernel.py tests/gpu/test_zaya_kernels_gpu.py
  grep -H -E ' (passed|failed|error)' "$OUT"/logs/test_conv_kernel.log "$OUT"/logs/test_zaya_kernels_gpu.log
  timeout 200 python benchmarks/op_microbench.py --ops conv --out "$OUT/op_microbench_conv.json" \
    > "$OUT/logs/op_microbench_conv.log" 2>&1
  grep -E "prefill" "$OUT/logs/op_microbench_conv.log"
  timeout 400 python benchmarks/offline_throughput.py --layers 40 --scenarios b1 b64 prefill \
    --out "$OUT/offline_40l.json" > "$OUT/logs/offline.log" 2>&1
  grep -A 4 "^scenario" "$OUT/logs/offline.log"
fi

if [[ $what == epilogues ]]; then  # a change to kernel epilogues: their test files, the b1 profile, 40 layers
  run_files 4 tests/ops/test_decode_gemv_kernel.py tests/ops/test_attention_kernel.py tests/ops/test_norm_kernel.py \
    tests/gpu/test_decode_gemv_gpu.py tests/gpu/test_attention_gpu.py tests/gpu/test_zaya_kernels_gpu.py &
  run_files 2 tests/gpu/test_zaya_gpu.py tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_host_sync_gpu.py &
  wait
  grep -H -E ' (passed|failed|error)|^rc=' "$OUT"/logs/test_*.log
  profile b1
  timeout 300 python benchmarks/offline_throughput.py --layers 40 --load-format dummy --skip-hf --repeats 5 \
    --scenarios b1 b64 prefill --out "$OUT/offline_epilogues.json" > "$OUT/logs/offline_epilogues.log" 2>&1
  grep -A 4 "^scenario" "$OUT/logs/offline_epilogues.log"
fi

if [[ $what == prefill-graphs ]]; then  # one-row prefill graphs: their tests, the b1 profile, 40 layers
  graph_tests tests/gpu/test_prefill_graphs_gpu.py tests/gpu/test_cuda_graphs_gpu.py tests/ops/test_prefill_graph_batch.py \
    tests/gpu/test_host_sync_gpu.py tests/gpu/test_speculative_gpu.py
  profile b1
  timeout 300 python benchmarks/offline_throughput.py --layers 40 --load-format dummy --skip-hf --repeats 5 \
    --scenarios b1 b64 prefill --out "$OUT/offline_prefill_graphs.json" > "$OUT/logs/offline_prefill_graphs.log" 2>&1
  grep -A 4 "^scenario" "$OUT/logs/offline_prefill_graphs.log"
  timeout 150 python benchmarks/offline_throughput.py --layers 40 --load-format dummy --skip-hf --repeats 5 \
    --scenarios b1 --prefill-graph-max-tokens 0 --out "$OUT/offline_no_prefill_graphs.json" \
    > "$OUT/logs/offline_no_prefill_graphs.log" 2>&1
  echo "without prefill graphs:" && grep -A 2 "^scenario" "$OUT/logs/offline_no_prefill_graphs.log"
fi

if [[ $what == prefill-host ]]; then  # the prefill scenario: host- or device-bound?
  profile prefill
  timeout 150 python benchmarks/prefill_host.py --layers 40 --tokens 512 --rows 16 --out "$OUT/prefill_host_16rows.json" \
    > "$OUT/logs/prefill_host.log" 2>&1
  grep -v "^ " "$OUT/logs/prefill_host.log" | tail -n 12
  graph_tests tests/gpu/test_prefill_graphs_gpu.py tests/gpu/test_cuda_graphs_gpu.py tests/ops/test_prefill_graph_batch.py \
    tests/gpu/test_host_sync_gpu.py tests/gpu/test_speculative_gpu.py
fi

if [[ $what == prefill-rows ]]; then  # prefill graphs of several rows
  graph_tests tests/gpu/test_prefill_graphs_gpu.py tests/ops/test_prefill_graph_batch.py
  profile prefill
  timeout 300 python benchmarks/offline_throughput.py --layers 40 --load-format dummy --skip-hf --repeats 5 \
    --scenarios b1 b64 prefill --out "$OUT/offline_prefill_rows.json" > "$OUT/logs/offline_prefill_rows.log" 2>&1
  grep -A 4 "^scenario" "$OUT/logs/offline_prefill_rows.log"
fi

if [[ $what == graph-reserve ]]; then  # the graph pool's reserve from a trial capture
  graph_tests tests/gpu/test_prefill_graphs_gpu.py tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_speculative_gpu.py \
    tests/gpu/test_host_sync_gpu.py
  profile b1
  sed -n '/device self time of that first token/,/^[^ ]/p' "$OUT/logs/profile_b1.log"
fi

if [[ $what == targets ]]; then  # the targets table (40-layer ZAYA1 vs HF vs the floor), then ZAYA1 GPU tests
  timeout 300 python benchmarks/offline_throughput.py --layers 40 --scenarios b1 b64 prefill \
    --out "$OUT/offline_40l.json" > "$OUT/logs/offline.log" 2>&1
  grep -A 4 "^scenario" "$OUT/logs/offline.log"
  TESTS_LIMIT=140 bounded_files 2 tests/gpu/test_zaya_kernels_gpu.py tests/gpu/test_host_sync_gpu.py
  grep -H -E ' (passed|failed|error)|^rc=' "$OUT"/logs/test_*.log
fi

if [[ $what == dp ]]; then
  for dp in 1 2; do
    timeout 280 python benchmarks/serving_benchmark.py --layers 40 --load-format dummy --concurrency 64 256 \
      --server-args "--dp $dp" --out "$OUT/serving_zaya40_dp$dp.json" > "$OUT/logs/serving_dp$dp.log" 2>&1
    echo "--dp $dp rc=$?" && sed -n '/^## serving benchmark/,$p' "$OUT/logs/serving_dp$dp.log"
  done
fi

tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
