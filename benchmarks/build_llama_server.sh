#!/usr/bin/env bash
# Build llama.cpp's llama-server (parallel slots, continuous batching), llama-bench and llama-batched-bench from
# the llama.cpp source that the installed llama-cpp-python's PyPI sdist vendors, into peers/llama.cpp beside the
# checkout (never in the repo).
# Usage: benchmarks/build_llama_server.sh [PYTHON]   (PYTHON: the venv's python; default .venv/bin/python)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${1:-$repo/.venv/bin/python}"
peers="$(dirname "$repo")/peers"
# The installed llama-cpp-python's version, so that both peers run the same llama.cpp; else the one we measured with.
version="$("$python" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || echo 0.3.36)"
mkdir -p "$peers"
if [ ! -f "$peers/llama.cpp/tools/server/CMakeLists.txt" ]; then
    work="$(mktemp -d)"
    "$python" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
    tar -xzf "$work"/*.tar.gz -C "$work"
    mv "$work"/llama[-_]cpp[-_]python-"$version"/vendor/llama.cpp "$peers/llama.cpp"
    rm -rf "$work"
fi
cd "$peers/llama.cpp"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF
cmake --build build --target llama-server llama-quantize llama-bench llama-batched-bench -j"${JOBS:-2}"
echo "built $peers/llama.cpp/build/bin/llama-server (llama.cpp vendored by llama-cpp-python $version)"
