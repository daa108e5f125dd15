#!/usr/bin/env bash
# Runs docs/operators.md's "By hand, in a fresh environment on a CPU machine" block exactly as
# written, in a throw-away directory holding a clean clone of this repository's HEAD (only what is
# committed counts), with a fresh model cache; then checks what an operator relies on:
#   - the request through SGLang's router answers with text,
#   - `lynx-sglang --version` and `doctor` ran,
#   - a prefill restarted with a different --lynx-target is refused once, at connect, with the
#     flag named, and its requests fail with that message instead of hanging.
# Slow (a venv from scratch, one model conversion, three server starts: ~10 min here), so it is a
# command, not part of the test suite. Needs the block's ports (30000, 30001, 8000, 8998) free.
#
#   bash scripts/check_fresh_install.sh [WORKDIR]     # JSON summary on stdout, logs in WORKDIR
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d /tmp/lynx-fresh-XXXX)}
mkdir -p "$WORK"
log() { printf '[fresh-install] %s\n' "$*" >&2; }
fail() { log "FAIL: $*"; exit 1; }

for port in 30000 30001 8000 8998; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then fail "port $port is in use"; fi
done

git clone -q "$ROOT" "$WORK/lynx-sglang"
cd "$WORK/lynx-sglang"
sed -n '/^```bash cpu-from-scratch$/,/^```$/p' docs/operators.md | sed '1d;$d' > "$WORK/block.sh"
[ -s "$WORK/block.sh" ] || fail "no cpu-from-scratch block in docs/operators.md"
export LYNX_SGLANG_CACHE="$WORK/cache"

cleanup() {
  # The block's servers run as this shell's background jobs; SGLang's schedulers are their
  # children, so each job's whole process tree goes.
  for pid in $(jobs -p); do pkill -TERM -P "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true; done
  sleep 2
  for pid in $(jobs -p); do pkill -KILL -P "$pid" 2>/dev/null || true; kill -9 "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

log "running the docs block ($(wc -l < "$WORK/block.sh") lines) in $WORK/lynx-sglang"
t0=$(date +%s)
# shellcheck disable=SC1091
source "$WORK/block.sh" > "$WORK/block.out"
t_block=$(( $(date +%s) - t0 ))
answer=$(tail -n 1 "$WORK/block.out")
python -c 'import json,sys; t=json.loads(sys.argv[1])["text"]; assert t.strip(), "empty text"' "$answer" \
  || fail "the request through the router gave: $answer"
version=$(lynx-sglang --version)
grep -q "supported" <<<"$version" || fail "lynx-sglang --version: $version"

log "restarting the prefill with --lynx-target int8 (the decode keeps exact)"
pkill -TERM -f -- "--disaggregation-mode prefill --port 30000" || true
timeout 60 sh -c 'while curl -sf localhost:30000/health >/dev/null 2>&1; do sleep 1; done'
sleep 3
# shellcheck disable=SC2086
python -m lynx_sglang.serve $COMMON --disaggregation-mode prefill --port 30000 --lynx-target int8 \
  >prefill-int8.log 2>&1 &
timeout 600 sh -c 'until curl -sf localhost:30000/health >/dev/null; do sleep 2; done'
refusals=()
for i in 1 2; do
  body=$(curl -s --max-time 120 localhost:8000/generate -H 'Content-Type: application/json' \
    -d '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}}' || true)
  grep -q -- "--lynx-target" <<<"$body" || fail "request $i after the mismatch answered: $body"
  refusals+=("$body")
done
# The connect-time refusal is logged once; each request then fails with its own line.
n_refused=$(grep -c "runs other --lynx-\* settings.*is closed and its requests fail" decode.log || true)
[ "$n_refused" = 1 ] || fail "the decode logged $n_refused session refusals, expected 1 (once, at connect)"

python - "$t_block" "$answer" "$version" "${refusals[0]}" <<'EOF'
import json, sys
t_block, answer, version, refusal = sys.argv[1:]
print(json.dumps({"block_seconds": int(t_block), "answer": json.loads(answer)["text"],
                  "version": version.splitlines(), "mismatch_answer": refusal[:400],
                  "decode_refusals_logged": 1}, indent=2))
EOF
log "OK: the docs' commands work as written; logs in $WORK/lynx-sglang"
