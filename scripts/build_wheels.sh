#!/usr/bin/env bash
# Build an installable wheel of every distribution in this repository (they are not on a package
# index yet), into dist/ or the folder given:
#
#   scripts/build_wheels.sh [OUT_DIR]
#   pip install --find-links dist oasr-core oasr-models-whisper oasr-vad-silero   # elsewhere
#
# Uses .venv's Python when there is one (else python3, or $PYTHON). With setuptools and wheel
# installed there it builds without network access (--no-build-isolation); otherwise pip fetches
# setuptools from the package index for each build.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-dist}"
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi

isolation=()
if "$PY" -c "import setuptools, wheel" 2>/dev/null; then isolation=(--no-build-isolation); fi

dists=()
for d in oasr-core oasr-*/ examples/oasr-plugin-example; do
  d="${d%/}"
  [[ -f "$d/pyproject.toml" ]] || continue
  [[ " ${dists[*]} " == *" $d "* ]] || dists+=("$d")
done

build() {
  local d="$1" had_build=0 had_info info
  [[ -e "$d/build" ]] && had_build=1
  had_info=$(ls -d "$d"/src/*.egg-info 2>/dev/null || true)
  "$PY" -m pip wheel --quiet --no-deps "${isolation[@]}" --wheel-dir "$OUT" "./$d" || return
  # setuptools builds in the source tree: leave no build/ behind (stale files would ship later)
  # and no new *.egg-info (it makes the source folder an installed distribution for every
  # process that puts src/ on sys.path: the example plugin would then register twice)
  [[ $had_build == 1 ]] || rm -rf "$d/build"
  for info in "$d"/src/*.egg-info; do
    [[ -e "$info" && " $had_info " != *" $info "* ]] && rm -rf "$info"
  done
  true
}

# two builds at a time (each is one mostly single-threaded pip process, in its own folder);
# plain `wait PID` per pair, so any bash (macOS's 3.2 too) runs it
mkdir -p "$OUT"
n=0
failed=()
pending=()
for d in "${dists[@]}"; do
  n=$((n + 1))
  echo "[$n/${#dists[@]}] building $d" >&2
  build "$d" &
  pending+=("$!:$d")
  if [[ ${#pending[@]} == 2 || $n == "${#dists[@]}" ]]; then
    for job in "${pending[@]}"; do
      wait "${job%%:*}" || failed+=("${job#*:}")
    done
    pending=()
    if [[ ${#failed[@]} -gt 0 ]]; then  # stop at the first failing pair, as one at a time did
      echo "building ${failed[*]} failed" >&2
      exit 1
    fi
  fi
done
echo "wheels in $OUT:" >&2
ls -1 "$OUT"/*.whl >&2
echo "install them with: pip install --find-links $OUT oasr-core oasr-models-whisper oasr-vad-silero  (add oasr-server and other families as needed)" >&2
