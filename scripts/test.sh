#!/usr/bin/env bash
# The README's test command: set up (venv + CPU torch + retrofit[dev]) and run the suite.
# Extra arguments go to pytest. "No tests ran" (pytest exit 5) is a failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_setup_env.sh" dev
cd "$ROOT"
set +e
python -m pytest -q -ra "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit $rc
