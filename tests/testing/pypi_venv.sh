# Shared by the test scripts that check stoke against a peer only PyPI has (ONNX Runtime,
# TensorBoard). Source it, then:
#   pypi_venv VENV PACKAGE "what still ran without it"
# makes VENV once (Debian's numpy and torch stay visible through --system-site-packages; only
# PACKAGE and what it needs come from PyPI) and sets $python to its interpreter. When PyPI cannot
# be reached it says so and exits 77, which ctest reports as skipped.
pypi_venv() {
  local venv=$1 package=$2 still_ran=$3
  if ! "$venv/bin/python" -c "import $package" 2>/dev/null; then
    echo "== installing $package from PyPI into $venv"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    if ! /usr/bin/python3 -m venv --system-site-packages "$venv" ||
       ! timeout 600 "$venv/bin/pip" install -q --disable-pip-version-check "$package"; then
      echo "SKIP: $package could not be installed from PyPI (offline?); $still_ran"
      rm -rf "$venv"
      exit 77
    fi
  fi
  python=$venv/bin/python
}
