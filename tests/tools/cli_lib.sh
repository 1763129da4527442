# Shared by the CLI test scripts: a scratch directory and `check`, which runs a command and
# compares its exit code and output with what a user should see. Source it after setting $stoke.
# A script that defines `diagnose` gets its output under every failed check.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
passed=0

check() {  # check NAME EXPECTED_RC PATTERN -- command...
  local name=$1 want_rc=$2 pattern=$3
  shift 4
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if [[ $rc -ne $want_rc ]] || ! grep -qE -- "$pattern" <<<"$out"; then
    echo "FAIL $name: exit $rc (want $want_rc), output lacks /$pattern/:"
    sed 's/^/    /' <<<"$out" | head -20
    if declare -F diagnose >/dev/null; then diagnose 2>&1 | sed 's/^/    /'; fi
    failures=$((failures + 1))
  else
    echo "ok   $name"
    passed=$((passed + 1))
  fi
}

finish() {
  echo "$passed passed, $failures failed"
  [[ $failures -eq 0 ]]
}
