"""One round of the memory-first scheduler: a snapshot in, the actions that keep the node safe and busy out.

The rules, in the order :func:`decide` applies them (each is the spec; the tests check each):

1. **The memory guard comes first.** When the node is about to run out of memory — MemAvailable below
   ``Rules.guard_available``, or PSI "full" avg10 above ``Rules.guard_psi_full`` — the guard hibernates
   running jobs until MemAvailable would be back at ``Rules.calm_available`` (counting what jobs already
   being hibernated will free; with only PSI to go by, one job per round), chosen by the victim order of
   :mod:`~torpor.policy.scheduler.victims` with growth past the request as the first tier. If even all
   of them would not reach it, all are hibernated: a checkpoint is better than the OOM killer. In such a
   round nothing starts or resumes.
2. **Limits rise before jobs die.** A running job whose cgroup usage reaches ``Rules.near_limit`` of its
   limit gets the limit raised (by ``Rules.raise_share`` of it, at least ``Rules.raise_min``) when the
   budget has that much room; the raise is taken from the room this round (nothing else starts in it).
   Without room (or while the guard acts) the job is hibernated (cause guard) instead of being
   OOM-killed by its cgroup; it comes back only when there is room for its charge *and* the raise, and
   its :class:`~torpor.policy.scheduler.actions.Resume` is followed by that ``RaiseLimit`` (restore it
   with the raised limit), so that it does not hit the same limit again at once.
3. **Admission.** A job *holds* memory while it is starting, running or hibernating; each holding job is
   charged its request, or its usage if it grew past it. A queued job starts (a hibernated one resumes)
   only when its charge fits in the budget less what the holding jobs are charged, and its project stays
   within its share plus its borrowing limit, and the node has the memory too: MemAvailable less the
   charges of this round's starts stays at least ``Rules.calm_available`` (memory used outside torpor
   counts; that threshold belongs below the reserve). A job that what is being hibernated would make
   fit waits for it (and the room is taken from what later candidates see). So after the actions, the
   requests (and charges) of holding jobs never exceed the budget.
4. **Order and aging.** Candidates — queued jobs and jobs the scheduler hibernated (preempted, reclaimed,
   guard; never those a user hibernated) — are taken by *effective priority*: priority + one level per
   ``Rules.aging_s`` seconds waited in all (``Job.waited_s``, its earlier waits, plus the current one:
   since submit for a queued job, since hibernation for a hibernated one), then the longest waiting,
   then the name. With quotas, candidates within their project's share
   go before those that would borrow (a guarantee is a guarantee), each group in that order.
   The first candidate that can neither start nor make room *holds* the room there is: no later
   candidate starts in it (it can still make room of its own by preemption). So a big job is not starved
   by small ones, and aging makes every waiting job the first in line in bounded time.
5. **Reclaim, then preemption.** A candidate that does not fit may make room by hibernating running jobs,
   chosen by :func:`~torpor.policy.scheduler.victims.choose`, only if they free enough (else none):

   Victims make up what free room (and the candidate's own promise) lacks; room that other jobs being
   hibernated will free counts only for waiting, not for choosing victims: it is promised to nobody.

   - *reclaim*: a candidate within its project's share may hibernate another project's borrowed work —
     its running jobs beyond that project's share (the first ones in victim order, as many as it is
     over by), whatever their priority. These go first;
   - *preemption*: any candidate may hibernate running jobs of strictly lower priority of its own
     project, and the borrowed work of other projects of strictly lower priority. Never a job of equal or
     higher priority, never another project's work within its share. A running job keeps the aging credit
     of its earlier waits (``Job.waited_s``), and a victim's effective priority must also be below the
     preemptor's: a job bumped again and again becomes safe from the lower priorities (no starvation by
     preemption: after ``aging_s`` × (the priority gap) of waiting in all).

   The candidate waits until they are hibernated and starts in a later round: the agent marks each
   victim's ``Job.room_for`` with the candidate (until the candidate starts), and the room those victims
   free stays promised to it (as far as it is still free: a job that grew may have taken some) — nobody
   else takes it, not the candidate holding the room, not the victims themselves: a victim comes back
   only once its preemptor has started (else it would take the room back with its aging and be
   preempted again, round after round).
6. **Hysteresis**: the guard acts below ``guard_available`` and every start or resume must leave
   ``calm_available`` (rule 3), so the node does not flap between the two; a job the guard hibernated
   also waits until PSI full avg10 is at most ``Rules.calm_psi_full``.

Every candidate that does not start gets a :class:`~torpor.policy.scheduler.actions.Wait` that says why.
Actions never kill. The decision is deterministic: the same snapshot gives the same actions.

Cost: one pass over the jobs, one sort of the candidates and one of the running jobs; a candidate that
fails to find victims is remembered by (project, priority, within-share) with the room it lacked and its
effective priority, so that the thousands of queued jobs behind it are answered in constant time each
(:func:`_admit_in_order`). The agent keeps job names unique.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from torpor.policy.scheduler import victims
from torpor.policy.scheduler.actions import Action, Hibernate, RaiseLimit, Resume, Start, Wait
from torpor.policy.scheduler.sizes import format_size
from torpor.policy.scheduler.snapshot import AUTO_RESUME, Cause, Job, Rules, Snapshot, State

HOLDING = frozenset({State.STARTING, State.RUNNING, State.HIBERNATING})
#: the quick answer of :func:`_admit_in_order` (the tests turn it off to check it changes nothing)
_FAST = True
# module constants: read once per job of a long queue, a global is faster than an enum's attribute
_QUEUED, _HIBERNATED = State.QUEUED, State.HIBERNATED


def effective_priority(job: Job, now: float, rules: Rules) -> float:
    """``job``'s priority plus one level per ``rules.aging_s`` seconds it has waited in all (rule 4):
    its earlier waits (``waited_s``) and, if it is waiting now, this one."""
    waited = job.waited_s
    if job.state in (State.QUEUED, State.HIBERNATED):
        waited += max(0.0, now - waiting_since(job))
    return job.priority + waited / rules.aging_s


def waiting_since(job: Job) -> float:
    """When ``job`` began to wait: its hibernation, or its submission."""
    if job.state is State.HIBERNATED and job.hibernated_at is not None:
        return job.hibernated_at
    return job.submitted_at


def _charge(job: Job) -> int:
    return job.charge


def _usage(job: Job) -> int:
    return job.usage


@dataclass
class _Round:
    """The running totals of one decision; every rule reads and updates them."""

    snapshot: Snapshot
    rules: Rules
    #: budget less the charges of holding jobs (negative when jobs grew past it)
    free: int = 0
    #: what jobs being hibernated will free, not yet promised to anyone
    pending: int = 0
    #: per waiting job: the room jobs hibernated for it (``Job.room_for``) freed (now) or will free (later)
    promised_now: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    promised_later: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: the candidates' names, when some job made room for one of them (else empty)
    waiting: set[str] = field(default_factory=set)
    #: per pool: requests of the jobs that start, run or will start (quota use)
    use: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: per pool: requests of the jobs that were starting or running and are not hibernated now (what
    #: tells borrowed work: this round's starts are not victims, so they do not count)
    held_use: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: charges of this round's starts and resumes (they lower MemAvailable once they run)
    started: int = 0
    running: dict[str, Job] = field(default_factory=dict)
    hibernations: list[Action] = field(default_factory=list)
    raises: list[Action] = field(default_factory=list)
    starts: list[Action] = field(default_factory=list)
    waits: list[Action] = field(default_factory=list)
    #: (pool, priority, within share) → the last failed victim search: (room it lacked, its effective
    #: priority); a candidate lacking as much or more with no higher effective priority fails the same
    failed: dict[tuple[str, int, bool], tuple[int, float]] = field(default_factory=dict)
    #: once a candidate holds the room (rule 4): what the candidates after it that cannot start wait for
    holder: str | None = None
    #: the least need that MemAvailable refused this round (0: none), and the message of the last refusal
    node_short: int = 0
    short_why: tuple[int, str] = (-1, "")
    quotas: bool = False
    shares: dict[str, int] = field(default_factory=dict)
    limits: dict[str, int | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        projects = self.snapshot.projects
        #: no projects: no quotas, one pool ("") whose share is the whole budget
        self.quotas = bool(projects)
        self.shares = {name: p.share for name, p in projects.items()} or {"": self.snapshot.budget}
        self.limits = {name: p.borrow_limit for name, p in projects.items()}

    def pool(self, job: Job) -> str:
        return job.project if self.quotas else ""

    def share(self, pool: str) -> int:
        return self.shares.get(pool, 0)

    def claim(self, need: int) -> None:
        """Promise ``need`` bytes (at most free + pending) to a waiting job: pending room first, so that
        free room stays free for jobs that can start now."""
        if self.free < 0:  # jobs grew past the budget: what is freed covers that first
            self.pending += self.free
            self.free = 0
        take = min(self.pending, need)
        self.pending -= take
        self.free -= need - take

    def short_of_memory(self, available: int) -> str:
        """Why a job the budget has room for waits: the node's MemAvailable (one message per value)."""
        if self.short_why[0] != available:
            calm = format_size(self.rules.calm_available)
            self.short_why = (
                available,
                f"the budget has room but the node has not: starting it would leave MemAvailable "
                f"({format_size(available)}) below {calm}",
            )
        return self.short_why[1]

    def hold(self, name: str) -> None:
        """Rule 4: the first candidate that cannot start holds the room there is (no later one starts in it)."""
        if self.holder is None:
            self.holder = f"in line behind {name}, which holds the free room"
            self.free, self.pending = min(self.free, 0), min(self.free + self.pending, 0) - min(self.free, 0)

    def hibernate(self, job: Job, cause: Cause, reason: str, for_job: str | None = None) -> None:
        """Record a hibernation: the job stops counting against its quota, its memory is pending."""
        del self.running[job.name]
        self.use[self.pool(job)] -= job.request
        self.held_use[self.pool(job)] -= job.request
        self.pending += job.charge  # still held until it is hibernated: promised room, not free room
        self.hibernations.append(Hibernate(job.name, cause, reason, for_job))


