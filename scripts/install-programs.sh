#!/usr/bin/env bash
# Install the real programs the test suite runs under torpor (tests/programs): PostgreSQL with pgbench,
# tmux, sqlite3, and gcc; and nft (nftables), with which torpor releases the network lock CRIU leaves for a
# hibernated job that is removed or rolled back (src/torpor/adapters/netlock.py); and chromium with its
# chromedriver, the headless browser in which tests/agent/test_page.py loads the agent's web page (Debian's
# own driver: selenium cannot download one here). From the machine's own Debian repositories; skips the
# work when all are present.
#
# torpor needs none of the programs (gcc builds its rlimit shim for criu; without nft those locks stay;
# the agent's page is for any browser).
# PostgreSQL's package may start the system's cluster; the tests never
# use it: they create their own cluster in a temporary folder and start it as a torpor job.
set -euo pipefail

packages=(postgresql postgresql-contrib tmux sqlite3 gcc libc6-dev nftables chromium chromium-driver)

pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }
have_all() {
    local tool
    for tool in tmux sqlite3 gcc runuser nft chromium chromedriver; do
        PATH=/usr/local/sbin:/usr/sbin:/sbin:$PATH command -v "$tool" >/dev/null || return 1
    done
    local bin
    bin=$(pg_bin)
    [ -n "$bin" ] && [ -x "$bin/postgres" ] && [ -x "$bin/pgbench" ] && [ -x "$bin/initdb" ]
}

if have_all; then
    echo "programs: PostgreSQL ($(pg_bin)), tmux, sqlite3, gcc, nft and chromium already installed"
    exit 0
fi

source "$(dirname "$0")/apt-install.sh"
debian_install programs "${packages[@]}"
have_all || { echo "programs: packages installed but a tool is missing" >&2; exit 1; }
echo "programs: installed PostgreSQL ($(pg_bin)), tmux, sqlite3, gcc, nft and chromium"
