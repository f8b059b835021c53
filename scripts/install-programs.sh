#!/usr/bin/env bash
# Install the real programs the test suite runs under torpor (tests/programs): PostgreSQL with pgbench,
# tmux, sqlite3, gcc, and redis (moved between nodes by tests/agent/test_migrate.py); and nft (nftables),
# with which torpor releases the network lock CRIU leaves for a
# hibernated job that is removed or rolled back (src/torpor/adapters/netlock.py); and chromium with its
# chromedriver, the headless browser in which tests/agent/test_page.py loads the agent's web page (Debian's
# own driver: selenium cannot download one here). From the machine's own Debian repositories; skips the
# work when all are present.
#
# torpor needs none of the programs (gcc builds its rlimit shim for criu; without nft those locks stay;
# the agent's page is for any browser).
# PostgreSQL's and redis's packages may start the system's own servers; the tests never
# use them: they start their own, in temporary folders, as torpor jobs.
set -euo pipefail

packages=(postgresql postgresql-contrib tmux sqlite3 gcc libc6-dev nftables chromium chromium-driver redis-server)

pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }
have_all() {
    local tool
    for tool in tmux sqlite3 gcc runuser nft chromium chromedriver redis-server; do
        PATH=/usr/local/sbin:/usr/sbin:/sbin:$PATH command -v "$tool" >/dev/null || return 1
    done
    local bin
    bin=$(pg_bin)
    [ -n "$bin" ] && [ -x "$bin/postgres" ] && [ -x "$bin/pgbench" ] && [ -x "$bin/initdb" ]
}

if have_all; then
    echo "programs: PostgreSQL ($(pg_bin)), tmux, sqlite3, gcc, nft, chromium and redis already installed"
    exit 0
fi

source "$(dirname "$0")/apt-install.sh"
debian_install programs "${packages[@]}"
have_all || { echo "programs: packages installed but a tool is missing" >&2; exit 1; }
echo "programs: installed PostgreSQL ($(pg_bin)), tmux, sqlite3, gcc, nft, chromium and redis"
