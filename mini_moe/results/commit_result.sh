# Sourced by the resumable runners in this folder (patch_vote.sh, subtasks_converged.sh): commit_result
# commits one results file; pin_source pins the code that trains.
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

# pin_source TREE SOURCE: check out SOURCE (a commit) in the detached worktree TREE and set RUN to a
# python command that imports mini_moe from there, so that later changes to mini_moe on main cannot
# reach a running study. Refuses to go on when the import does not come from TREE.
pin_source() {
  local tree=$1 source=$2
  if [ "$(git -C "$tree" rev-parse HEAD 2>/dev/null || true)" != "$(git rev-parse "$source")" ]; then
    git worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
    git worktree prune
    git worktree add -q --detach "$tree" "$source"
  fi
  echo "training with the code of $(git -C "$tree" rev-parse --short HEAD) in $tree"
  # PYTHONSAFEPATH: `python -m` must not put the current folder (this checkout's mini_moe) first.
  RUN="env PYTHONSAFEPATH=1 PYTHONPATH=$PWD/$tree $PY"
  case "$($RUN -c 'import mini_moe; print(mini_moe.__file__)')" in
    "$PWD/$tree/"*) ;;
    *) echo "pin_source: mini_moe does not import from $tree" >&2; return 2 ;;
  esac
}