def decide(snapshot: Snapshot, rules: Rules | None = None) -> tuple[Action, ...]:
    """The actions for this round, in the order to execute them (see the module's docstring)."""
    rules = rules or Rules()
    r = _Round(snapshot, rules)
    r.free = snapshot.budget
    candidates: list[Job] = []
    hibernating: list[Job] = []
    for job in snapshot.jobs:  # one pass: the queue may be long
        state = job.state
        if state is _QUEUED or (state is _HIBERNATED and job.hibernated_by in AUTO_RESUME):
            candidates.append(job)
        elif state in HOLDING:
            r.free -= job.charge
            if state is State.HIBERNATING:
                hibernating.append(job)
            else:
                r.use[r.pool(job)] += job.request
                r.held_use[r.pool(job)] += job.request
                if state is State.RUNNING:
                    r.running[job.name] = job
    promising = [j for j in (*hibernating, *candidates) if j.room_for is not None]
    waiting = r.waiting = {job.name for job in candidates} if promising else set()
    for job in hibernating:
        if job.room_for not in waiting:
            r.pending += job.charge
    for job in sorted(promising, key=lambda j: (j.room_for or "", j.name)):
        if job.room_for in waiting and job.state is State.HIBERNATING:
            r.promised_later[job.room_for] += job.charge
        elif job.room_for in waiting and job.state is _HIBERNATED:
            # free, but not for anyone else — as far as it is free: jobs that grew may have taken it
            grant = min(job.charge, max(r.free, 0))
            r.promised_now[job.room_for] += grant
            r.free -= grant
    alarm = _guard(r, hibernating)
    _limits(r, raise_ok=alarm is None)
    _admit(r, candidates, alarm)
    return (*r.hibernations, *r.raises, *r.starts, *r.waits)


