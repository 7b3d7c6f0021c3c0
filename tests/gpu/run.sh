#!/usr/bin/env bash
# The one call on a GPU machine: unpacks what tests/gpu/prepare.sh built
# (target/gpu-carry) and runs tests/gpu/measure.py with the machine's own
# python (its PyTorch, JAX and Equinox). The tables go to stdout, and to
# $OUT/gpu.md where the device tool gives an $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
carry=target/gpu-carry
run=${TMPDIR:-/tmp}/berth-gpu-carry
rm -rf "$run"
mkdir -p "$run/models"
unpack() { xz -dc "$carry/$1.xz" > "$2" && chmod +x "$2"; }
unpack berth "$run/berth"
unpack berth-worker-cuda "$run/berth-worker-cuda"
unpack smollm2-cut.gguf "$run/models/smollm2-cut.gguf"
unpack minilm-tokenizer.json "$run/models/minilm-tokenizer.json"
if [ -n "${OUT:-}" ]; then
    python3 tests/gpu/measure.py --carry "$run" "$@" | tee "$OUT/gpu.md"
else
    exec python3 tests/gpu/measure.py --carry "$run" "$@"
fi
