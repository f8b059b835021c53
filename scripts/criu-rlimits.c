/*
 * torpor's rlimit shim for criu: lets root without CAP_SYS_RESOURCE dump processes of another user.
 *
 * `criu dump` reads each task's resource limits with prlimit64(pid, res, NULL, &old). The kernel lets
 * the caller read another process's limits only if its real uid/gid equal the target's (real, effective
 * and saved), or it has CAP_SYS_RESOURCE in the target's user namespace. Root on some machines (containers)
 * lacks that capability, so the dump of a job started with `runuser -u postgres ...` fails with
 * "Can't get rlimit 0: Operation not permitted". /proc/PID/limits is readable by everyone and shows the
 * same values, so when a *read* of another process's limits fails with EPERM, this answers it from there.
 * Everything else (writes, other errors, success) is passed through untouched, so preloading it into
 * every criu run is harmless.
 *
 * Built by scripts/install-criu.sh into PREFIX/lib/torpor-criu-rlimits.so and preloaded by the criu
 * wrapper it writes (see docs/security.md).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The name /proc/PID/limits gives each resource: the kernel's lnames[] in fs/proc/base.c. */
static const char *const limit_names[] = {
    [RLIMIT_CPU] = "Max cpu time",
    [RLIMIT_FSIZE] = "Max file size",
    [RLIMIT_DATA] = "Max data size",
    [RLIMIT_STACK] = "Max stack size",
    [RLIMIT_CORE] = "Max core file size",
    [RLIMIT_RSS] = "Max resident set",
    [RLIMIT_NPROC] = "Max processes",
    [RLIMIT_NOFILE] = "Max open files",
    [RLIMIT_MEMLOCK] = "Max locked memory",
    [RLIMIT_AS] = "Max address space",
    [RLIMIT_LOCKS] = "Max file locks",
    [RLIMIT_SIGPENDING] = "Max pending signals",
    [RLIMIT_MSGQUEUE] = "Max msgqueue size",
    [RLIMIT_NICE] = "Max nice priority",
    [RLIMIT_RTPRIO] = "Max realtime priority",
    [RLIMIT_RTTIME] = "Max realtime timeout",
};
#define N_NAMES (sizeof(limit_names) / sizeof(limit_names[0]))

/* One field of a limits line: "unlimited" or a decimal number (the kernel prints rlim_t with %lu). */
static int parse_value(const char **cursor, rlim64_t *out)
{
    const char *p = *cursor;
    char *end;
    unsigned long long value;

    while (*p == ' ')
        p++;
    if (strncmp(p, "unlimited", 9) == 0 && (p[9] == ' ' || p[9] == '\n' || p[9] == '\0')) {
        *out = RLIM64_INFINITY;
        *cursor = p + 9;
        return 0;
    }
    if (*p < '0' || *p > '9')
        return -1;
    errno = 0;
    value = strtoull(p, &end, 10);
    if (errno != 0 || (*end != ' ' && *end != '\n' && *end != '\0'))
        return -1;
    *out = (rlim64_t)value;
    *cursor = end;
    return 0;
}

/* Fill *old with the soft and hard limit of resource res of process pid from /proc/PID/limits. */
static int limits_from_proc(pid_t pid, int res, struct rlimit64 *old)
{
    char path[64], text[4096];
    const char *line, *name;
    size_t used = 0, len;
    ssize_t got;
    int fd;

    if (res < 0 || (size_t)res >= N_NAMES || limit_names[res] == NULL)
        return -1;
    name = limit_names[res];
    len = strlen(name);
    snprintf(path, sizeof(path), "/proc/%d/limits", (int)pid);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    /* the file is ~1.4 KiB; one that does not fit (with room for the NUL) is not the format we know */
    while (used < sizeof(text) - 1 && (got = read(fd, text + used, sizeof(text) - 1 - used)) != 0) {
        if (got < 0) {
            if (errno == EINTR)
                continue;
            close(fd);
            return -1;
        }
        used += (size_t)got;
    }
    close(fd);
    if (used == sizeof(text) - 1)
        return -1;
    text[used] = '\0';

    /* each line: the name padded with spaces to 25 columns, a space, the soft limit, the hard limit, units */
    for (line = text; *line != '\0'; line++) {
        struct rlimit64 found;
        const char *cursor;

        /* strncmp stops at the NUL, so line[len] is read only when line holds the whole name */
        if (strncmp(line, name, len) == 0 && line[len] == ' ') {
            cursor = line + len;
            if (parse_value(&cursor, &found.rlim_cur) != 0 || parse_value(&cursor, &found.rlim_max) != 0)
                return -1;
            *old = found;
            return 0;
        }
        line = strchr(line, '\n');
        if (line == NULL)
            break;
    }
    return -1;
}

typedef long (*syscall_fn)(long, ...);

/* criu 4.x reads the limits with syscall(__NR_prlimit64, pid, res, NULL, &old) (criu/cr-dump.c,
 * dump_task_rlimits), so that is the call answered here; every other system call passes straight through
 * with its six argument registers (as glibc's own syscall() reads them). */
long syscall(long number, ...)
{
    static syscall_fn real;
    long arg[6], ret;
    va_list ap;
    int i, saved;

    va_start(ap, number);
    for (i = 0; i < 6; i++)
        arg[i] = va_arg(ap, long);
    va_end(ap);
    if (real == NULL)
        real = (syscall_fn)dlsym(RTLD_NEXT, "syscall");
    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    ret = real(number, arg[0], arg[1], arg[2], arg[3], arg[4], arg[5]);
    /* only a refused read (no new limit, somewhere to put the old one) of another process is answered */
    if (number != SYS_prlimit64 || ret == 0 || errno != EPERM || arg[2] != 0 || arg[3] == 0 || arg[0] <= 0)
        return ret;
    saved = errno;
    if (limits_from_proc((pid_t)arg[0], (int)arg[1], (struct rlimit64 *)arg[3]) == 0)
        return 0;
    errno = saved;
    return ret;
}
