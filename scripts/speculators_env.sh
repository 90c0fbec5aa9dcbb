#!/usr/bin/env bash
# A Python environment with vLLM's `speculators` 0.9.0, for the EAGLE-3 parity checks (tests/test_eagle3.py,
# scripts/eagle3_reference.py). It is separate from jspec's: speculators pins transformers <= 5.19.
# Usage: bash scripts/speculators_env.sh [DIR]   (default ~/.cache/jspec/speculators-env); prints its python.
set -euo pipefail
ENV=${1:-$HOME/.cache/jspec/speculators-env}
python3.11 -m venv "$ENV"
"$ENV/bin/pip" install -q speculators==0.9.0 transformers==5.19.0 torch==2.13.0
# the registry's torchvision / torchaudio wheels are built for another torch build, and transformers imports
# torchvision when it is present; speculators' EAGLE-3 model needs neither
"$ENV/bin/pip" uninstall -q -y torchvision torchaudio
echo "$ENV/bin/python"
