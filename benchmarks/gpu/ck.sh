# Start writing a bench checkpoint in the background, surviving the call: bash benchmarks/gpu/ck.sh SHAPE DIR
# The writer imports from a copy of the tree: the next call replaces the working tree while it may still be importing.
shape=$1; dir=$2
mkdir -p "$dir" /tmp/ck_code
rm -rf /tmp/ck_code/trl_turbo && cp -r trl_turbo /tmp/ck_code/
CUDA_VISIBLE_DEVICES=0 PYTHONPATH="/tmp/ck_code:$PYTHONPATH" setsid nohup python3 -c "
import time; from pathlib import Path; start = time.time()
from trl_turbo.bench.e2e import prepare_checkpoint
print(prepare_checkpoint('$shape', Path('$dir'), 0, 'cuda'), flush=True)
print('CKPT_DONE', round(time.time() - start, 1), 's', flush=True)
" > "$dir.log" 2>&1 < /dev/null &
echo "[ck] writer $! -> $dir.log"
