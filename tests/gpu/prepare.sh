#!/usr/bin/env bash
# Builds, on a machine without a GPU, what tests/gpu/measure.py needs on a
# GPU machine that reaches no registry, into target/gpu-carry (at most
# 64 MiB, compressed): berth (its own stock worker), the CUDA worker
# (candle's kernels as machine code for ARCH), the SmolLM2 GGUF cut to 2
# blocks and MiniLM's tokenizer. Then, on the GPU machine:
#
#   tests/gpu/prepare.sh 13.0 90          # here: the driver's CUDA version, the GPU's architecture
#   tests/gpu/run.sh                      # there (the device tool: carry target/gpu-carry)
set -euo pipefail
cd "$(dirname "$0")/../.."
cuda=${1:-13.0}
arch=${2:-90}
out=target/gpu-carry
rm -rf "$out"
mkdir -p "$out"

cargo build --release --workspace --bins
python3 deploy/cuda/build_worker.py --cuda "$cuda" --arch "$arch" --out target/cuda/berth-worker-cuda

pack() { # pack SOURCE NAME: stripped where it is a program, then xz
    local tmp
    tmp=$(mktemp)
    cp "$1" "$tmp"
    if file -b "$tmp" | grep -q ELF; then strip "$tmp"; fi
    xz -T0 -9 -c "$tmp" > "$out/$2.xz"
    rm -f "$tmp"
}
pack target/release/berth berth
pack target/cuda/berth-worker-cuda berth-worker-cuda
gguf=$(target/release/berth fetch smollm2 | cut -f3)
minilm=$(target/release/berth fetch minilm | cut -f3)
python3 tests/gpu/cut_gguf.py "$gguf" target/smollm2-cut.gguf --blocks 2
pack target/smollm2-cut.gguf smollm2-cut.gguf
pack "$minilm/tokenizer.json" minilm-tokenizer.json
size=$(du -sb "$out" | cut -f1)
ls -la "$out"
echo "target/gpu-carry: $((size >> 20)) MiB (the device tool carries at most 64)"
[ "$size" -le $((64 << 20)) ]
