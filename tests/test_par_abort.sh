#!/usr/bin/env bash
# test_par_abort.sh — one rank failing ends the whole job: non-zero exit,
# within a bounded time, with the failing rank's message printed exactly
# once (fl_par_abort), and a failed cmocka assert on one rank of an MPI test
# aborts the job instead of hanging (tests/mpi_harness.h).
#
# Run by ctest with FL_MPIEXEC, FL_ABORT_HELPER and FL_MPI_TEST_COMM set
# (tests/CMakeLists.txt); arguments: flotilla binary, source dir (unused).
set -u
: "${FL_MPIEXEC:?}" "${FL_ABORT_HELPER:?}" "${FL_MPI_TEST_COMM:?}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fails=0

# run_job LIMIT_S COMMAND...: runs it (killed after 60 s at worst), sets
# rc and secs; the combined stdout+stderr is in $out.
run_job() {
    local limit=$1
    shift
    local t0 t1
    t0=$(date +%s.%N)
    timeout -k 5 60 "$@" >"$out" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    secs=$(echo "$t1 - $t0" | bc)
    if [ "$rc" -eq 0 ]; then
        echo "FAIL: exit 0 from: $*"; fails=$((fails + 1))
    elif [ "$rc" -eq 126 ] || [ "$rc" -eq 127 ]; then
        echo "FAIL: could not run: $*"; fails=$((fails + 1))
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "FAIL: hung (killed by timeout): $*"; fails=$((fails + 1))
    fi
    if [ "$(echo "$secs >= $limit" | bc)" -eq 1 ]; then
        echo "FAIL: took ${secs}s (limit ${limit}s): $*"; fails=$((fails + 1))
    fi
    echo "--- rc=$rc in ${secs}s: $*"
    sed 's/^/    | /' "$out"
}

# expect_once PATTERN: the pattern occurs on exactly one line of the output.
expect_once() {
    local n
    n=$(grep -c -F -- "$1" "$out")
    if [ "$n" -ne 1 ]; then
        echo "FAIL: expected '$1' exactly once, found $n times"; fails=$((fails + 1))
    fi
}

MPIRUN=("$FL_MPIEXEC" --allow-run-as-root --oversubscribe)

# 1. fl_par_abort on rank 1 of 3 while ranks 0 and 2 wait in an all-reduce.
run_job 30 "${MPIRUN[@]}" -n 3 "$FL_ABORT_HELPER" 1 plain
expect_once "flotilla: rank 1: injected failure on rank 1 of 3"

# 2. rank 0 of 4 (the scheduling rank) with a recorded status.
run_job 30 "${MPIRUN[@]}" -n 4 "$FL_ABORT_HELPER" 0 status
expect_once "flotilla: rank 0: FL_ERR_NOT_FOUND: shard model-00002-of-00002.safetensors is missing (rank 0)"

# 3. the last rank of 2.
run_job 30 "${MPIRUN[@]}" -n 2 "$FL_ABORT_HELPER" 1 plain
expect_once "injected failure on rank 1 of 2"

# 4. without MPI at all: printed once, exit 1.
run_job 30 "$FL_ABORT_HELPER" -1 nompi
expect_once "flotilla: injected failure before MPI_Init"
[ "$rc" -eq 1 ] || { echo "FAIL: nompi exit $rc, expected 1"; fails=$((fails + 1)); }

# 5. a failing cmocka assert on rank 2 of 3 in the collectives test.
run_job 30 env FL_TEST_FAIL_RANK=2 "${MPIRUN[@]}" -x FL_TEST_FAIL_RANK -n 3 "$FL_MPI_TEST_COMM"
expect_once "rank 2: injected failure (FL_TEST_FAIL_RANK)"
expect_once "rank 2: test failed; aborting the whole job"

if [ "$fails" -ne 0 ]; then
    echo "test_par_abort: $fails check(s) failed"
    exit 1
fi
echo "test_par_abort: all checks passed"
