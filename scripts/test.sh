#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite; gpu tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
