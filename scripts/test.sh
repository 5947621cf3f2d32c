#!/usr/bin/env bash
# Run the test suite in the pinned venv; arguments go to pytest.
#   ./scripts/test.sh                    # everything
#   ./scripts/test.sh tests/unit -k pool # a subset
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
RAGGED_MODEL="$(python -m sgl_ragged.models.smollm2)"
export RAGGED_MODEL
exec python -m pytest -q "$@"
