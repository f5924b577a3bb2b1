# Sourced by the resumable runners in this folder (patch_vote.sh, subtasks_converged.sh).
# commit_result FILE MESSAGE: commit FILE alone (nothing else that is staged), waiting while
# another git command holds the index; a no-op when FILE is tracked and unchanged.
commit_result() {
  local file=$1 message=$2 lock tries
  lock=$(git rev-parse --git-path index.lock)
  for tries in $(seq 1 120); do
    if [ -e "$lock" ]; then sleep 5; continue; fi
    if git diff --quiet HEAD -- "$file" 2>/dev/null && git ls-files --error-unmatch -- "$file" >/dev/null 2>&1; then
      return 0  # nothing new
    fi
    if git add -- "$file" && git commit -q -m "$message" -- "$file"; then return 0; fi
    sleep 5
  done
  echo "commit_result: could not commit $file" >&2
  return 1
}
