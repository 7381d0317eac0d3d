# Wait for a checkpoint started by ck.sh: bash benchmarks/gpu/waitck.sh DIR [MAX_S]
dir=$1; max=${2:-500}; start=$(date +%s)
until grep -q CKPT_DONE "$dir.log" 2>/dev/null; do
  pgrep -f prepare_checkpoint > /dev/null || { echo "[waitck] the writer is gone:"; tail -20 "$dir.log"; exit 1; }
  [ $(( $(date +%s) - start )) -gt "$max" ] && { echo "[waitck] still writing after $max s"; du -sh "$dir"; exit 2; }
  sleep 3
done
tail -2 "$dir.log"; du -sh "$dir"
