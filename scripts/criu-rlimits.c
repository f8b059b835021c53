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
 * It also lets a pre-copied checkpoint (torpor.core.precopy) dump only the pages a job wrote since its
 * last round of copying: see "pages since" below. Without TORPOR_PAGES_SINCE in criu's environment it
 * changes nothing there either.
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
#include <linux/fs.h>
#include <stdint.h>
#include <sys/ioctl.h>
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

/*
 * Pages since: criu 4.x lists the pages to dump with one PAGEMAP_SCAN ioctl per stretch of a task's
 * /proc/PID/pagemap (criu/pagemap-cache.c, pmc_fill: pages present or swapped, not the zero page, not
 * file pages). torpor tracks the job's writes (userfaultfd write-protection, torpor.adapters.writetrack)
 * and copies its memory while it runs; TORPOR_PAGES_SINCE names a folder holding "ranges", lines of
 * "PID START END" (decimal): the memory of process PID (as criu names it) whose pages torpor holds a copy
 * of, each as it was when last protected. For such a scan this asks the kernel for PAGE_IS_WRITTEN too,
 * drops from the answer the pages of those ranges not written since (criu does not dump them), and
 * appends every page the scan found, written or not, to "found-PID" in that folder (records of three
 * u64: start, end, categories), so that torpor can make the image whole: the pages found and not dumped
 * come from its copy, and a page it copied that is no longer there stays out. Any other ioctl, and a
 * scan of a process not named, passes straight through.
 */
#ifndef PAGEMAP_SCAN
struct page_region {
    uint64_t start, end, categories;
};
struct pm_scan_arg {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
    uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
#define PAGEMAP_SCAN _IOWR('f', 16, struct pm_scan_arg)
#define PAGE_IS_WRITTEN (1 << 1)
#define PAGE_IS_PRESENT (1 << 3)
#define PAGE_IS_SWAPPED (1 << 4)
#endif

struct since_range {
    long pid;
    uint64_t start, end;
};

static struct since_range *since;
static size_t n_since;
static const char *since_dir;
static int since_loaded;
static long since_started[1024]; /* the processes whose found-PID this criu has begun (a retry's is new) */
static size_t n_started;

/* Read the ranges once (criu is one process that scans after it froze the tree). Sorted by the file. */
static void load_since(void)
{
    char path[4096];
    FILE *file;
    struct since_range one;
    size_t room = 0;

    since_loaded = 1;
    since_dir = getenv("TORPOR_PAGES_SINCE");
    if (since_dir == NULL || snprintf(path, sizeof(path), "%s/ranges", since_dir) >= (int)sizeof(path))
        return;
    file = fopen(path, "re");
    if (file == NULL)
        return;
    while (fscanf(file, "%ld %lu %lu", &one.pid, &one.start, &one.end) == 3) {
        if (n_since == room) {
            struct since_range *more = realloc(since, (room = room ? room * 2 : 64) * sizeof(*since));
            if (more == NULL)
                break;
            since = more;
        }
        since[n_since++] = one;
    }
    fclose(file);
}

/* The PID whose pagemap descriptor fd is, or -1. */
static long pagemap_pid(int fd)
{
    char link[64], target[128];
    ssize_t len;
    long pid;
    char tail[16];

    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    len = readlink(link, target, sizeof(target) - 1);
    if (len <= 0)
        return -1;
    target[len] = '\0';
    if (sscanf(target, "/proc/%ld/%15s", &pid, tail) != 2 || strcmp(tail, "pagemap") != 0)
        return -1;
    return pid;
}

/* Append the pieces of [start, end) outside pid's ranges to out (at most room); the address where it
 * stopped for want of room, or end. */
static uint64_t keep_outside(long pid, uint64_t start, uint64_t end, uint64_t categories,
                             struct page_region *out, size_t *n, size_t room)
{
    size_t i;

    for (i = 0; i < n_since && start < end; i++) {
        if (since[i].pid != pid || since[i].end <= start || since[i].start >= end)
            continue;
        if (since[i].start > start) {
            if (*n == room)
                return start;
            out[(*n)++] = (struct page_region){start, since[i].start, categories};
        }
        start = since[i].end;
    }
    if (start < end) {
        if (*n == room)
            return start;
        out[(*n)++] = (struct page_region){start, end, categories};
    }
    return end;
}

typedef int (*ioctl_fn)(int, unsigned long, ...);

int ioctl(int fd, unsigned long request, ...)
{
    static ioctl_fn real;
    struct pm_scan_arg *scan;
    struct page_region *found, *kept;
    uint64_t asked, stop;
    size_t i, n = 0;
    long pid;
    void *arg;
    va_list ap;
    int ret, i_range, out, first;
    char path[4096];

    va_start(ap, request);
    arg = va_arg(ap, void *);
    va_end(ap);
    if (real == NULL)
        real = (ioctl_fn)dlsym(RTLD_NEXT, "ioctl");
    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    if (request != PAGEMAP_SCAN)
        return real(fd, request, arg);
    if (!since_loaded)
        load_since();
    scan = arg;
    if (n_since == 0 || scan->flags != 0 || scan->category_anyof_mask != (PAGE_IS_PRESENT | PAGE_IS_SWAPPED))
        return real(fd, request, arg);
    pid = pagemap_pid(fd);
    for (i_range = -1, i = 0; i < n_since; i++)
        if (since[i].pid == pid) {
            i_range = (int)i;
            break;
        }
    if (i_range < 0)
        return real(fd, request, arg);

    asked = scan->return_mask;
    scan->return_mask |= PAGE_IS_WRITTEN;
    ret = real(fd, request, arg);
    scan->return_mask = asked;
    if (ret <= 0)
        return ret;
    found = (struct page_region *)(uintptr_t)scan->vec;
    kept = malloc(scan->vec_len * sizeof(*kept));
    if (kept == NULL) {
        errno = ENOMEM;
        return -1;
    }
    stop = scan->walk_end;
    for (i = 0; i < (size_t)ret; i++) {
        uint64_t categories = found[i].categories & (asked | ~(uint64_t)PAGE_IS_WRITTEN);
        uint64_t reached;

        if (found[i].categories & PAGE_IS_WRITTEN) {
            if (n == scan->vec_len) {
                stop = found[i].start;
                break;
            }
            kept[n++] = (struct page_region){found[i].start, found[i].end, categories};
            continue;
        }
        reached = keep_outside(pid, found[i].start, found[i].end, categories, kept, &n, scan->vec_len);
        if (reached < found[i].end) {
            stop = reached;
            break;
        }
    }

    /* what this scan found, up to where criu goes on from */
    snprintf(path, sizeof(path), "%s/found-%ld", since_dir, pid);
    for (i = 0; i < n_started && since_started[i] != pid; i++)
        ;
    first = i == n_started; /* an earlier criu's (a failed attempt) is not this one's */
    if (first && n_started < sizeof(since_started) / sizeof(since_started[0]))
        since_started[n_started++] = pid;
    out = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (first ? O_TRUNC : 0), 0600);
    if (out < 0) {
        free(kept);
        return -1; /* criu fails the dump, and torpor makes a whole one */
    }
    for (i = 0; i < (size_t)ret && found[i].start < stop; i++) {
        struct page_region one = found[i];

        if (one.end > stop)
            one.end = stop;
        if (write(out, &one, sizeof(one)) != (ssize_t)sizeof(one)) {
            close(out);
            free(kept);
            errno = EIO;
            return -1;
        }
    }
    close(out);
    memcpy(found, kept, n * sizeof(*kept));
    free(kept);
    scan->walk_end = stop;
    return (int)n;
}
