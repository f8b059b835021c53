# Sourced by scripts/install-slurm.sh and scripts/install-programs.sh: install Debian packages from the
# machine's own repositories, as root, answering no question and keeping the machine's config files.
#
#   debian_install WHO PACKAGE...   (WHO names the caller in its messages)

debian_install() {
    local who=$1
    shift
    if [ "$(id -u)" -ne 0 ]; then
        echo "$who: installing $* needs root (apt-get); run this script as root" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    local apt_install=(apt-get install -y -q -o Dpkg::Options::=--force-confdef
        -o Dpkg::Options::=--force-confold --no-install-recommends "$@")
    # the package lists may be missing (fresh container) or stale: refresh them once, only if needed
    if ! apt-cache show "$1" >/dev/null 2>&1 || ! "${apt_install[@]}"; then
        apt-get update -q
        "${apt_install[@]}"
    fi
}
