//! Property tests of the coordinator's state machine: random sequences of requests from several
//! worker identities, checked step by step against a model of the committed data and against
//! the state's invariants.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use edl_shared::proto::Consistency;
use edl_shared::proto::place::{PlacementKind, PlacementState, StragglerPolicy};

/// The certificate names requests come from.
const IDENTITIES: [&str; 4] = ["w0", "w1", "w2", "w3"];
/// Shards joined before the workers arrive.
const SHARDS: u32 = 2;
/// Samples per epoch: not a multiple of the partition size, so the last partition is short.
const SAMPLES: u32 = 10;
const PARTITION: u32 = 4;
const EPOCHS: u32 = 2;
const LEASE_MS: u64 = 1000;

fn job(consistency: Consistency) -> JobConfig {
    JobConfig {
        epochs: EPOCHS,
        partition_size: PARTITION,
        train_samples: SAMPLES,
        lease_ms: LEASE_MS as u32,
        ..super::tests::job(consistency)
    }
}

/// Which worker id a request names.
#[derive(Clone, Debug)]
enum Who {
    /// The n-th active worker (modulo their number).
    Active(usize),
    /// The n-th worker registered so far (modulo their number), active or departed.
    Nth(usize),
    /// Any id, registered or not.
    Raw(u64),
}

/// Which certificate a request comes from.
#[derive(Clone, Debug)]
enum Caller {
    /// The identity the worker registered with.
    Owner,
    /// One of [`IDENTITIES`], which may or may not be the owner.
    Any(usize),
}

/// The clock a report names, relative to the worker's current clock.
#[derive(Clone, Debug)]
enum Step {
    Next,
    /// A repeated report of the current step.
    Same,
    Back(u64),
    Ahead(u64),
}

/// The data span a report carries.
#[derive(Clone, Debug)]
enum SpanPick {
    None,
    /// Continues one of the worker's leases (picked by index) from its committed position.
    Continue {
        lease: usize,
        len: u32,
    },
    /// Continues the lease, but starts `shift` positions off the committed one.
    Shifted {
        lease: usize,
        len: u32,
        shift: i32,
    },
    /// Continues a lease held by another worker.
    Foreign {
        lease: usize,
        len: u32,
    },
    /// Any span at all, leased or not, well formed or not.
    Raw(DataSpan),
}

#[derive(Clone, Debug)]
enum Loss {
    Finite(f64),
    Nan,
    Infinite,
}

#[derive(Clone, Debug)]
enum Op {
    Register {
        ident: usize,
    },
    Heartbeat {
        who: Who,
        caller: Caller,
    },
    Leave {
        who: Who,
        caller: Caller,
    },
    /// As the service layer serves `NextPartition`: `set_idle`, then `next_partition`;
    /// without `idle`, `next_partition` alone (a repeated long poll).
    NextPartition {
        who: Who,
        caller: Caller,
        idle: bool,
    },
    Advance {
        who: Who,
        caller: Caller,
        step: Step,
        span: SpanPick,
        /// The reported sample count; `None` for the span's length (2 without a span).
        samples: Option<u32>,
        /// The reported epoch; `None` for the span's (0 without a span).
        epoch: Option<u32>,
        loss: Loss,
    },
    Drain {
        who: Who,
    },
    /// Straggler settings: a short window, so that random step times flag workers.
    Policy {
        policy: StragglerPolicy,
    },
    Preempt {
        who: Who,
        notice_ms: u64,
    },
    Migrate {
        who: Who,
    },
    Scale {
        workers: u32,
    },
    /// A worker registers for the `nth` placement (pending or not).
    RegisterPlaced {
        ident: usize,
        nth: usize,
    },
    MayProceed {
        who: Who,
    },
    Tick {
        ms: u64,
    },
    Expire,
    /// The coordinator restarts from its saved state.
    Restart,
    Trace {
        from: u64,
    },
}

fn who() -> impl Strategy<Value = Who> {
    prop_oneof![
        12 => (0usize..8).prop_map(Who::Active),
        2 => (0usize..8).prop_map(Who::Nth),
        1 => prop_oneof![0u64..12, Just(u64::MAX)].prop_map(Who::Raw),
    ]
}

