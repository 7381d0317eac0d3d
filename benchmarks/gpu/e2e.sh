# bash benchmarks/gpu/e2e.sh NAME ARGS...: `bench e2e ARGS --out $OUT`, the whole log in $OUT/NAME.log, the summary here
name=$1; shift
set -o pipefail
python3 -m trl_turbo.bench e2e "$@" --out "$OUT" 2>&1 | tee "$OUT/$name.log" \
  | grep --line-buffered -E "^ *(stock|turbo)|ready in|wrote|Error|error:|Traceback|out of memory|\"" \
  | grep --line-buffered -v -E "WARNING|INFO" | cut -c1-400
echo "[e2e] rc=$?"
