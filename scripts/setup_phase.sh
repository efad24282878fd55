# Sourced by scripts/setup.sh: each phase of the set-up is one line on the terminal (what it does, ok
# and its time), while apt's and pip's own output (hundreds of lines, warnings about this machine's
# empty index folders) goes to one log file. A failing phase prints the log's path and its last lines,
# and the set-up stops with the phase's exit status.
#
#   SETUP_LOG=/path/setup.log; . scripts/setup_phase.sh; phase "what it does" command args...

: "${SETUP_LOG:?set SETUP_LOG to the log file before sourcing setup_phase.sh}"
SETUP_LOG_TAIL=${SETUP_LOG_TAIL:-25}

_now() { printf '%s' "${EPOCHREALTIME:-$(date +%s.%N)}"; }

phase() {  # phase "what it does" command args...: runs the command, its output to $SETUP_LOG
  local name=$1 start rc=0 took
  shift
  start=$(_now)
  printf '%-52s ' "$name"
  printf '\n=== %s: %s\n' "$name" "$*" >>"$SETUP_LOG"
  "$@" >>"$SETUP_LOG" 2>&1 || rc=$?
  took=$(awk -v a="$start" -v b="$(_now)" 'BEGIN { printf "%.1f", b - a }')
  if [ "$rc" = 0 ]; then
    printf 'ok  %6ss\n' "$took"
    return 0
  fi
  printf 'FAILED (exit %s) after %ss\n' "$rc" "$took"
  printf 'setup failed in "%s" (%s)\nthe full log: %s; its last %s lines:\n' "$name" "$*" "$SETUP_LOG" \
    "$SETUP_LOG_TAIL" >&2
  tail -n "$SETUP_LOG_TAIL" "$SETUP_LOG" | sed 's/^/  | /' >&2
  exit "$rc"
}
