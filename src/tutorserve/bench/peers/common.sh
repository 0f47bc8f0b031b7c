# Sourced by the peer scripts: where peers are installed, and the Python that runs our package
# (the checkout's venv when this folder is src/tutorserve/bench/peers of one, else $PYTHON or
# python3.11).
CACHE="${TUTORSERVE_CACHE:-$HOME/.cache/tutorserve}"
HERE="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"
REPO="$(cd "$HERE/../../../.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3.11; fi
fi