def _guard(r: _Round, hibernating: list[Job]) -> str | None:
    """Rule 1: why the node is short of memory (and the victims hibernated), or None when it is not."""
    rules, pressure = r.rules, r.snapshot.pressure
    available = pressure.mem_available
    alarm = None
    if available is not None and available < rules.guard_available:
        alarm = f"MemAvailable {format_size(available)} < {format_size(rules.guard_available)}"
    elif pressure.psi_full_avg10 is not None and pressure.psi_full_avg10 > rules.guard_psi_full:
        alarm = f"PSI full avg10 {pressure.psi_full_avg10:g} > {rules.guard_psi_full:g}"
    if alarm is None:
        return None
    in_flight = sum(j.usage for j in hibernating)
    deficit = rules.calm_available - available if available is not None else 0
    need = deficit - in_flight
    if need <= 0 and in_flight:
        return alarm  # what is being hibernated will do
    ranked = victims.ordered(((0 if j.growth else 1, j) for j in r.running.values()), _usage)
    chosen = victims.choose(ranked, max(need, 1), _usage) or ranked
    for _, job in chosen:
        r.hibernate(job, Cause.GUARD, f"memory guard: {alarm}")
    return alarm


def _limits(r: _Round, raise_ok: bool) -> None:
    """Rule 2: raise the limit of each running job near it, or hibernate it when there is no room (or,
    when the guard acts, no raise at all: its cgroup would kill it whatever the node's pressure)."""
    rules = r.rules
    for job in sorted(r.running.values(), key=lambda j: j.name):
        step = _raise_step(job, rules)
        if not step or job.limit is None or job.cgroup_usage is None:
            continue
        if raise_ok and r.free >= step:
            r.free -= step
            r.raises.append(RaiseLimit(job.name, job.limit + step))
        else:
            r.hibernate(
                job,
                Cause.GUARD,
                f"near its cgroup limit ({format_size(job.cgroup_usage)} of {format_size(job.limit)}) "
                + (
                    f"and the budget has no {format_size(step)} to raise it"
                    if raise_ok
                    else "while the node is short of memory"
                ),
            )


