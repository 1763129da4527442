# Shared by the test scripts that check stoke against a peer only PyPI has (ONNX Runtime,
# TensorBoard). Source it, then:
#   pypi_venv VENV PACKAGE "what still ran without it"
# makes VENV once (Debian's numpy and torch stay visible through --system-site-packages; only
# PACKAGE and what it needs come from PyPI) and sets $python to its interpreter. When PyPI cannot
# be reached it says so and exits 77, which ctest reports as skipped; any other failure (no venv
# module, no wheel for this Python, a full disk) fails the test with pip's own words.
pypi_venv() {
  local venv=$1 package=$2 still_ran=$3
  if ! "$venv/bin/python" -c "import $package" 2>/dev/null; then
    echo "== installing $package from PyPI into $venv"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    if ! /usr/bin/python3 -m venv --system-site-packages "$venv"; then
      echo "FAIL: /usr/bin/python3 -m venv $venv failed (is python3-venv installed?)"
      exit 1
    fi
    local log
    log=$(mktemp)
    if ! timeout 600 "$venv/bin/pip" install -q --disable-pip-version-check "$package" >"$log" 2>&1; then
      # Reachable at all? pip's own index query honours PIP_INDEX_URL and pip.conf.
      if ! timeout 60 "$venv/bin/pip" index versions --disable-pip-version-check pip >/dev/null 2>&1; then
        echo "SKIP: $package could not be installed: the package index cannot be reached (offline?); $still_ran"
        rm -rf "$venv" "$log"
        exit 77
      fi
      echo "FAIL: pip install $package failed though the package index answers:"
      cat "$log"
      rm -rf "$venv" "$log"
      exit 1
    fi
    rm -f "$log"
  fi
  python=$venv/bin/python
}
