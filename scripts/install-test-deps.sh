#!/usr/bin/env sh
# System tools the observability tests use: Prometheus and promtool (the end-to-end
# scrape test, rule unit tests, `promtool check metrics`), Chromium (the status page in
# a headless browser), Node.js and npm (the dashboard's schema check).
#
# Installs what is missing with apt-get (Debian/Ubuntu, as root or with password-less
# sudo) and does nothing when all are present. Anywhere else it says what to install
# and exits 0: the tests that need a missing tool skip, naming it. With CI set, a tool
# it could not install is an error.
set -eu

missing=""
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
  || missing="$missing prometheus"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v npm >/dev/null 2>&1 || missing="$missing nodejs npm"
[ -z "$missing" ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo="sudo -n"
fi
if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$sudo" ]; }; then
  echo "install-test-deps: apt-get install$missing" >&2
  # shellcheck disable=SC2086  # $missing is a list of package names
  if $sudo apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      $missing >/dev/null; then
    exit 0
  fi
fi

echo "install-test-deps: could not install$missing; on Debian/Ubuntu:" \
  "apt-get install --no-install-recommends$missing. Tests that need them will skip." >&2
if [ -n "${CI:-}" ]; then
  exit 1
fi
exit 0