def _raise_step(job: Job, rules: Rules) -> int:
    """How much ``job``'s cgroup limit is to be raised by: 0 unless its usage is near the limit (rule 2)."""
    if job.limit is None or job.cgroup_usage is None or job.cgroup_usage < rules.near_limit * job.limit:
        return 0
    return max(int(job.limit * rules.raise_share), rules.raise_min)


def _admit(r: _Round, candidates: list[Job], alarm: str | None) -> None:
    """Rules 3–6 for every candidate, in order."""
    now, aging = r.snapshot.now, r.rules.aging_s
    keyed = []
    for index, job in enumerate(candidates):  # effective_priority, inlined: this runs for the whole queue
        since = job.submitted_at
        if job.state is _HIBERNATED and job.hibernated_at is not None:
            since = job.hibernated_at
        waited = job.waited_s + (now - since if now > since else 0.0)
        keyed.append((-(job.priority + waited / aging), since, job.name, index))
    keyed.sort()  # plain tuples sort fastest; the index (never reached: names are unique) points back
    if alarm is not None:
        why = f"the node is short of memory ({alarm}): nothing starts until it is not"
        r.waits.extend(Wait(name, why) for _, _, name, _ in keyed)
        return
    ranked_running = victims.ordered(((0, j) for j in r.running.values()), _charge)
    later = _admit_in_order(r, keyed, candidates, ranked_running, defer_borrowers=r.quotas)
    _admit_in_order(r, later, candidates, ranked_running, defer_borrowers=False)


