#!/usr/bin/env bash
# Fill the carried wheel folder .whl/ (git-ignored; add `/.whl/` to .git/info/exclude) for the H200:
# the fork built for cp312 from the pinned upstream wheel, and the packages the H200 image lacks
# that importing and loading sglang's Qwen-Image DiT needs there (/work/shared/reference/h200-import-notes.md,
# plus openai/jiter/distro/sniffio/uvicorn/partial-json-parser found by a CPU run of the loader path
# with every other package the image lacks blocked), IPython (sglang/utils.py imports it; the parity
# check's plot needs the real one), and what `sglang serve` needs there for the GPU demo: fastapi,
# opentelemetry-api (fastapi's), python-multipart, setproctitle and imageio-ffmpeg, the last built from
# its sdist, which bundles no ffmpeg binary (the platform wheel's is 27 MB; sglang imports the module at
# server start and calls it only to write videos). Found by a CPU run of the demo with every package
# the image lacks blocked; pytest (and its pluggy, iniconfig) for the fork's unit tests that need CUDA;
# ltx-core (LTX-2's trainer model) and its einops. ~60 MB in all.
#
#   [PYTHON=.venv/bin/python] bash benchmark/prepare_wheels.sh /path/to/sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl
# (PYTHON: an interpreter with forktools' requirements, unidiff among them; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
upstream=${1:?pinned upstream cp312 wheel}
mkdir -p .whl
rm -f .whl/sglang-*.whl
"${PYTHON:-python3}" -m forktools build -o .whl --upstream-wheel "$upstream"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
    manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
    diffusers==0.42.1 orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 apache-tvm-ffi==0.1.11 \
    dill==0.4.1 compressed-tensors==0.18.0 gguf==0.19.0 addict==2.4.0 cache-dit==1.5.1 starlette==1.10.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 loguru==0.7.3 \
    traitlets==5.16.1 openai==2.8.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 uvicorn==0.54.0 \
    partial-json-parser==0.2.1.1.post7 \
    ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 \
    pexpect==4.9.0 ptyprocess==0.7.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 \
    executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 \
    fastapi==0.165.0 opentelemetry-api==1.45.2 python-multipart==0.0.34 setproctitle==1.3.8 \
    pytest==8.3.5 pluggy==1.5.0 iniconfig==2.0.0 \
    ltx-core==1.0.0 einops==0.8.2
python3 -m pip wheel -q --no-deps --no-binary=:all: -w .whl imageio-ffmpeg==0.5.1
du -sh .whl