fn caller() -> impl Strategy<Value = Caller> {
    prop_oneof![
        8 => Just(Caller::Owner),
        1 => (0..IDENTITIES.len()).prop_map(Caller::Any),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    // Jumps stay far below `u64::MAX`; clocks near it (where the clock checks once
    // overflowed) are the regression tests at the end of this file.
    prop_oneof![
        14 => Just(Step::Next),
        2 => Just(Step::Same),
        1 => (1u64..4).prop_map(Step::Back),
        2 => (2u64..1000).prop_map(Step::Ahead),
    ]
}

fn span_pick() -> impl Strategy<Value = SpanPick> {
    let raw = (0u32..3, 0u32..4, 0u32..12, 0u32..12).prop_map(|(epoch, partition, start, end)| {
        SpanPick::Raw(DataSpan {
            epoch,
            partition,
            start,
            end,
        })
    });
    prop_oneof![
        2 => Just(SpanPick::None),
        14 => (0usize..3, 1u32..4).prop_map(|(lease, len)| SpanPick::Continue { lease, len }),
        1 => (0usize..3, 1u32..4, -2i32..3)
            .prop_map(|(lease, len, shift)| SpanPick::Shifted { lease, len, shift }),
        1 => (0usize..3, 1u32..4).prop_map(|(lease, len)| SpanPick::Foreign { lease, len }),
        1 => raw,
    ]
}

fn loss() -> impl Strategy<Value = Loss> {
    prop_oneof![
        10 => (0.0f64..10.0).prop_map(Loss::Finite),
        1 => Just(Loss::Nan),
        1 => Just(Loss::Infinite),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let advance = (
        who(),
        caller(),
        step(),
        span_pick(),
        prop_oneof![4 => Just(None), 1 => (0u32..5).prop_map(Some)],
        prop_oneof![6 => Just(None), 1 => (0u32..4).prop_map(Some)],
        loss(),
    )
        .prop_map(
            |(who, caller, step, span, samples, epoch, loss)| Op::Advance {
                who,
                caller,
                step,
                span,
                samples,
                epoch,
                loss,
            },
        );
    prop_oneof![
        2 => (0..IDENTITIES.len()).prop_map(|ident| Op::Register { ident }),
        4 => (who(), caller()).prop_map(|(who, caller)| Op::Heartbeat { who, caller }),
        1 => (who(), caller()).prop_map(|(who, caller)| Op::Leave { who, caller }),
        8 => (who(), caller(), prop::bool::weighted(0.8))
            .prop_map(|(who, caller, idle)| Op::NextPartition { who, caller, idle }),
        20 => advance,
        1 => who().prop_map(|who| Op::Drain { who }),
        1 => prop::sample::select(StragglerPolicy::ALL.to_vec())
            .prop_map(|policy| Op::Policy { policy }),
        1 => (who(), 0u64..3000).prop_map(|(who, notice_ms)| Op::Preempt { who, notice_ms }),
        1 => who().prop_map(|who| Op::Migrate { who }),
        1 => (0u32..5).prop_map(|workers| Op::Scale { workers }),
        1 => (0..IDENTITIES.len(), 0usize..6)
            .prop_map(|(ident, nth)| Op::RegisterPlaced { ident, nth }),
        2 => who().prop_map(|who| Op::MayProceed { who }),
        3 => prop_oneof![4 => 0u64..300, 1 => 300u64..1500].prop_map(|ms| Op::Tick { ms }),
        2 => Just(Op::Expire),
        1 => Just(Op::Restart),
        1 => (0u64..40).prop_map(|from| Op::Trace { from }),
    ]
}

fn consistency() -> impl Strategy<Value = Consistency> {
    prop_oneof![
        Just(Consistency::Asp),
        Just(Consistency::Bsp),
        (1u32..3).prop_map(|staleness| Consistency::Ssp { staleness }),
    ]
}

/// The state under test with what the test knows independently of it.
struct Harness {
    st: CoordinatorState,
    job: JobConfig,
    now: Instant,
    /// The identity of every worker ever registered.
    owners: BTreeMap<WorkerId, String>,
    ids: Vec<WorkerId>,
    /// Positions `(epoch, position)` committed by accepted reports (or counted as lost commits
    /// by a restored worker's report): none may be committed twice.
    committed: BTreeSet<(u32, u32)>,
    /// Samples reported without a span, per epoch: they count without committing data.
    spanless: Vec<u64>,
    /// Steps recorded since the last restart, in order.
    steps: Vec<(WorkerId, Clock)>,
    /// Workers restored by the last restart and not heard from since.
    restored: BTreeSet<WorkerId>,
    /// The last status's `samples_done`, which must never decrease.
    done: u64,
    /// Each active worker's clock after the previous operation.
    clocks: BTreeMap<WorkerId, Clock>,
}

fn ready<T: std::fmt::Debug>(p: Poll<T>) -> T {
    match p {
        Poll::Ready(v) => v,
        other => panic!("expected Ready, got {other:?}"),
    }
}

impl Harness {
    fn new(consistency: Consistency) -> Self {
        let job = job(consistency);
        let now = Instant::now();
        let mut st = CoordinatorState::new(job.clone(), SHARDS, now);
        for s in 0..SHARDS {
            st.shard_join(&format!("s{s}"), &format!("127.0.0.1:{}", 7000 + s))
                .expect("shard join");
        }
        assert!(st.map().is_some(), "the map forms once every shard joined");
        Harness {
            st,
            job,
            now,
            owners: BTreeMap::new(),
            ids: Vec::new(),
            committed: BTreeSet::new(),
            spanless: vec![0; EPOCHS as usize],
            steps: Vec::new(),
            restored: BTreeSet::new(),
            done: 0,
            clocks: BTreeMap::new(),
        }
    }

    fn id(&self, who: &Who) -> WorkerId {
        let active: Vec<WorkerId> = self.clocks.keys().copied().collect();
        match who {
            Who::Active(n) if !active.is_empty() => active[n % active.len()],
            Who::Active(n) | Who::Nth(n) if !self.ids.is_empty() => self.ids[n % self.ids.len()],
            Who::Active(_) => WorkerId(1),
            Who::Nth(_) => WorkerId(1),
            Who::Raw(id) => WorkerId(*id),
        }
    }

    fn identity(&self, id: WorkerId, caller: &Caller) -> String {
        match caller {
            Caller::Owner => self
                .owners
                .get(&id)
                .cloned()
                .unwrap_or_else(|| IDENTITIES[0].to_string()),
            Caller::Any(i) => IDENTITIES[*i].to_string(),
        }
    }

    /// The service layer's identity check; true if the request may go on.
    fn owner_check(&self, id: WorkerId, identity: &str) -> bool {
        let got = self.st.check_owner(id, identity);
        match self.owners.get(&id) {
            Some(owner) if owner != identity => {
                let (code, _) = got.expect_err("a request for another identity's worker");
                assert_eq!(code, ErrorCode::IdentityMismatch);
                false
            }
            _ => {
                got.expect("the owner, or an unknown worker, passes the identity check");
                true
            }
        }
    }

    fn worker_snap(snap: &CoordinatorSnap, id: WorkerId) -> Option<&WorkerSnap> {
        snap.workers.iter().find(|w| w.id == id)
    }

    /// Asserts that a refused request left the state as it was.
    fn unchanged(&self, before: &CoordinatorSnap, what: &str) {
        assert_eq!(
            &self.st.snapshot(),
            before,
            "refused {what} changed the state"
        );
        assert_eq!(
            self.st.trace(0).steps.len(),
            self.steps.len(),
            "refused {what} recorded a step"
        );
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Register { ident } => {
                let floor = self.st.min_clock();
                let name = IDENTITIES[*ident];
                let (id, _, map, clock) =
                    ready(self.st.register(name, "10.0.0.1:1", self.now, self.now));
                assert_eq!(clock, floor, "a joiner enters at the minimum clock");
                assert_eq!(Some(map), self.st.map());
                assert!(self.owners.insert(id, name.to_string()).is_none());
                self.ids.push(id);
            }
            Op::Heartbeat { who, caller } => {
                let id = self.id(who);
                if !self.owner_check(id, &self.identity(id, caller)) {
                    return;
                }
                let before = self.st.snapshot();
                let active = Self::active(&before, id);
                match self.st.heartbeat(id, self.now) {
                    Ok(()) => assert!(active),
                    Err((code, _)) => {
                        assert!(!active);
                        assert_eq!(code, ErrorCode::UnknownWorker);
                    }
                }
                // A heartbeat renews a timer that is not part of the saved state.
                self.unchanged(&before, "heartbeat");
            }
            Op::Leave { who, caller } => {
                let id = self.id(who);
                if !self.owner_check(id, &self.identity(id, caller)) {
                    return;
                }
                let before = self.st.snapshot();
                match self.st.leave(id, self.now) {
                    Ok(()) => {
                        assert!(Self::active(&before, id));
                        let after = self.st.snapshot();
                        let w = Self::worker_snap(&after, id).expect("a departed worker is kept");
                        assert_eq!(w.state, WorkerState::Left);
                        assert!(w.leased.is_empty(), "a departed worker holds no data");
                    }
                    Err((code, _)) => {
                        assert!(!Self::active(&before, id));
                        assert_eq!(code, ErrorCode::UnknownWorker);
                        self.unchanged(&before, "leave");
                    }
                }
            }
            Op::NextPartition { who, caller, idle } => {
                let id = self.id(who);
                if !self.owner_check(id, &self.identity(id, caller)) {
                    return;
                }
                let before = self.st.snapshot();
                if *idle && let Err((code, _)) = self.st.set_idle(id) {
                    assert_eq!(code, ErrorCode::UnknownWorker);
                    self.unchanged(&before, "set_idle");
                    return;
                }
                let min = self.st.min_clock();
                match self.st.next_partition(id, self.now) {
                    Poll::Ready((Some(p), clock)) => {
                        assert!(p.len > 0, "an empty partition leased: {p:?}");
                        let after = self.st.snapshot();
                        let w = Self::worker_snap(&after, id).expect("leased to a known worker");
                        // A new lease from its start, or the one the worker held already
                        // (asking again is idempotent) from where it is committed.
                        let held = |part: &Partition, committed: u32| {
                            part.epoch == p.epoch
                                && part.index == p.index
                                && committed == p.start
                                && part.start + part.len == p.start + p.len
                        };
                        assert!(
                            w.leased.iter().any(|(part, c)| held(part, *c)),
                            "{p:?} not in {w:?}"
                        );
                        let was = Self::worker_snap(&before, id).expect("known worker");
                        if let Some((part, c)) = was.leased.first() {
                            assert!(held(part, *c), "{p:?} is not the lease {w:?} held");
                            assert_eq!(w.leased.len(), was.leased.len(), "a second lease");
                        }
                        assert_eq!(w.clock, clock);
                        if *idle {
                            assert!(clock >= min, "re-entered below the minimum clock");
                        }
                    }
                    Poll::Ready((None, _)) => {
                        let w = Self::worker_snap(&before, id).expect("known worker");
                        assert!(w.draining || self.st.finished());
                    }
                    Poll::Pending => assert!(!self.st.finished()),
                    Poll::Failed(code, _) => {
                        assert_eq!(code, ErrorCode::UnknownWorker);
                        assert!(!Self::active(&before, id));
                        self.unchanged(&before, "next_partition");
                    }
                }
            }
            Op::Advance {
                who,
                caller,
                step,
                span,
                samples,
                epoch,
                loss,
            } => self.advance(who, caller, step, span, *samples, *epoch, loss),
            Op::Drain { who } => {
                let id = self.id(who);
                let before = self.st.snapshot();
                match self.st.drain(id, self.now) {
                    Ok(()) => {
                        let after = self.st.snapshot();
                        assert!(Self::worker_snap(&after, id).is_some_and(|w| w.draining));
                    }
                    Err((code, _)) => {
                        assert_eq!(code, ErrorCode::UnknownWorker);
                        assert!(!Self::active(&before, id));
                        self.unchanged(&before, "drain");
                    }
                }
            }
            Op::MayProceed { who } => {
                let id = self.id(who);
                let before = self.st.snapshot();
                let poll = self.st.may_proceed(id);
                let w = Self::worker_snap(&before, id).filter(|w| w.state == WorkerState::Active);
                match (poll, w) {
                    (Poll::Failed(code, _), None) => assert_eq!(code, ErrorCode::UnknownWorker),
                    (Poll::Ready((min, drain)), Some(w)) => {
                        assert_eq!(drain, w.draining);
                        if let (Some(s), false) = (self.job.consistency.staleness(), drain) {
                            assert!(
                                min.0 + s >= w.clock.0,
                                "granted {} at clock {} over minimum {}",
                                w.id,
                                w.clock,
                                min
                            );
                        }
                    }
                    (Poll::Pending, Some(w)) => {
                        let s = self.job.consistency.staleness().expect("ASP never waits");
                        assert!(self.st.min_clock().0 + s < w.clock.0);
                    }
                    (poll, w) => panic!("may_proceed answered {poll:?} for {w:?}"),
                }
                assert_eq!(self.st.snapshot(), before);
            }
            Op::Policy { policy } => {
                let s = StragglerSettings {
                    policy: *policy,
                    window_ms: 100,
                    warmup_ms: 0,
                    ..StragglerSettings::default()
                };
                self.st.set_stragglers(s).expect("valid settings");
            }
            Op::Preempt { who, notice_ms } => {
                let id = self.id(who);
                let before = self.st.snapshot();
                match self
                    .st
                    .preempt(id, Duration::from_millis(*notice_ms), self.now)
                {
                    Ok(placement) => {
                        assert!(Self::active(&before, id));
                        let (drain, left) = self.st.beat(id, self.now).expect("active");
                        assert!(left.is_some_and(|l| l <= *notice_ms));
                        match placement {
                            Some(p) => {
                                assert!(p.is_pending());
                                assert!(
                                    matches!(p.kind, PlacementKind::Replace { old, .. } if old == id)
                                );
                            }
                            None => assert!(drain),
                        }
                    }
                    Err((code, _)) => {
                        assert_eq!(code, ErrorCode::UnknownWorker);
                        assert!(!Self::active(&before, id));
                        self.unchanged(&before, "preempt");
                    }
                }
            }
            Op::Migrate { who } => {
                let id = self.id(who);
                let before = self.st.snapshot();
                match self.st.migrate(id, None, self.now) {
                    Ok(p) => {
                        assert!(p.is_pending());
                        assert!(matches!(p.kind, PlacementKind::Replace { old, .. } if old == id));
                        assert!(Self::worker_snap(&before, id).is_some_and(|w| !w.draining));
                    }
                    Err((code, _)) => {
                        assert!(
                            [ErrorCode::UnknownWorker, ErrorCode::Conflict].contains(&code),
                            "{code:?}"
                        );
                        self.unchanged(&before, "migrate");
                    }
                }
            }
            Op::Scale { workers } => {
                let before = self.st.snapshot();
                match self.st.scale(*workers, self.now) {
                    Ok(_) => {
                        let after = self.st.snapshot();
                        let staying = after
                            .workers
                            .iter()
                            .filter(|w| w.state == WorkerState::Active && !w.draining)
                            .count();
                        let coming = self
                            .st
                            .placements()
                            .iter()
                            .filter(|p| p.is_pending() && p.kind == PlacementKind::Add)
                            .count();
                        assert_eq!(staying + coming, *workers as usize);
                    }
                    Err((code, _)) => {
                        assert_eq!((code, *workers), (ErrorCode::InvalidRequest, 0));
                        self.unchanged(&before, "scale");
                    }
                }
            }
            Op::RegisterPlaced { ident, nth } => {
                let placements = self.st.placements();
                let Some(p) = placements.get(nth % placements.len().max(1)).cloned() else {
                    return;
                };
                let before = self.st.snapshot();
                self.apply(&Op::Register { ident: *ident });
                let id = *self.ids.last().expect("registered");
                self.st.placed(id, p.id, self.now);
                let now = self.st.placements();
                let after = now.iter().find(|q| q.id == p.id).expect("kept");
                if p.is_pending() {
                    assert_eq!(after.state, PlacementState::Done { worker: id });
                    if let PlacementKind::Replace { old, .. } = p.kind
                        && Self::active(&before, old)
                    {
                        let snap = self.st.snapshot();
                        assert!(
                            Self::worker_snap(&snap, old).is_some_and(|w| w.draining),
                            "the replaced worker is drained"
                        );
                    }
                } else {
                    assert_eq!(after.state, p.state, "a finished placement does not change");
                }
            }
            Op::Tick { ms } => self.now += Duration::from_millis(*ms),
            Op::Expire => {
                let before = self.st.snapshot();
                for id in self.st.expire_leases(self.now) {
                    assert!(Self::active(&before, id), "{id} expired twice");
                }
            }
            Op::Restart => {
                let snap = self.st.snapshot();
                self.st =
                    CoordinatorState::restore(snap, &self.job, SHARDS, self.now).expect("restore");
                self.restored = self
                    .st
                    .snapshot()
                    .workers
                    .iter()
                    .filter(|w| w.state == WorkerState::Active)
                    .map(|w| w.id)
                    .collect();
                // The step trace is not saved: it starts over.
                self.steps.clear();
            }
            Op::Trace { from } => {
                let t = self.st.trace(*from);
                let from = usize::try_from(*from).expect("small");
                assert_eq!(t.first_step, from as u64);
                let want: Vec<(WorkerId, Clock)> = self.steps.iter().skip(from).copied().collect();
                let got: Vec<(WorkerId, Clock)> =
                    t.steps.iter().map(|s| (s.worker, s.clock)).collect();
                assert_eq!(got, want);
                assert_eq!(t.next_step, t.first_step + t.steps.len() as u64);
                assert_eq!(t.more, t.next_step < self.steps.len() as u64);
            }
        }
    }

    fn active(snap: &CoordinatorSnap, id: WorkerId) -> bool {
        Self::worker_snap(snap, id).is_some_and(|w| w.state == WorkerState::Active)
    }

    #[allow(clippy::too_many_arguments)]
    fn advance(
        &mut self,
        who: &Who,
        caller: &Caller,
        step: &Step,
        pick: &SpanPick,
        samples: Option<u32>,
        epoch: Option<u32>,
        loss: &Loss,
    ) {
        let id = self.id(who);
        if !self.owner_check(id, &self.identity(id, caller)) {
            return;
        }
        let before = self.st.snapshot();
        let w = Self::worker_snap(&before, id);
        let current = w.map_or(Clock(0), |w| w.clock);
        let clock = match step {
            Step::Next => Clock(current.0 + 1),
            Step::Same => current,
            Step::Back(k) => Clock(current.0.saturating_sub(*k)),
            Step::Ahead(k) => Clock(current.0 + k),
        };
        let leases: Vec<(Partition, u32)> = w.map(|w| w.leased.clone()).unwrap_or_default();
        let continuing = |leases: &[(Partition, u32)], i: usize, len: u32, shift: i32| {
            if leases.is_empty() {
                return None;
            }
            let (p, committed) = leases[i % leases.len()];
            let start = committed.saturating_add_signed(shift);
            Some(DataSpan {
                epoch: p.epoch,
                partition: p.index,
                start,
                end: (start + len).min(p.start + p.len),
            })
        };
        let span = match pick {
            SpanPick::None => None,
            SpanPick::Continue { lease, len } => continuing(&leases, *lease, *len, 0),
            SpanPick::Shifted { lease, len, shift } => continuing(&leases, *lease, *len, *shift),
            SpanPick::Foreign { lease, len } => {
                let others: Vec<(Partition, u32)> = before
                    .workers
                    .iter()
                    .filter(|o| o.id != id)
                    .flat_map(|o| o.leased.iter().copied())
                    .collect();
                continuing(&others, *lease, *len, 0)
            }
            SpanPick::Raw(span) => Some(*span),
        };
        let samples = samples.unwrap_or_else(|| span.map_or(2, |s| s.len()));
        let epoch = epoch.unwrap_or_else(|| span.map_or(0, |s| s.epoch));
        let loss_sum = match loss {
            Loss::Finite(x) => *x,
            Loss::Nan => f64::NAN,
            Loss::Infinite => f64::INFINITY,
        };
        // A report a correct worker would send must be accepted.
        let correct = w.is_some_and(|w| w.state == WorkerState::Active)
            && matches!(step, Step::Next)
            && matches!(loss, Loss::Finite(_))
            && epoch < EPOCHS
            && samples == span.map_or(samples, |s| s.len())
            && epoch == span.map_or(epoch, |s| s.epoch)
            && matches!(pick, SpanPick::None | SpanPick::Continue { .. })
            && (span.is_some() || matches!(pick, SpanPick::None));
        let restored = self.restored.contains(&id);
        let got = self
            .st
            .advance(id, clock, epoch, samples, loss_sum, span, (0, 0), self.now);
        let Ok(()) = got else {
            assert!(!correct, "a correct report refused: {got:?}");
            self.unchanged(&before, "advance");
            return;
        };
        let w = w.expect("accepted for a known worker");
        assert_eq!(w.state, WorkerState::Active);
        assert!(loss_sum.is_finite() && epoch < EPOCHS);
        if clock == w.clock {
            // A repeated report is acknowledged and counted once.
            self.unchanged(&before, "repeated advance");
            return;
        }
        assert!(
            clock.0 == w.clock.0 + 1 || (restored && clock.0 > w.clock.0),
            "{id} moved from {} to {clock} (restored: {restored})",
            w.clock
        );
        self.restored.remove(&id);
        match span {
            None => self.spanless[epoch as usize] += u64::from(samples),
            Some(span) => {
                let (p, committed) = *w
                    .leased
                    .iter()
                    .find(|(p, _)| p.epoch == span.epoch && p.index == span.partition)
                    .expect("a committed span continues one of the worker's leases");
                assert_eq!(span.epoch, epoch);
                assert_eq!(span.len(), samples);
                assert!(span.start == committed || (restored && span.start > committed));
                assert!(span.end <= p.start + p.len && span.start < span.end);
                for pos in committed..span.end {
                    assert!(
                        self.committed.insert((span.epoch, pos)),
                        "position {pos} of epoch {} committed twice",
                        span.epoch
                    );
                }
            }
        }
        self.steps.push((id, clock));
    }

    /// The invariants that hold between any two requests.
    fn check(&mut self) {
        let snap = self.st.snapshot();
        let status = self.st.status(self.now);

        // Progress counts each committed sample once and never goes back.
        let spanless: u64 = self.spanless.iter().sum();
        assert_eq!(
            status.samples_done,
            self.committed.len() as u64 + spanless,
            "samples done against the committed positions"
        );
        assert!(status.samples_done >= self.done, "samples done decreased");
        self.done = status.samples_done;
        assert!(self.committed.len() as u64 <= status.samples_total);
        if spanless == 0 {
            assert!(status.samples_done <= status.samples_total);
        }
        for (e, stats) in status.epochs.iter().enumerate() {
            let committed = self
                .committed
                .range((e as u32, 0)..(e as u32 + 1, 0))
                .count();
            assert_eq!(stats.samples, committed as u64 + self.spanless[e]);
        }

        // Every position of every epoch is in exactly one place: committed, leased and not yet
        // committed, returned to the pool, or not handed out yet.
        let per_epoch = SAMPLES.div_ceil(PARTITION);
        for e in 0..EPOCHS {
            let mut places = vec![Vec::<&str>::new(); SAMPLES as usize];
            for pos in 0..SAMPLES {
                if self.committed.contains(&(e, pos)) {
                    places[pos as usize].push("committed");
                }
                let index = pos / PARTITION;
                if (e, index) >= snap.cursor {
                    places[pos as usize].push("fresh");
                }
            }
            for w in &snap.workers {
                if w.state != WorkerState::Active {
                    assert!(w.leased.is_empty(), "{} departed with leases", w.id);
                }
                for (p, committed) in w.leased.iter().filter(|(p, _)| p.epoch == e) {
                    assert!(p.start <= *committed && *committed < p.start + p.len);
                    assert_eq!(p.index, p.start / PARTITION);
                    for pos in *committed..p.start + p.len {
                        places[pos as usize].push("leased");
                    }
                }
            }
            for p in snap.returned.iter().filter(|p| p.epoch == e) {
                assert!(p.len > 0, "an empty partition returned: {p:?}");
                for pos in p.start..p.start + p.len {
                    places[pos as usize].push("returned");
                }
            }
            for (pos, at) in places.iter().enumerate() {
                assert_eq!(at.len(), 1, "epoch {e} position {pos} is {at:?}");
            }
            // A partition is complete once each of its positions is committed.
            let complete = (0..per_epoch)
                .filter(|i| {
                    (i * PARTITION..((i + 1) * PARTITION).min(SAMPLES))
                        .all(|pos| self.committed.contains(&(e, pos)))
                })
                .count();
            assert_eq!(snap.completed[e as usize], complete as u32, "epoch {e}");
        }
        assert_eq!(
            self.st.finished(),
            self.committed.len() as u64 == status.samples_total
        );

        // Clocks of workers that stay active never go back.
        let clocks: BTreeMap<WorkerId, Clock> = snap
            .workers
            .iter()
            .filter(|w| w.state == WorkerState::Active)
            .map(|w| (w.id, w.clock))
            .collect();
        for (id, clock) in &clocks {
            if let Some(old) = self.clocks.get(id) {
                assert!(clock >= old, "{id} went back from {old} to {clock}");
            }
        }
        self.clocks = clocks;

        // The trace holds every step since the last restart, in order, on one page.
        let t = self.st.trace(0);
        let steps: Vec<(WorkerId, Clock)> = t.steps.iter().map(|s| (s.worker, s.clock)).collect();
        assert_eq!(steps, self.steps);
        assert_eq!((t.first_step, t.next_step), (0, steps.len() as u64));
        assert!(!t.more);
        assert!(t.steps.windows(2).all(|w| w[0].t_ms <= w[1].t_ms));

        // The saved state comes back as it was.
        let restored = CoordinatorState::restore(snap.clone(), &self.job, SHARDS, self.now)
            .expect("restore a snapshot");
        assert_eq!(restored.snapshot(), snap);
        assert_eq!(restored.status(self.now).samples_done, status.samples_done);
    }
}

fn run(consistency: Consistency, ops: &[Op]) {
    let mut h = Harness::new(consistency);
    h.check();
    // Two workers from the start, so that most sequences get to train.
    let start = [Op::Register { ident: 0 }, Op::Register { ident: 1 }];
    for op in start.iter().chain(ops) {
        h.apply(op);
        h.check();
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1024,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_requests_keep_the_coordinator_invariants(
        consistency in consistency(),
        ops in prop::collection::vec(op(), 1..150),
    ) {
        run(consistency, &ops);
    }
}

/// A registered worker restored after a restart and reporting the largest clock, as a
/// restored worker may (its reports may have been lost with the coordinator's state).
fn restored_at_the_largest_clock(consistency: Consistency) -> (Harness, WorkerId) {
    let mut h = Harness::new(consistency);
    h.apply(&Op::Register { ident: 0 });
    h.apply(&Op::Restart);
    let id = h.ids[0];
    h.st.advance(id, Clock(u64::MAX), 0, 2, 1.0, None, (0, 0), h.now)
        .expect("a restored worker may report past its saved clock");
    // The model counts the report's samples, as `apply` does for a report without a span.
    h.spanless[0] += 2;
    h.steps.push((id, Clock(u64::MAX)));
    (h, id)
}

/// The next report's `clock + 1` overflows: a panic in a debug build; in a release build it
/// wraps to 0, and a report of clock 0 is taken as the next step, moving the clock back.
#[test]
fn a_report_after_the_largest_clock_is_refused() {
    let (mut h, id) = restored_at_the_largest_clock(Consistency::Asp);
    let next = h.st.advance(id, Clock(0), 0, 2, 1.0, None, (0, 0), h.now);
    assert!(next.is_err(), "{next:?}");
    h.check();
}

/// Under SSP the grant compares the minimum clock plus the staleness, which overflows.
#[test]
fn a_worker_at_the_largest_clock_is_granted_without_panic() {
    let (h, id) = restored_at_the_largest_clock(Consistency::Ssp { staleness: 1 });
    assert!(matches!(h.st.may_proceed(id), Poll::Ready(_)));
}
