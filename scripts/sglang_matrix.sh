#!/usr/bin/env bash
# Run Lynx's SGLang suites against supported SGLang releases: the venv's own SGLang as installed,
# every other supported release (lynx_sglang/upstream/releases/*.json) from its wheel, fetched once
# (`pip download --no-deps`, ~30 MB) into .cache/sglang-releases/VERSION/ and put in front of the
# venv's with PYTHONPATH (SGLang's server subprocesses inherit it). Nothing in .venv changes.
#
#   scripts/sglang_matrix.sh                 # every supported release, the full suites (~5 min each)
#   scripts/sglang_matrix.sh --quick 0.5.22  # one release, the in-process suites only (~1-2 min)
#   scripts/sglang_matrix.sh --sample SEED   # CI: one older release drawn by SEED, --quick
#
# Exit status: non-zero if any release's suites failed; a summary line per release at the end.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=.venv/bin/python
FULL=(tests/test_upstream.py tests/sglang/test_plugin.py tests/sglang/test_conn_transfer.py
      tests/sglang/test_conn_failures.py tests/sglang/test_spec_logprobs.py
      tests/sglang/test_pd_lynx_spec.py)
QUICK=(tests/test_upstream.py tests/sglang/test_plugin.py tests/sglang/test_conn_transfer.py)
suites=("${FULL[@]}")
releases=()
sample=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) suites=("${QUICK[@]}") ;;
    --sample) sample=$2; suites=("${QUICK[@]}"); shift ;;
    -h|--help) sed -n 2,12p "$0"; exit 0 ;;
    *) releases+=("$1") ;;
  esac
  shift
done
installed=$("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))')
supported=$(ls lynx_sglang/upstream/releases/ | sed -n 's/\.json$//p' | sort -V)
if [ -n "$sample" ]; then
  older=$(grep -vx "$installed" <<<"$supported" || true)
  [ -n "$older" ] || { echo "[matrix] no supported release besides $installed"; exit 0; }
  mapfile -t pool <<<"$older"
  index=$(( $(printf '%s' "$sample" | cksum | cut -d' ' -f1) % ${#pool[@]} ))
  releases=("${pool[$index]}")
  echo "[matrix] sampled SGLang ${releases[0]} (seed $sample) of: $(echo $older)"
fi
[ ${#releases[@]} -gt 0 ] || mapfile -t releases <<<"$supported"
status=0
summary=()
for v in "${releases[@]}"; do
  grep -qx "$v" <<<"$supported" || { echo "[matrix] $v is not a supported release ($(echo $supported))"; exit 2; }
  pythonpath=""
  if [ "$v" != "$installed" ]; then
    dir=.cache/sglang-releases/$v
    if [ ! -d "$dir/sglang" ]; then
      mkdir -p "$dir"
      timeout 600 "$PY" -m pip download -q --no-deps --disable-pip-version-check "sglang==$v" \
        -d "$dir/wheel" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
      "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
        "$(ls "$dir"/wheel/sglang-"$v"-*.whl)" "$dir"
    fi
    pythonpath=$ROOT/$dir
  fi
  echo "[matrix] SGLang $v: ${suites[*]}"
  start=$SECONDS
  if PYTHONPATH=$pythonpath timeout 3000 "$PY" -m pytest -q -p no:cacheprovider "${suites[@]}"; then
    summary+=("SGLang $v: passed ($((SECONDS - start)) s)")
  else
    summary+=("SGLang $v: FAILED ($((SECONDS - start)) s)")
    status=1
  fi
done
printf '[matrix] %s\n' "${summary[@]}"
exit $status
