#!/usr/bin/env bash
# Download the wheels that `python -m benchmarks.serving` needs on the GPU machine (no internet there) into
# .whl-serving/ (git-ignored): the load generator guidellm and `hybridserve serve`'s own packages that the device
# image lacks. Usage, from the repository root on a machine with PyPI:
#   bash benchmarks/fetch_serving_wheels.sh [DIR]          # default DIR: .whl-serving
# then carry DIR (and .whl) and install both on the device with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl DIR/*.whl
#
# The list is the dependency closure of guidellm 0.8.1 + fastapi + uvicorn + pydantic for CPython 3.12 manylinux
# x86_64, minus every package the device image already holds (torch, transformers, datasets'
# pyarrow/pandas/xxhash/fsspec, huggingface-hub, httpx, uvloop, ... stay out). Added
# on purpose, as the image's versions are not recorded: h2/hpack/hyperframe (guidellm asks for httpx[http2]),
# typing_extensions 4.16 (pydantic 2.14 needs >= 4.16) and click 8.4 (guidellm pins ~= 8.4.0). About 9 MiB in all.
# Versions are pinned so that every session carries the same set; PYVER=3.11 fetches the same versions for a local
# 3.11 test environment. (NVIDIA's aiperf 0.13 was the other candidate: its missing closure with the server's
# packages came to ~51 MiB (plotly, dash, scipy, zstandard, sqlalchemy, ...), too close to the 64 MiB carry limit.)
set -euo pipefail
dir=${1:-.whl-serving}
pyver=${PYVER:-3.12}
abi=cp${pyver/./}
wheels=(
  guidellm==0.8.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 faker==40.63.0 ftfy==6.3.1 wcwidth==0.9.4
  loguru==0.7.3 more-itertools==11.2.1 culsans==0.10.0 aiologic==0.17.1 sniffio==1.3.1 eval-type-backport==0.4.0
  pydantic-settings==2.16.3 python-dotenv==1.2.4 sanic==25.12.1 sanic-routing==23.12.0 html5tagger==2.0.0
  tracerite==2.6.5 httptools==0.9.0 ujson==6.1.0 websockets==17.4 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2 pydantic==2.14.4
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 click==8.4.2
)
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --abi "$abi" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$dir" "${wheels[@]}"
du -ch "$dir"/*.whl | tail -n 1
