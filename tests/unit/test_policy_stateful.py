"""The pure policy driven by hypothesis through random schedules.

A small simulation: workers claim the best waiting job, the policy picks
victims, parked jobs go back to the queue with their key. The invariants are
the ones stated in scheduler/preempt.py and scheduler/state.py.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler.policy import Policy
from scheduler.preempt import PreemptPolicy, Runner, choose_victim, starvation_bound
from scheduler.state import TERMINAL, JobState, check_transition

POLICY = Policy(level_seconds=5.0, aging_rate=1.0)
PREEMPT = PreemptPolicy(margin=0.5, min_run_seconds=1.0)
WORKERS = ("w0", "w1")


class Schedule(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.state: dict[str, JobState] = {}
        self.key: dict[str, float] = {}
        self.arrived: dict[str, float] = {}
        self.first_ran: dict[str, float] = {}
        self.runner: dict[str, tuple[str, float] | None] = dict.fromkeys(WORKERS)
        self.checkpoints: dict[str, int] = {}
        self.n = 0

    def _move(self, job: str, target: JobState) -> None:
        self.state[job] = check_transition(self.state[job], target)

    def _waiting(self) -> list[str]:
        return [j for j, s in self.state.items() if s in (JobState.QUEUED, JobState.PARKED)]

    @rule(level=st.sampled_from([0, 10]))
    def enqueue(self, level: int) -> None:
        job = f"j{self.n}"
        self.n += 1
        self.state[job] = JobState.QUEUED
        self.key[job] = POLICY.key(level, self.now)
        self.arrived[job] = self.now

    @rule(dt=st.floats(0.05, 3.0))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule()
    def claim(self) -> None:
        for w in WORKERS:
            waiting = self._waiting()
            if self.runner[w] is None and waiting:
                best = max(waiting, key=lambda j: (self.key[j], -self.arrived[j]))
                self._move(best, JobState.RUNNING)
                self.checkpoints.pop(best, None)
                self.runner[w] = (best, self.now)
                self.first_ran.setdefault(best, self.now)

    @rule()
    def preempt(self) -> None:
        waiting = self._waiting()
        if not waiting:
            return
        best = max(waiting, key=lambda j: self.key[j])
        runners = [Runner(w, r[0], self.key[r[0]], r[1]) for w, r in self.runner.items() if r]
        idle = sum(1 for r in self.runner.values() if r is None)
        victim = choose_victim(PREEMPT, self.key[best], runners, idle, self.now)
        ripe_beaten = [r for r in runners if PREEMPT.should_preempt(self.key[best], r, self.now)]
        # A winner preempts once some runner is past its minimum run time.
        assert (victim is not None) == (bool(ripe_beaten) and idle == 0)
        if victim is None:
            return
        assert self.now - victim.since >= PREEMPT.min_run_seconds
        assert victim.key == min(r.key for r in ripe_beaten)
        self._move(victim.job_id, JobState.PARKING)
        self._move(victim.job_id, JobState.PARKED)
        self.checkpoints[victim.job_id] = self.checkpoints.get(victim.job_id, 0) + 1
        self.runner[victim.worker] = None

    @precondition(lambda self: any(self.runner.values()))
    @rule(i=st.integers(0, 1))
    def finish(self, i: int) -> None:
        r = self.runner[WORKERS[i]]
        if r is not None:
            self._move(r[0], JobState.FINISHED)
            self.runner[WORKERS[i]] = None

    @invariant()
    def one_runner_per_worker_and_one_state_per_job(self) -> None:
        running = [r[0] for r in self.runner.values() if r]
        assert len(running) == len(set(running))
        assert {j for j, s in self.state.items() if s is JobState.RUNNING} == set(running)

    @invariant()
    def at_most_one_checkpoint_per_parked_job(self) -> None:
        for job, count in self.checkpoints.items():
            assert count == 1 and self.state[job] is JobState.PARKED

    @invariant()
    def no_new_arrival_overtakes_an_old_enough_job(self) -> None:
        bound = starvation_bound(10, POLICY.level_seconds, POLICY.aging_rate, PREEMPT.margin)
        for job in self._waiting():
            for other, t in self.arrived.items():
                if t - self.arrived[job] > bound and self.state[other] not in TERMINAL:
                    assert not PREEMPT.beats(self.key[other], self.key[job])


TestSchedule = Schedule.TestCase
TestSchedule.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
