"""The memory-first scheduler's decisions (torpor.policy.scheduler): sizes, what submit refuses, each rule
of decide's docstring on a snapshot built in a line, then its invariants over thousands of random snapshots.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from torpor.policy.scheduler import (
    Action,
    Cause,
    Hibernate,
    Job,
    Pressure,
    Project,
    RaiseLimit,
    Resume,
    Rules,
    Snapshot,
    Start,
    State,
    Wait,
    decide,
    effective_priority,
    format_size,
    node_budget,
    parse_size,
    validate_quotas,
    validate_submit,
)

G = 1 << 30
M = 1 << 20
Q, R, H, HD = State.QUEUED, State.RUNNING, State.HIBERNATING, State.HIBERNATED


def job(name: str, state: State, gib: float, **fields: object) -> Job:
    return Job(name, state, int(gib * G), **fields)  # type: ignore[arg-type]


def node(*jobs: Job, budget: float = 10, now: float = 1000.0, **fields: object) -> Snapshot:
    return Snapshot(budget=int(budget * G), jobs=jobs, now=now, **fields)  # type: ignore[arg-type]


def by_job(actions: tuple[Action, ...]) -> dict[str, Action]:
    return {a.job: a for a in actions}


# sizes


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("500M", 500 * M),
        ("4G", 4 * G),
        ("1.5G", 3 * G // 2),
        ("512Ki", 512 << 10),
        ("4GiB", 4 * G),
        ("4gb", 4 * G),
        (" 2T ", 2 << 40),
        ("1024", 1024),
        ("0", 0),
        (".5K", 512),
    ],
)
def test_sizes_read_as_users_write_them(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "4X", "-1G", "4 G B", "1e3G", "four", "4G4", "nanG", "1.G"])
def test_a_malformed_size_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(ValueError, match="size") as caught:
        parse_size(text)
    assert "\n" not in str(caught.value)


def test_sizes_format_back_to_what_parse_reads() -> None:
    for size in (0, 100, 512 << 10, 500 * M, 4 * G, 3 * G // 2):
        assert parse_size(format_size(size)) == size


# submit


PROJECTS = {"vision": Project("vision", 4 * G), "nlp": Project("nlp", 4 * G)}


def test_a_good_submission_has_no_problem_and_may_borrow_beyond_its_share() -> None:
    assert validate_submit("6G", priority=0, project="nlp", budget=10 * G, projects=PROJECTS) == []


@pytest.mark.parametrize(
    ("memory", "priority", "project", "expect"),
    [
        ("11G", 0, "nlp", "larger than this node's whole budget"),
        ("4G", 0, "audio", "unknown project 'audio'"),
        ("4G", -1, "nlp", "a priority is 0 or more"),
        ("4Q", 0, "nlp", "--memory: '4Q' is not a size"),
        ("0", 0, "nlp", "must be more than 0"),
    ],
)
def test_bad_submissions_are_refused_with_one_line_each(
    memory: str, priority: int, project: str, expect: str
) -> None:
    problems = validate_submit(memory, priority=priority, project=project, budget=10 * G, projects=PROJECTS)
    assert len(problems) == 1
    assert expect in problems[0]
    assert "\n" not in problems[0]


def test_without_quotas_any_project_is_accepted() -> None:
    assert validate_submit(G, priority=3, project="whatever", budget=10 * G, projects={}) == []


def test_quotas_beyond_the_budget_or_negative_are_refused() -> None:
    assert validate_quotas(PROJECTS, 8 * G) == []
    assert "more than the budget" in validate_quotas(PROJECTS, 7 * G)[0]
    assert "0 or more" in validate_quotas({"x": Project("x", -1)}, G)[0]


def test_the_rules_numbers_are_checked_and_the_calm_level_must_lie_below_the_reserve() -> None:
    assert Rules().problems(reserve=4 * G) == []
    assert "below the reserve" in Rules().problems(reserve=G)[0]
    assert "below the calm level" in Rules(guard_available=3 * G, calm_available=2 * G).problems()[0]
    assert "aging" in Rules(aging_s=0).problems()[0]


# rule 3: admission


def test_a_job_starts_when_its_request_fits_the_budget_and_waits_otherwise() -> None:
    actions = decide(node(job("a", R, 6), job("b", Q, 4), job("c", Q, 1)))
    assert by_job(actions)["b"] == Start("b")
    assert isinstance(by_job(actions)["c"], Wait)
    assert "needs 1G" in by_job(actions)["c"].why  # type: ignore[union-attr]


def test_a_job_that_grew_past_its_request_is_charged_its_usage() -> None:
    actions = decide(node(job("a", R, 4, usage=8 * G), job("b", Q, 4)))
    assert isinstance(by_job(actions)["b"], Wait)


def test_memory_being_freed_is_promised_to_the_waiting_job_and_free_room_stays_usable() -> None:
    actions = decide(node(job("a", H, 6), job("big", Q, 6, priority=1), job("small", Q, 4)))
    assert "being freed" in by_job(actions)["big"].why  # type: ignore[union-attr]
    assert by_job(actions)["small"] == Start("small")


def test_a_blocked_job_holds_the_room_so_smaller_later_ones_do_not_starve_it() -> None:
    actions = decide(
        node(job("a", R, 6), job("big", Q, 6, submitted_at=0), job("small", Q, 1, submitted_at=1))
    )
    assert "in line behind big" in by_job(actions)["small"].why  # type: ignore[union-attr]


def test_user_hibernated_jobs_are_left_alone_and_scheduler_hibernated_ones_resume() -> None:
    jobs = (
        job("mine", HD, 2, hibernated_by=Cause.USER, hibernated_at=0),
        job("bumped", HD, 2, hibernated_by=Cause.PREEMPTED, hibernated_at=0),
    )
    assert decide(node(*jobs)) == (Resume("bumped"),)


# rule 4: order and aging


def test_candidates_go_by_priority_then_by_how_long_they_waited() -> None:
    jobs = (job("low", Q, 6, submitted_at=900), job("high", Q, 6, priority=1, submitted_at=999))
    assert decide(node(*jobs))[0] == Start("high")
    older = (job("new", Q, 6, submitted_at=999), job("old", Q, 6, submitted_at=1))
    assert decide(node(*older))[0] == Start("old")


def test_aging_raises_one_level_per_aging_period_so_a_low_job_overtakes_in_bounded_time() -> None:
    rules = Rules(aging_s=600)
    low = job("low", Q, 6, priority=0, submitted_at=0)
    assert effective_priority(low, now=1800, rules=rules) == pytest.approx(3.0)
    high = job("high", Q, 6, priority=2, submitted_at=1800)
    assert decide(node(low, high, now=1800), rules)[0] == Start("low")
    assert decide(node(low, high, now=1000), rules)[0] == Start("high")


# rules 5: preemption and reclaim


def test_a_higher_priority_job_preempts_the_least_valuable_and_waits_for_them() -> None:
    jobs = (
        job("p1-fresh", R, 3, priority=1, work_since_checkpoint_s=10),
        job("p1-stale", R, 3, priority=1, work_since_checkpoint_s=900),
        job("p2", R, 3, priority=2),
        job("urgent", Q, 3, priority=5),
    )
    actions = decide(node(*jobs))
    assert actions == (
        Hibernate("p1-fresh", Cause.PREEMPTED, "preempted by urgent (priority 5 > 1)", for_job="urgent"),
        Wait("urgent", "making room: hibernating p1-fresh"),
    )


def test_the_room_victims_free_stays_promised_to_their_preemptor_even_over_the_room_holder() -> None:
    jobs = (
        job("victim", H, 4, room_for="urgent"),
        job("aged", Q, 8, submitted_at=0),
        job("urgent", Q, 4, priority=3, submitted_at=999),
        job("runner", R, 6, priority=9),
    )
    actions = by_job(decide(node(*jobs, now=7200)))
    assert "in line behind" not in actions["urgent"].why  # type: ignore[union-attr]
    assert "being freed" in actions["urgent"].why  # type: ignore[union-attr]
    assert not any(isinstance(a, Hibernate) for a in actions.values())


def test_a_job_keeps_its_aging_credit_while_it_runs_and_lower_priorities_cannot_bump_it_again() -> None:
    bumped = job("bumped", R, 6, priority=0, waited_s=3 * 600)
    fresh = job("fresh", R, 4, priority=0)
    # without the credit the larger (bumped) would be the victim: fewest victims
    actions = decide(node(bumped, fresh, job("p2", Q, 4, priority=2, submitted_at=1000)))
    assert [a.job for a in actions if isinstance(a, Hibernate)] == ["fresh"]
    alone = decide(node(bumped, job("p2", Q, 6, priority=2, submitted_at=1000), budget=6))
    assert not any(isinstance(a, Hibernate) for a in alone)


def test_a_victim_does_not_take_back_the_room_it_made_before_its_preemptor_starts() -> None:
    jobs = (
        job("victim", HD, 4, priority=0, room_for="urgent", hibernated_by=Cause.PREEMPTED, hibernated_at=0),
        job("urgent", Q, 6, priority=3, submitted_at=999),
        job("runner", R, 4, priority=9),
    )
    actions = by_job(decide(node(*jobs, now=99_000)))  # the victim has aged far above the preemptor
    assert actions["urgent"] == Start("urgent")
    assert "made room for urgent" in actions["victim"].why  # type: ignore[union-attr]


def test_a_promise_is_only_as_large_as_the_room_really_free() -> None:
    jobs = (
        job("victim", HD, 4, room_for="urgent", hibernated_by=Cause.PREEMPTED, hibernated_at=0),
        job("grown", R, 4, usage=8 * G, priority=9),  # took the victim's room by growing
        job("urgent", Q, 4, priority=3),
    )
    assert isinstance(by_job(decide(node(*jobs)))["urgent"], Wait)


def test_a_job_starts_only_if_the_node_has_the_memory_too_not_only_the_budget() -> None:
    rules = Rules(calm_available=2 * G)
    short = Pressure(mem_available=5 * G)  # memory used outside torpor took the rest
    actions = by_job(decide(node(job("a", Q, 4), job("b", Q, 2), pressure=short), rules))
    assert "would leave MemAvailable (5G) below 2G" in actions["a"].why  # type: ignore[union-attr]
    assert actions["b"] == Start("b")


def test_fewest_victims_among_equals_and_the_reprieve_drops_the_unneeded() -> None:
    jobs = (
        job("small", R, 1, priority=0),
        job("big", R, 6, priority=0),
        job("other", R, 3, priority=0),
        job("urgent", Q, 6, priority=1),
    )
    hibernated = [a.job for a in decide(node(*jobs)) if isinstance(a, Hibernate)]
    assert hibernated == ["big"]


def test_nobody_is_preempted_when_all_victims_together_do_not_make_room() -> None:
    jobs = (job("low", R, 2, priority=0), job("same", R, 7, priority=3), job("urgent", Q, 9, priority=3))
    actions = decide(node(*jobs))
    assert not any(isinstance(a, Hibernate) for a in actions)
    assert "no job of lower priority frees enough" in by_job(actions)["urgent"].why  # type: ignore[union-attr]


def test_equal_or_higher_priority_is_never_preempted() -> None:
    jobs = (job("a", R, 5, priority=3), job("b", R, 5, priority=4), job("c", Q, 5, priority=3))
    assert not any(isinstance(a, Hibernate) for a in decide(node(*jobs)))


QUOTAS = {"a": Project("a", 5 * G), "b": Project("b", 5 * G)}


def test_a_project_borrows_what_the_other_leaves_unused() -> None:
    actions = decide(node(job("a1", R, 4, project="a"), job("a2", Q, 4, project="a"), projects=QUOTAS))
    assert by_job(actions)["a2"] == Start("a2")


def test_the_owner_reclaims_its_share_from_borrowed_work_whatever_its_priority() -> None:
    jobs = (
        job("a1", R, 4, project="a", priority=9),
        job("a2", R, 4, project="a", priority=9, work_since_checkpoint_s=5),
        job("b1", Q, 4, project="b", priority=0),
    )
    actions = decide(node(*jobs, projects=QUOTAS))
    hib = [a for a in actions if isinstance(a, Hibernate)]
    assert [(h.job, h.cause, h.for_job) for h in hib] == [("a1", Cause.RECLAIMED, "b1")]
    assert "project a is beyond its share" in hib[0].reason


def test_borrowed_work_goes_before_the_owners_own_lower_priority_jobs() -> None:
    jobs = (
        job("b-own-low", R, 2, project="b", priority=0),
        job("a-in", R, 4, project="a", priority=5),
        job("a-borrowed", R, 4, project="a", priority=5),
        job("b-new", Q, 2, project="b", priority=3),
    )
    hib = [a for a in decide(node(*jobs, projects=QUOTAS)) if isinstance(a, Hibernate)]
    assert [(h.job, h.cause) for h in hib] == [("a-borrowed", Cause.RECLAIMED)]


def test_work_within_its_share_is_not_preempted_by_another_project_even_of_higher_priority() -> None:
    jobs = (
        job("a-in", R, 5, project="a"),
        job("b-busy", R, 5, project="b"),
        job("b-big", Q, 5, project="b", priority=9),
    )
    actions = decide(node(*jobs, projects=QUOTAS))
    assert [a.job for a in actions if isinstance(a, Hibernate)] == ["b-busy"]


def test_a_borrowing_limit_caps_what_a_project_takes_beyond_its_share() -> None:
    quotas = {"a": Project("a", 4 * G, borrow_limit=2 * G), "b": Project("b", 6 * G)}
    actions = decide(node(job("a1", R, 4, project="a"), job("a2", Q, 3, project="a"), projects=quotas))
    assert "borrowing limit 2G" in by_job(actions)["a2"].why  # type: ignore[union-attr]


def test_owners_within_their_share_are_admitted_before_borrowers() -> None:
    jobs = (
        job("a-borrow", Q, 6, project="a", priority=9),
        job("b-own", Q, 5, project="b", priority=0),
        job("a1", R, 4, project="a"),
    )
    actions = decide(node(*jobs, projects=QUOTAS))
    assert by_job(actions)["b-own"] == Start("b-own")
    assert isinstance(by_job(actions)["a-borrow"], Wait)


# rules 1, 2, 6: the memory guard


def test_the_guard_hibernates_grown_work_first_until_memory_is_calm_and_nothing_starts() -> None:
    jobs = (
        job("steady", R, 3, priority=0, usage=3 * G),
        job("grower", R, 2, priority=5, usage=3 * G),
        job("next", Q, 1),
    )
    rules = Rules(guard_available=G, calm_available=2 * G)
    actions = decide(node(*jobs, pressure=Pressure(mem_available=G // 2)), rules)
    hib = [a for a in actions if isinstance(a, Hibernate)]
    assert [(h.job, h.cause) for h in hib] == [("grower", Cause.GUARD)]
    assert "MemAvailable 512M < 1G" in hib[0].reason
    assert "short of memory" in by_job(actions)["next"].why  # type: ignore[union-attr]


def test_the_guard_on_psi_alone_takes_one_job_and_waits_for_hibernations_in_flight() -> None:
    jobs = (job("a", R, 2, usage=2 * G), job("b", R, 2, usage=2 * G, priority=1))
    hot = Pressure(psi_full_avg10=40.0)
    assert [a.job for a in decide(node(*jobs, pressure=hot)) if isinstance(a, Hibernate)] == ["a"]
    flying = (job("a", H, 2, usage=2 * G), job("b", R, 2, usage=2 * G, priority=1))
    assert not any(isinstance(a, Hibernate) for a in decide(node(*flying, pressure=hot)))


def test_a_guard_victim_resumes_only_with_hysteresis() -> None:
    rules = Rules(guard_available=G, calm_available=3 * G)
    victim = job("v", HD, 1, usage=2 * G, hibernated_by=Cause.GUARD, hibernated_at=0)
    just_above_guard = Pressure(mem_available=int(1.5 * G))
    assert isinstance(decide(node(victim, pressure=just_above_guard), rules)[0], Wait)
    calm = Pressure(mem_available=5 * G, psi_full_avg10=0.0)
    assert decide(node(victim, pressure=calm), rules) == (Resume("v"),)
    stalled = Pressure(mem_available=5 * G, psi_full_avg10=5.0)
    assert isinstance(decide(node(victim, pressure=stalled), rules)[0], Wait)


def test_a_job_near_its_cgroup_limit_gets_it_raised_when_there_is_room_else_is_hibernated() -> None:
    near = job("j", R, 2, usage=int(1.9 * G), limit=2 * G, cgroup_usage=int(1.9 * G))
    assert decide(node(near)) == (RaiseLimit("j", int(2.5 * G)),)
    full = decide(node(near, job("other", R, 8)))
    assert [(a.job, a.cause) for a in full if isinstance(a, Hibernate)] == [("j", Cause.GUARD)]
    assert "no 512M to raise it" in full[0].reason  # type: ignore[union-attr]


def test_when_the_guard_acts_a_job_near_its_limit_is_hibernated_not_raised() -> None:
    near = job("j", R, 2, usage=int(1.9 * G), limit=2 * G, cgroup_usage=int(1.9 * G), priority=9)
    other = job("other", R, 4, usage=4 * G)
    actions = decide(node(near, other, pressure=Pressure(mem_available=G // 4)), Rules(calm_available=G))
    assert {(a.job, a.cause) for a in actions if isinstance(a, Hibernate)} == {
        ("j", Cause.GUARD),
        ("other", Cause.GUARD),
    }
    assert not any(isinstance(a, RaiseLimit) for a in actions)


def test_the_guard_hibernates_everyone_rather_than_leave_the_oom_killer_a_job() -> None:
    jobs = (job("a", R, 1, usage=G), job("b", R, 1, usage=G))
    actions = decide(node(*jobs, pressure=Pressure(mem_available=0)), Rules(calm_available=8 * G))
    assert sorted(a.job for a in actions if isinstance(a, Hibernate)) == ["a", "b"]


def test_a_raise_takes_its_room_before_any_start() -> None:
    near = job("j", R, 2, limit=2 * G, cgroup_usage=int(1.9 * G))
    actions = decide(node(near, job("q", Q, 7.8)))
    assert actions[0] == RaiseLimit("j", int(2.5 * G))
    assert isinstance(by_job(actions)["q"], Wait)


# invariants over random snapshots


def random_snapshot(rng: random.Random, most: int = 40, promises: float = 0.4) -> Snapshot:
    budget = rng.randint(8, 64) * G
    quotas = rng.random() < 0.6
    names = ["p", "q", "r"]
    projects = {}
    if quotas:
        shares = [rng.randint(0, budget // 3) for _ in names]
        projects = {
            n: Project(n, s, rng.choice([None, None, rng.randint(0, budget)]))
            for n, s in zip(names, shares, strict=True)
        }
    jobs = []
    for i in range(rng.randint(0, most)):
        state = rng.choice(list(State))
        request = rng.randint(1, max(1, budget // 4 // M)) * M
        usage = int(request * rng.uniform(0, 1.6)) if state is not Q else 0
        hibernated_by = rng.choice(list(Cause)) if state is HD else None
        limit = rng.choice([None, int(request * rng.uniform(1.0, 1.3))])
        jobs.append(
            Job(
                f"j{i}",
                state,
                request,
                priority=rng.randint(0, 5),
                project=rng.choice(names),
                submitted_at=rng.uniform(0, 5000),
                usage=usage,
                work_since_checkpoint_s=rng.uniform(0, 3600),
                hibernated_by=hibernated_by,
                hibernated_at=rng.uniform(0, 5000) if hibernated_by else None,
                limit=limit,
                cgroup_usage=int(limit * rng.uniform(0.5, 1.0)) if limit else None,
            )
        )
    names_of = [j.name for j in jobs]
    for i, j in enumerate(jobs):  # some were hibernated to make room for another
        if j.state in (H, HD) and rng.random() < promises:
            jobs[i] = replace(j, room_for=rng.choice(names_of))
    pressure = Pressure(
        mem_available=rng.choice([None, rng.randint(0, 8) * G // 2, rng.randint(0, budget)]),
        psi_full_avg10=rng.choice([None, 0.0, rng.uniform(0, 50)]),
    )
    return Snapshot(budget, tuple(jobs), now=5000.0, projects=projects, pressure=pressure)


HOLD = {State.STARTING, R, H}


def check_invariants(snap: Snapshot, actions: tuple[Action, ...]) -> None:
    jobs = {j.name: j for j in snap.jobs}
    named = [a.job for a in actions if not isinstance(a, RaiseLimit)]
    assert len(named) == len(set(named)), "one action per job"
    after = dict(jobs)
    for a in actions:
        before = jobs[a.job]
        if isinstance(a, Start):
            assert before.state is Q
            after[a.job] = replace(before, state=State.STARTING)
        elif isinstance(a, Resume):
            assert before.state is HD and before.hibernated_by is not Cause.USER
            after[a.job] = replace(before, state=State.STARTING)
        elif isinstance(a, Hibernate):
            assert before.state is R
            after[a.job] = replace(before, state=H)
            if a.cause is Cause.PREEMPTED:
                assert a.for_job is not None
                assert before.priority < jobs[a.for_job].priority
            if a.cause is Cause.RECLAIMED:
                assert a.for_job is not None and snap.projects
                owner = jobs[a.for_job].project
                assert before.project != owner
                held = sum(
                    j.request
                    for j in snap.jobs
                    if j.project == before.project and j.state in {R, State.STARTING}
                )
                assert held > snap.projects[before.project].share
        elif isinstance(a, Wait):
            assert before.state is Q or (before.state is HD and before.hibernated_by is not Cause.USER)
        else:
            assert isinstance(a, RaiseLimit) and before.limit is not None and a.limit > before.limit
            assert before.state is R or Resume(a.job) in actions
    if any(isinstance(a, Start | Resume) for a in actions):
        raised = sum(a.limit - jobs[a.job].limit for a in actions if isinstance(a, RaiseLimit))  # type: ignore[operator]
        assert sum(j.charge for j in after.values() if j.state in HOLD) + raised <= snap.budget
    before_requests = sum(j.request for j in jobs.values() if j.state in HOLD)
    after_requests = sum(j.request for j in after.values() if j.state in HOLD)
    assert after_requests <= max(snap.budget, before_requests)
    checked_reclaim_first(snap, actions, after)
    candidates = {
        j.name for j in snap.jobs if j.state is Q or (j.state is HD and j.hibernated_by is not Cause.USER)
    }
    assert {a.job for a in actions if isinstance(a, Start | Resume | Wait)} == candidates, (
        "every candidate is answered"
    )


def checked_reclaim_first(snap: Snapshot, actions: tuple[Action, ...], after: dict[str, Job]) -> int:
    """A preemptor within its share (counting everything its project starts or waits for this round)
    preempted by priority only once every other project is within its share or has no running job left.
    Returns how many such preemptions it checked."""
    if not snap.projects:
        return 0
    jobs = {j.name: j for j in snap.jobs}
    claimed = dict.fromkeys(snap.projects, 0)
    checked = 0
    for j in snap.jobs:
        if j.state in (R, State.STARTING) and j.project in claimed:
            claimed[j.project] += j.request
    for a in actions:
        promised = isinstance(a, Wait) and ("making room" in a.why or "being freed" in a.why)
        if (isinstance(a, Start | Resume) or promised) and jobs[a.job].project in claimed:
            claimed[jobs[a.job].project] += jobs[a.job].request
    for a in actions:
        if not (isinstance(a, Hibernate) and a.cause is Cause.PREEMPTED and a.for_job):
            continue
        owner = jobs[a.for_job].project
        if owner not in claimed or claimed[owner] > snap.projects[owner].share:
            continue
        checked += 1
        for p, project in snap.projects.items():
            if p == owner:
                continue
            # borrowed work left: jobs that held memory before this round and still do
            held = sum(
                j.request
                for j in after.values()
                if j.project == p
                and j.state in (R, State.STARTING)
                and jobs[j.name].state in (R, State.STARTING)
            )
            running = any(j.project == p and j.state is R for j in after.values())
            assert held <= project.share or not running, (a, p)
    return checked


def test_invariants_hold_over_random_snapshots_and_the_decision_is_deterministic() -> None:
    rng = random.Random(15)
    for _ in range(3000):
        snap = random_snapshot(rng)
        actions = decide(snap)
        check_invariants(snap, actions)
        shuffled = list(snap.jobs)
        rng.shuffle(shuffled)
        assert decide(replace(snap, jobs=tuple(shuffled))) == actions


def test_borrowed_work_is_hibernated_before_any_preemption_by_priority_on_random_borrowed_nodes() -> None:
    rng = random.Random(17)
    checked = 0
    projects = {n: Project(n, 8 * G) for n in ("p", "q", "r")}
    for _ in range(1000):
        # a full node: p borrows a little, r runs up to its share, q runs a few jobs of low priority
        # and wants room (within its share) for more of higher priority
        jobs = [
            job(f"p{i}", R, 1, project="p", priority=rng.randint(0, 5)) for i in range(8 + rng.randint(0, 2))
        ]
        jobs += [
            job(f"r{i}", R, 1, project="r", priority=rng.randint(0, 5)) for i in range(rng.randint(4, 8))
        ]
        jobs += [
            job(f"q{i}", R, 1, project="q", priority=rng.randint(0, 2)) for i in range(rng.randint(1, 4))
        ]
        q_held = sum(j.request for j in jobs if j.project == "q") // G
        jobs += [
            job(f"w{i}", Q, rng.randint(1, 8 - q_held), project="q", priority=rng.randint(1, 5))
            for i in range(rng.randint(1, 2))
        ]
        snap = node(*jobs, budget=sum(j.request for j in jobs if j.state is R) / G, projects=projects)
        actions = decide(snap)
        check_invariants(snap, actions)
        hibernated = {a.job for a in actions if isinstance(a, Hibernate)}
        after = {j.name: replace(j, state=H) if j.name in hibernated else j for j in snap.jobs}
        checked += checked_reclaim_first(snap, actions, after)
    assert checked > 50, checked


def test_the_node_budget_is_the_machine_less_the_reserve_or_what_was_given() -> None:
    total = 24 * G
    assert node_budget(total, None, None) == (total - 3 * G, 3 * G)  # a tenth is below the 3 G floor
    assert node_budget(64 * G, None, None) == (64 * G - 64 * G // 10, 64 * G // 10)
    assert node_budget(total, None, 4 * G) == (20 * G, 4 * G)
    assert node_budget(total, 1 * G, None) == (1 * G, 23 * G)
    assert node_budget(total, 16 * G, 8 * G) == (16 * G, 8 * G)
    for budget, reserve, words in (
        (None, 24 * G, "leaves nothing"),
        (20 * G, 8 * G, "more than this machine's memory (24G)"),
        (0, None, "--memory-budget must be more than 0"),
        (None, -1, "--memory-reserve must be 0 or more"),
    ):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            node_budget(total, budget, reserve)
