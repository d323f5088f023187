#!/usr/bin/env bash
# The volunteer's Docker path, end to end: build the CPU image, start a swarm in one container (`collab join`
# on the embedded default task), start a second container from the join line the first printed (with
# --client-mode, as the README's `docker run` line), wait until the second has averaged with the first, then
# `stop -t 10` each: both must leave within 10 s and exit 0. Prints a table; exits 1 if a check fails.
#
#   [ENGINE=docker] [WAIT_S=300] [IMAGE=collab:cpu] bash benchmarks/docker.sh [BUILD_ARG...]
#
# ENGINE defaults to ../shared/tools/container.sh (podman with the host's network and pip configuration) where it
# exists, else docker; it must run containers on the host's network (container.sh does; docker gets --network host
# from here). BUILD_ARGs go to the build; without any, this machine's own ones: its CPU torch wheel lies in
# /opt/wheels, and download.pytorch.org is out of its reach.
set -euo pipefail
cd "$(dirname "$0")/.."

here_engine=../shared/tools/container.sh
if [ -z "${ENGINE:-}" ]; then
    if [ -x "$here_engine" ]; then ENGINE=$here_engine; else ENGINE=docker; fi
fi
net=()
[ "$ENGINE" = docker ] && net=(--network host)
image=${IMAGE:-collab:cpu}
wait_s=${WAIT_S:-300}
build_args=("$@")
if [ ${#build_args[@]} -eq 0 ] && [ -d /opt/wheels ]; then
    build_args=(--build-arg TORCH_INDEX_URL= --build-arg TORCH_FIND_LINKS=/opt/wheels)
fi
run_id="docker-bench-$$"
first="collab-bench-first-$$"
second="collab-bench-second-$$"
out=$(mktemp -d)
started=()

cleanup() {
    for c in "${started[@]}"; do "$ENGINE" rm -f "$c" >/dev/null 2>&1 || true; done
    rm -rf "$out"
}
trap cleanup EXIT
die() { echo "docker.sh: $*" >&2; for c in "${started[@]}"; do echo "--- $c (last lines)" >&2; "$ENGINE" logs "$c" 2>&1 | tail -20 >&2 || true; done; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

echo "== build $image (${build_args[*]:-no build args})"
t=$(now)
"$ENGINE" build -t "$image" "${build_args[@]}" . >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; die "the build failed (its log is above)"; }
build_s=$(since "$t")
size=$("$ENGINE" image inspect -f '{{.Size}}' "$image" | awk '{ printf "%.2f GB", $1 / 1e9 }')
echo "built in $build_s s, $size"

echo "== first container: a new swarm"
"$ENGINE" run -d "${net[@]}" --name "$first" "$image" join --run-id "$run_id" --no-live >/dev/null
started+=("$first")
line=""
for _ in $(seq "$wait_s"); do
    # the line after "Others join with:" is what a volunteer pastes
    line=$("$ENGINE" logs "$first" 2>&1 | sed -n '/Others join with:/{n;p;q}')
    [ -n "$line" ] && break
    [ "$("$ENGINE" inspect -f '{{.State.Running}}' "$first")" = true ] || die "the first container exited before printing a join line"
    sleep 1
done
[ -n "$line" ] || die "the first container printed no join line in $wait_s s: raise WAIT_S or read its log"
echo "join line: $line"
read -ra join <<<"$line"
[ "${join[0]:-}" = collab ] && [ "${join[1]:-}" = join ] || die "the join line does not start with 'collab join': the printed format changed, fix the parsing here"

echo "== second container: from that line, --client-mode"
t=$(now)
"$ENGINE" run -d "${net[@]}" --name "$second" "$image" "${join[@]:1}" --client-mode --no-live >/dev/null
started+=("$second")
averaged_s=""
for _ in $(seq "$wait_s"); do
    # the epoch lines count this peer's averaging rounds: one or more means it trained together with the first
    if "$ENGINE" logs "$second" 2>&1 | grep -Eq 'averaging rounds [1-9]'; then averaged_s=$(since "$t"); break; fi
    [ "$("$ENGINE" inspect -f '{{.State.Running}}' "$second")" = true ] || die "the second container exited before averaging"
    sleep 1
done
[ -n "$averaged_s" ] || die "the second container averaged no round with the first in $wait_s s: raise WAIT_S or read the logs"
echo "the second averaged a round $averaged_s s after it started"
"$ENGINE" logs "$second" 2>&1 | grep -E 'Caught up|loading state|averaging rounds' | head -5 || true

fail=0
declare -A stop_s code
for c in "$second" "$first"; do
    t=$(now)
    "$ENGINE" stop -t 10 "$c" >/dev/null || { echo "FAIL: '$ENGINE stop $c' failed: see the engine's message above"; fail=1; }
    stop_s[$c]=$(since "$t")
    code[$c]=$("$ENGINE" inspect -f '{{.State.ExitCode}}' "$c")
    awk -v s="${stop_s[$c]}" 'BEGIN { exit !(s < 10) }' || { echo "FAIL: $c took ${stop_s[$c]} s to stop (limit 10 s)"; fail=1; }
    [ "${code[$c]}" = 0 ] || { echo "FAIL: $c exited ${code[$c]}, not 0"; fail=1; }
done
for c in "$first" "$second"; do echo "--- $c (last lines)"; "$ENGINE" logs "$c" 2>&1 | grep -v '^\s*$' | tail -4; done

echo
echo "| measure | value |"
echo "|---|---|"
echo "| build (s) | $build_s |"
echo "| image size | $size |"
echo "| second's first averaged round, after its start (s) | $averaged_s |"
echo "| stop -t 10, first (s) | ${stop_s[$first]} |"
echo "| stop -t 10, second (s) | ${stop_s[$second]} |"
echo "| exit code, first | ${code[$first]} |"
echo "| exit code, second | ${code[$second]} |"
[ "$fail" = 0 ] && echo "all checks passed" || { echo "some checks failed"; exit 1; }
