#!/usr/bin/env bash
# Create .venv with evomerge installed (editable). --test adds the test dependencies.
#
# torch is installed first and pinned to 2.13.0 when that release can be had (a CPU
# build lies on disk on the project's machines); otherwise pip picks a torch that
# satisfies the project's open range (torch>=2.4).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
python3 -m venv .venv
py=.venv/bin/python
"$py" -m pip install -q --upgrade pip >/dev/null
if ! "$py" -c "import torch" 2>/dev/null; then
  "$py" -m pip install -q "torch==2.13.0" || "$py" -m pip install -q "torch>=2.4"
fi
# constraints.txt pins the versions known to install here; users' installs keep pyproject's open ranges
"$py" -m pip install -q -c constraints.txt -e ".${extras}"
echo "evomerge installed in .venv ($("$py" -c 'import torch; print("torch", torch.__version__)'))" >&2
