"""torpor.db's tables: what :mod:`torpor.core.records` creates in a new state directory, and adds to an
older one of the same version (every table ``IF NOT EXISTS``, so a new table needs no migration)."""

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    command TEXT NOT NULL,
    cwd TEXT NOT NULL,
    state TEXT NOT NULL,
    pid INTEGER,
    pid_ticks INTEGER,
    launcher_pid INTEGER,
    log_path TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    exit_code INTEGER,
    message TEXT,
    restored_from TEXT
);
CREATE TABLE IF NOT EXISTS checkpoints (
    id TEXT PRIMARY KEY,
    job TEXT NOT NULL REFERENCES jobs(name) ON DELETE CASCADE,
    kind TEXT NOT NULL,
    created_at REAL NOT NULL,
    freeze_s REAL NOT NULL,
    total_s REAL NOT NULL,
    size_bytes INTEGER NOT NULL,
    criu_version TEXT NOT NULL,
    parent TEXT
);
CREATE INDEX IF NOT EXISTS checkpoints_by_job ON checkpoints(job, created_at);
-- a pre-copied checkpoint's rounds (JSON: [bytes, seconds] each), copied while the job ran
CREATE TABLE IF NOT EXISTS precopies (
    checkpoint TEXT PRIMARY KEY REFERENCES checkpoints(id) ON DELETE CASCADE,
    rounds TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS policies (
    job TEXT PRIMARY KEY REFERENCES jobs(name) ON DELETE CASCADE,
    policy TEXT NOT NULL,
    -- why the agent hibernated the job (idle, evacuation, shutdown), and the addresses it listened on
    hibernated_by TEXT,
    listened TEXT
);
-- what 'torpor submit' asked for: the job's request and how to start it; kept while the job lives (its
-- jobs row exists from its first start on): the scheduler's marks on it are here too
CREATE TABLE IF NOT EXISTS submissions (
    name TEXT PRIMARY KEY,
    command TEXT NOT NULL,
    cwd TEXT NOT NULL,
    env TEXT NOT NULL,
    umask INTEGER NOT NULL,
    memory INTEGER NOT NULL,
    cpus REAL NOT NULL,
    priority INTEGER NOT NULL,
    project TEXT NOT NULL,
    submitted_at REAL NOT NULL,
    started_at REAL,
    waited_s REAL NOT NULL DEFAULT 0,
    room_for TEXT,
    hibernated_at REAL,
    usage_at_hibernation INTEGER,
    cgroup_usage_at_hibernation INTEGER,
    mem_limit INTEGER,
    why TEXT
);
CREATE TABLE IF NOT EXISTS quotas (
    project TEXT PRIMARY KEY,
    share INTEGER NOT NULL,
    borrow_limit INTEGER
);
-- checkpoints kept as start points ('torpor template save', --warm-start): the image is the store's under
-- the checkpoint's id, owned by the template (it is in no job's checkpoints: retention and rm leave it)
CREATE TABLE IF NOT EXISTS templates (
    name TEXT PRIMARY KEY,
    checkpoint TEXT NOT NULL,
    source_job TEXT NOT NULL,
    created_at REAL NOT NULL,
    size_bytes INTEGER NOT NULL,
    freeze_s REAL NOT NULL,
    criu_version TEXT NOT NULL,
    command TEXT NOT NULL,
    cwd TEXT NOT NULL,
    -- the log its source job wrote to: a job started from it writes to its own instead
    log_path TEXT NOT NULL,
    -- [path, size, mtime_ns, inode] of each file its processes had mapped or open read-only
    files TEXT NOT NULL,
    -- [host, port] of each TCP address it listened on
    listens TEXT NOT NULL,
    ready_when TEXT,
    -- its job had a network of its own: its image names the namespace as external (core/jobnetworks.py)
    own_network INTEGER NOT NULL DEFAULT 0
);
-- where a job started from a template or with --warm-start comes from, and its own network if it has one
CREATE TABLE IF NOT EXISTS origins (
    job TEXT PRIMARY KEY REFERENCES jobs(name) ON DELETE CASCADE,
    template TEXT,
    warm TEXT,
    ready_when TEXT,
    address TEXT
);
-- other machines' agents ('torpor peers add'): the token and CA are secrets of this state directory
CREATE TABLE IF NOT EXISTS peers (
    name TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    token TEXT NOT NULL,
    ca TEXT,
    added_at REAL NOT NULL
);
-- a peer added by its certificate's fingerprint ('--fingerprint'): its ca is that certificate, pinned
CREATE TABLE IF NOT EXISTS peer_pins (
    name TEXT PRIMARY KEY REFERENCES peers(name) ON DELETE CASCADE,
    fingerprint TEXT NOT NULL
);
-- the hand-offs of jobs to and from peers (core/moves.py, policy/handoff.py): this side's record alone
CREATE TABLE IF NOT EXISTS moves_out (
    job TEXT PRIMARY KEY,
    phase TEXT NOT NULL,
    gen INTEGER NOT NULL,
    peer TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS moves_in (
    job TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    gen INTEGER NOT NULL,
    source TEXT NOT NULL,
    at REAL NOT NULL
);
-- a job's move here: for each chunk a source sent, the source's name of it and this store's
CREATE TABLE IF NOT EXISTS arrival_chunks (
    job TEXT NOT NULL,
    theirs TEXT NOT NULL,
    ours TEXT NOT NULL,
    PRIMARY KEY (job, theirs)
);
-- checkpoints that came from another machine, and the log their image writes to there (a restore
-- hands the job its log here in its place)
CREATE TABLE IF NOT EXISTS moved_images (
    checkpoint TEXT PRIMARY KEY,
    log_path TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    job TEXT,
    action TEXT NOT NULL,
    reason TEXT NOT NULL,
    detail TEXT NOT NULL
);
"""