def _admit_in_order(
    r: _Round,
    keyed: list[tuple[float, float, str, int]],
    candidates: list[Job],
    ranked_running: list[victims.Candidate],
    defer_borrowers: bool,
) -> list[tuple[float, float, str, int]]:
    """:func:`_admit_one` for each candidate in ``keyed``'s order; with ``defer_borrowers``, those that
    would borrow are left out and returned, for a second pass.

    The common case of a long queue is answered here, quickly: the room is held, no promise is left, no
    project has a borrowing limit, and a search for victims like this candidate's — same project,
    priority and within-share, lacking no more room and of no lower effective priority — already failed:
    it waits in line, as :func:`_admit_one` would say, without the call.
    """
    quotas, use, shares, failed = r.quotas, r.use, r.shares, r.failed
    no_limits = all(limit is None for limit in r.limits.values())
    guard = Cause.GUARD
    later = []
    fast, room, holder, short = False, 0, "", False
    available = r.snapshot.pressure.mem_available or 0
    wait = r.waits.append
    for item in keyed:
        job = candidates[item[3]]
        project = job.project
        within = True
        if quotas:
            within = use[project] + job.request <= shares.get(project, 0)
            if defer_borrowers and not within:
                later.append(item)
                continue
        if short and _FAST and job.hibernated_by is not guard and job.room_for is None:
            need = job.request if job.usage <= job.request else job.usage
            if r.node_short <= need <= r.free and not (quotas and r.limits.get(project) is not None):
                wait(Wait(job.name, r.short_of_memory(available - r.started)))
                continue
        if fast and _FAST and job.hibernated_by is not guard and job.room_for is None:
            seen = failed.get((project if quotas else "", job.priority, within))
            need = job.request if job.usage <= job.request else job.usage
            # as _admit_one would: no room to start or claim in (room <= 0 < need), and victims to find
            # for need - free (what it lacks), like a search that failed
            if seen is not None and need > 0 and need - r.free >= seen[0] and -item[0] <= seen[1]:
                wait(Wait(job.name, holder))
                continue
        _admit_one(r, job, -item[0], ranked_running, within)
        room = r.free + r.pending
        fast = (
            r.holder is not None and room <= 0 and not r.promised_now and not r.promised_later and no_limits
        )
        holder = r.holder or ""
        short = bool(r.node_short) and not r.promised_now and not r.promised_later  # (MemAvailable is known)
    return later


