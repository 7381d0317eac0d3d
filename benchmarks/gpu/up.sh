# Source at the start of every device command: . benchmarks/gpu/up.sh [.gpu/v/cN]
# Returns 0 when vLLM, TRL and the extras are importable (PYTHONPATH set), 3 while chunks are still missing, 1 on error.
. .gpu/s/env.sh
. .gpu/s/prologue.sh "$@"; _rc=$?
if [ $_rc = 0 ]; then
  if [ -d .gpu/x ] && [ ! -f /tmp/site2/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 .gpu/x/*.whl \
      && touch /tmp/site2/.done
  fi
  [ -f /tmp/site2/.done ] || echo "[up] the extra wheels are missing: carry .gpu/x with the last chunk"
  export PYTHONPATH=/tmp/site2:/tmp/site:$PWD
  python3 -c "import transformers, vllm, trl; print('[up]', transformers.__version__, vllm.__version__, trl.__version__)"
else
  export PYTHONPATH=$PWD
fi
(exit $_rc)
