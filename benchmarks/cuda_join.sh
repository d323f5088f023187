#!/usr/bin/env bash
# The CUDA path, end to end: two real `collab join` peers on this machine's GPU (default albert-base, precision
# auto: bf16 where the GPU has it; compiled), the second started from the first one's printed join line, as a
# volunteer would. Prints the GPU, each peer's summary (compile time, data pipeline) and the time per epoch. CI has
# no GPU and never runs this; run it where one is.
#   [DEVICE=cuda PRECISION=auto COMPILE=on] bash benchmarks/cuda_join.sh [CONFIG] [EPOCHS] [MICRO_BATCH|auto] [OUTDIR]
set -uo pipefail
config=${1:-albert-base}
epochs=${2:-5}
micro=${3:-32}
out=${4:-$(mktemp -d)}
mkdir -p "$out"
run_id="cuda-$$"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
python3 -c "import torch, hivemind; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'hivemind', hivemind.__version__)"

pids=()
cleanup() { for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null; done; sleep 5; for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; }
trap cleanup EXIT

start=$(date +%s)
python3 -m collab join --run-id "$run_id" --config "$config" --micro-batch-size "$micro" --max-epochs "$epochs" \
    --precision "${PRECISION:-auto}" --device "${DEVICE:-cuda}" --compile "${COMPILE:-on}" --no-live --summary-json "$out/peer0.json" >"$out/peer0.log" 2>&1 &
pids+=($!)
line=""
for _ in $(seq 300); do
    line=$(grep -o -- "--initial-peers [^ ]* --run-key [0-9a-f]*" "$out/peer0.log" | head -1)
    [ -n "$line" ] && break
    kill -0 "${pids[0]}" 2>/dev/null || break
    sleep 1
done
if [ -z "$line" ]; then echo "peer 0 printed no join line:"; tail -30 "$out/peer0.log"; exit 1; fi
echo "join line: collab join --run-id $run_id $line"
# shellcheck disable=SC2086  # the join line is several flags
python3 -m collab join --run-id "$run_id" $line --micro-batch-size "$micro" --max-epochs "$epochs" \
    --precision "${PRECISION:-auto}" --device "${DEVICE:-cuda}" --compile "${COMPILE:-on}" --no-live --summary-json "$out/peer1.json" >"$out/peer1.log" 2>&1 &
pids+=($!)
( while kill -0 "${pids[0]}" 2>/dev/null || kill -0 "${pids[1]}" 2>/dev/null; do
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >>"$out/gpu.csv" 2>/dev/null; sleep 2
  done ) &
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
echo "both peers exited after $(( $(date +%s) - start )) s (last exit code $rc)"
for i in 0 1; do
    echo "--- peer $i (last lines)"; grep -v "^\s*$" "$out/peer$i.log" | tail -12
    [ -f "$out/peer$i.json" ] && python3 - "$out/peer$i.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
loss = [v for _, v in sorted(s["loss_by_epoch"].items(), key=lambda kv: int(kv[0]))]
print(f"{s['device']}: epochs {s['start_epoch']}->{s['final_epoch']}, {s['samples_contributed']} samples in "
      f"{s['train_seconds']:.0f} s ({s['samples_contributed'] / s['train_seconds']:.1f} samples/s, computing "
      f"{s['compute_seconds'] / s['train_seconds']:.0%} of the time), rounds {s['rounds_joined']} ok / "
      f"{s['rounds_failed']} failed, loss {loss[0]:.3f} -> {loss[-1]:.3f}, fp16 overflows {s['fp16_overflows']}, "
      f"sent {s['allreduce_bytes_sent'] / 1e6:.1f} MB, exit: {s['exit_reason']}")
print(f"  compile: {s.get('compile')}; data pipeline: {s.get('pipeline')}")
EOF
done
[ -s "$out/gpu.csv" ] && echo "GPU utilization % / memory (samples every 2 s): $(sort -t, -k1 -n "$out/gpu.csv" | awk -F, '{u[NR]=$1; m=$2} END {print "median", u[int(NR/2)+1], "max", u[NR], "last mem", m}')"
exit $rc
