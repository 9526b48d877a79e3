#!/usr/bin/env bash
# Run one benchmark command against two revisions of this repository, alternated
# A,B,A,B,... so that drift in machine load falls on both sides alike.
#
#   benchmarks/ab_revisions.sh BASE_REV NEW_REV ROUNDS -- COMMAND...
#   benchmarks/ab_revisions.sh 6628944 HEAD 3 -- benchmarks/engine_throughput.py --quick
#
# COMMAND runs with the repository's virtualenv Python from a worktree of each
# revision (PYTHONPATH points at that worktree, so `import pdserve` is that
# revision's code). Output of each run goes to OUT_DIR (default: a new temporary
# directory) as <round>-<A|B>.log; the last lines of each run are printed.
set -euo pipefail

if [[ $# -lt 5 || $4 != "--" ]]; then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
base=$1 new=$2 rounds=$3
shift 4
repo=$(git rev-parse --show-toplevel)
python=$repo/.venv/bin/python
out=${OUT_DIR:-$(mktemp -d -t pdserve-ab.XXXXXX)}
mkdir -p "$out"
trees=$(mktemp -d -t pdserve-ab-trees.XXXXXX)
cleanup() {
  git -C "$repo" worktree remove --force "$trees/A" 2>/dev/null || true
  git -C "$repo" worktree remove --force "$trees/B" 2>/dev/null || true
  rm -rf "$trees"
}
trap cleanup EXIT
git -C "$repo" worktree add --detach --quiet "$trees/A" "$base"
git -C "$repo" worktree add --detach --quiet "$trees/B" "$new"
echo "A = $(git -C "$repo" rev-parse --short "$base")  B = $(git -C "$repo" rev-parse --short "$new")  logs: $out"
for ((i = 1; i <= rounds; i++)); do
  for side in A B; do
    log=$out/$i-$side.log
    (cd "$trees/$side" && PYTHONPATH=$trees/$side "$python" "$@") >"$log" 2>&1
    echo "--- round $i $side"
    tail -n "${TAIL_LINES:-12}" "$log"
  done
done