def _admit_one(
    r: _Round, job: Job, effective: float, ranked_running: list[victims.Candidate], within: bool
) -> None:
    """Rules 3, 5 and 6 for one candidate of ``effective`` priority."""
    pool = job.project if r.quotas else ""
    # a job hibernated near its limit comes back only with room to grow (a queued one has no cgroup yet)
    step = _raise_step(job, r.rules) if job.state is _HIBERNATED else 0
    need = job.charge + step
    if r.quotas:
        limit = r.limits.get(pool)
        if limit is not None and r.use[pool] + job.request > r.share(pool) + limit:
            r.waits.append(
                Wait(
                    job.name,
                    f"project {pool} would use {format_size(r.use[pool] + job.request)}, beyond its share "
                    f"{format_size(r.share(pool))} and borrowing limit {format_size(limit)}",
                )
            )
            return
    if job.room_for is not None and job.room_for in r.waiting:
        r.waits.append(Wait(job.name, f"made room for {job.room_for}: comes back once that has started"))
        return
    if job.state is State.HIBERNATED and job.hibernated_by is Cause.GUARD and not _calm(r, job):
        r.waits.append(Wait(job.name, "hibernated by the memory guard: waits until memory is calm again"))
        return
    own_later = 0  # the room its victims freed or will free: only it may take it
    if r.promised_now or r.promised_later:
        r.free += r.promised_now.pop(job.name, 0)
        own_later = r.promised_later.pop(job.name, 0)
        r.pending += own_later
    if need <= r.free:
        available = r.snapshot.pressure.mem_available
        if available is not None and available - r.started - need < r.rules.calm_available:
            # memory used outside torpor is passing: the job does not hold the room for it (rule 4)
            r.waits.append(Wait(job.name, r.short_of_memory(available - r.started)))
            r.node_short = min(need, r.node_short) if r.node_short else need
            return
        r.free -= need
        r.started += need
        r.use[pool] += job.request
        r.starts.append(Resume(job.name) if job.state is State.HIBERNATED else Start(job.name))
        if step and job.limit is not None:
            r.starts.append(RaiseLimit(job.name, job.limit + step))
        return
    if need <= r.free + r.pending:
        r.claim(need)
        r.use[pool] += job.request
        r.waits.append(Wait(job.name, "the room it needs is being freed (jobs are being hibernated)"))
        return
    # victims make up what free room and its own promise lack, not counting on the rest of what is
    # being freed: that is promised to nobody, and the next round may see it taken — and the victims
    # hibernated for nothing
    lacking = need - (r.free + own_later)
    key = (pool, job.priority, within)
    failed = r.failed.get(key)
    chosen = None
    if failed is None or lacking < failed[0] or effective > failed[1]:
        chosen = victims.choose(_victims_for(r, job, effective, ranked_running, within), lacking, _charge)
        if chosen is None:
            r.failed[key] = (lacking, effective)
    if chosen is not None:
        for tier, victim in chosen:
            if tier == 0:
                cause = Cause.RECLAIMED
                reason = f"reclaimed for project {pool}: project {victim.project} is beyond its share"
            else:
                cause = Cause.PREEMPTED
                reason = f"preempted by {job.name} (priority {job.priority} > {victim.priority})"
            r.hibernate(victim, cause, reason, for_job=job.name)
        r.claim(need)
        r.use[pool] += job.request
        names = ", ".join(v.name for _, v in chosen)
        r.waits.append(Wait(job.name, f"making room: hibernating {names}"))
        return
    if r.holder is None:
        room = max(r.free + r.pending, 0)
        r.hold(job.name)
        r.waits.append(
            Wait(
                job.name,
                f"needs {format_size(need)}, {format_size(room)} of the budget {format_size(r.snapshot.budget)} "
                "is free or being freed, and no job of lower priority frees enough",
            )
        )
    else:
        r.waits.append(Wait(job.name, r.holder))


def _victims_for(
    r: _Round, job: Job, effective: float, ranked_running: list[victims.Candidate], within: bool
) -> list[victims.Candidate]:
    """The running jobs ``job`` (of ``effective`` priority) may hibernate (rule 5), tiered, in victim order."""
    pool = r.pool(job)
    now, rules = r.snapshot.now, r.rules

    def lower(victim: Job) -> bool:
        return victim.priority < job.priority and effective_priority(victim, now, rules) < effective

    use = r.held_use
    over = {p: use[p] - r.share(p) for p in use if p != pool and use[p] > r.share(p)}
    reclaim = r.quotas and within
    first: list[victims.Candidate] = []
    second: list[victims.Candidate] = []
    for _, victim in ranked_running:
        if victim.name not in r.running:
            continue
        vpool = r.pool(victim)
        if vpool == pool:
            if lower(victim):
                second.append((1, victim))
        elif over.get(vpool, 0) > 0:
            over[vpool] -= victim.request
            if reclaim:
                first.append((0, victim))
            elif lower(victim):
                second.append((1, victim))
    return first + second


def _calm(r: _Round, job: Job) -> bool:
    """Rule 6: whether a job the guard hibernated may come back now."""
    pressure, rules = r.snapshot.pressure, r.rules
    if pressure.psi_full_avg10 is not None and pressure.psi_full_avg10 > rules.calm_psi_full:
        return False
    if pressure.mem_available is None:
        return True
    return pressure.mem_available - r.started - job.charge >= rules.calm_available
