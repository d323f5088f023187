#!/usr/bin/env bash
# The checks that need a machine this one is not: many cores (issue 36's swarms of 32 and 64 peers) and a GPU
# (issue 35's overhead against a strong user's loop). One prepared run, each part under its own time limit, each
# part's output written as it comes, so a run cut short keeps what it measured. CI never runs this.
#   [PEERS=32,64 DURATION=55 SCALE_S=340 SCALE_ARGS="--overlap none,full" GPU_S=200 GPU=off] bash benchmarks/device_check.sh [OUTDIR]
# Run it from a folder where `collab` is the installed package (scale.py starts `python -m collab` in the
# benchmarks' parent folder: the repository's own collab/ would shadow the installed one's collab.peers there).
set -uo pipefail
out=${1:-$(mktemp -d)}
mkdir -p "$out/reports"
here=$(cd "$(dirname "$0")" && pwd)

{
    echo "cores $(nproc), memory $(free -g | awk '/Mem:/ {print $2}') GiB"
    # whether those are physical cores or two hardware threads each: 12 peers computing at half their lone pace on
    # "16 cores" (docs/benchmarks.md, 2026-12-04) would be the latter
    lscpu 2>/dev/null | grep -E "^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|L3 cache)" || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
    python3 -c "import sys, torch, hivemind, collab; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.cuda.is_available(), 'hivemind', hivemind.__version__, 'collab at', collab.__file__)"
} 2>&1 | tee "$out/machine.txt"

echo "=== scale: linreg swarms of ${PEERS:-32,64} peers, ${DURATION:-55} s each"
OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 timeout -k 15 "${SCALE_S:-340}" python3 "$here/scale.py" \
    --peers "${PEERS:-32,64}" --duration "${DURATION:-55}" --reports "$out/reports" ${SCALE_ARGS:-} 2>&1 | tee "$out/scale.txt"
echo "scale exit: ${PIPESTATUS[0]}"

if [ "${GPU:-on}" = on ] && python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "=== GPU: overhead.py, albert-base, compiled bf16 on both sides, micro-batch 32, 3 collaborative steps"
    PYTHONUNBUFFERED=1 timeout -k 15 "${GPU_S:-200}" python3 "$here/overhead.py" --config albert-base --device cuda \
        --micro-batch-size 32 --epochs 3 2>&1 | tee "$out/overhead.txt"
    echo "overhead exit: ${PIPESTATUS[0]}"
fi
tar -czf "$out/reports.tgz" -C "$out" reports && rm -rf "$out/reports"
