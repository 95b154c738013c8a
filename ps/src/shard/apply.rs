//! Pulls and pushes: a chunk's parameters and optimizer state, the checks of a push's
//! payload, the data ledger's exactly-once claim, and the optimizer's step over the chunks a
//! push covers (in parallel past a size), BSP's staging and its apply when a step is due.

use super::*;

/// Pushes of at least this many bytes are applied on two cores (ASP and SSP) where one is
/// spare (see [`SPLIT_BESIDE`]). At 16 MiB this took the update from about 2 ms to 1.2 ms of
/// a push+pull pair on an Intel Xeon (`edl-bench transport`, edl against edl-noopt); on an AMD
/// EPYC (Zen 3) VM it made no difference beyond the noise at 4 and 16 MiB. The threshold
/// itself was not measured, only chosen so that starting a thread is small beside the update
/// it shares.
pub(super) const PARALLEL_APPLY_BYTES: u64 = 4 << 20;

/// The share of a two-core update (numerator, denominator) that the request's own thread
/// applies: the other thread starts ~130 µs later (a new thread; measured at 16 MiB), so it
/// gets less. At 16 MiB, 55% took the update's p50 from 1.16-1.20 ms (halves) to 1.02-1.14 ms.
pub(super) const HERE_SHARE: (u64, u64) = (11, 20);

/// A large push is applied on two cores only when the shard's server has at most this many
/// bytes in flight beside it (its header, small requests): with other pushes arriving or being
/// applied, the second core is busy with them already, and a thread of the push's own only
/// competes with them. Measured with `edl-bench scale --shards 1 --workers 1,6,8 --consistency
/// asp` (4 MiB pushes; AMD EPYC Zen 3 VM, 2 cores), two runs each, the ceiling worked out from
/// the load column: splitting every large push, a transport ceiling of about 222 steps/s and
/// 76-78% efficiency at 8 workers; splitting only beside nothing else, about 260 steps/s and
/// 79-88%; never splitting, about 270 steps/s and 86-87%.
pub(super) const SPLIT_BESIDE: u64 = 64 << 10;

/// The cores this process may use (read once: finding out reads the cgroup's files).
pub(super) static CORES: std::sync::LazyLock<usize> =
    std::sync::LazyLock::new(|| std::thread::available_parallelism().map_or(1, |n| n.get()));

/// The floats of `chunks`.
pub(super) fn floats_in(chunks: &[ChunkRef]) -> u64 {
    chunks.iter().map(|c| u64::from(c.len)).sum()
}

/// A chunk's parameters as the payload of a pull answer: on little-endian machines, the values
/// as they lie in memory, shared until quinn has sent them (the next update then writes into
/// a copy); elsewhere, a little-endian copy.
pub(super) fn wire_params(params: &Arc<Vec<f32>>) -> Bytes {
    /// Owns a reference to parameters while a pull answer is being sent.
    struct Shared(Arc<Vec<f32>>);
    impl AsRef<[u8]> for Shared {
        fn as_ref(&self) -> &[u8] {
            bytemuck::cast_slice(self.0.as_slice())
        }
    }
    if cfg!(target_endian = "little") {
        Bytes::from_owner(Shared(params.clone()))
    } else {
        f32s_to_bytes(params)
    }
}

/// A chunk of f32 parameters (as [`wire_params`] made it) in a 16-bit `wire`, or `None` if a
/// value does not fit it. The parameters are read where they lie (a copy only on a
/// big-endian machine).
pub(super) fn narrowed(chunk: &Bytes, wire: Wire) -> Option<Bytes> {
    let copy;
    let values = match f32s_in_place(chunk) {
        Some(v) => v,
        None => {
            let mut c = vec![0.0; chunk.len() / 4];
            bytes_to_f32s(chunk, &mut c).ok()?;
            copy = c;
            &copy[..]
        }
    };
    let mut b = BytesMut::with_capacity(values.len() * wire.value_bytes());
    encode_finite(&mut b, values, wire).ok()?;
    Some(b.freeze())
}

/// A draw from the standard normal distribution (Box-Muller).
pub(super) fn standard_normal(rng: &mut StdRng) -> f32 {
    // 1 - u lies in (0, 1], so the logarithm is finite.
    let u: f64 = 1.0 - rng.random::<f64>();
    let v: f64 = rng.random();
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

/// BSP: one step's gradients for a chunk, summed while they wait for the step's barrier.
#[derive(Debug)]
pub(super) struct Staged {
    /// The sum.
    pub(super) sum: Vec<f32>,
    /// Gradients in it (the update applies their mean).
    pub(super) pushes: u32,
    /// The latest epoch of their samples (what an epoch schedule counts).
    pub(super) epoch: u32,
}

/// One chunk of parameters with its optimizer state.
#[derive(Debug)]
pub(super) struct Chunk {
    /// Shared with the pull answers still being sent: an update writes in place, or into a
    /// copy while a pull still holds the values (`Arc::make_mut`).
    pub(super) params: Arc<Vec<f32>>,
    pub(super) opt: OptState,
    /// BSP: summed gradients per step, waiting for the step's barrier.
    pub(super) pending: BTreeMap<u64, Staged>,
    /// BSP: every step before this clock has been applied.
    pub(super) applied_through: u64,
    /// The ledger segment this key belongs to (see [`Ledgers`]).
    pub(super) segment: u32,
    /// Floats read and written since the last rebalance.
    pub(super) load: u64,
    /// The parameter group of its tensor, looked up once ([`JobConfig::group_of`]): the
    /// optimizer that updates it is [`JobConfig::group_optimizer`]'s.
    pub(super) group: Option<usize>,
}

impl Chunk {
    /// A fresh chunk of `key`, initialized from the job seed and the key.
    pub(super) fn fresh(job: &JobConfig, key: Key, tensor: usize, len: usize) -> Chunk {
        let rng = || StdRng::seed_from_u64(job.seed ^ key.0.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let params = match job.tensors.get(tensor).map(|t| &t.init) {
            Some(Init::Uniform { limit }) if *limit > 0.0 => {
                let mut rng = rng();
                (0..len)
                    .map(|_| rng.random_range(-limit..=*limit))
                    .collect()
            }
            Some(Init::Normal { std }) if *std > 0.0 => {
                let mut rng = rng();
                (0..len).map(|_| std * standard_normal(&mut rng)).collect()
            }
            Some(Init::Constant { value }) => vec![*value; len],
            _ => vec![0.0; len],
        };
        Chunk {
            opt: OptState::new(job.optimizer_of(tensor), len),
            group: job.group_of(tensor),
            params: Arc::new(params),
            pending: BTreeMap::new(),
            applied_through: 0,
            segment: 0,
            load: 0,
        }
    }

    /// A chunk from its snapshot, checked against the layout and the optimizer.
    pub(super) fn from_snap(
        job: &JobConfig,
        layout: &KeyLayout,
        snap: ChunkSnap,
    ) -> Result<Chunk, String> {
        let Some(span) = layout.span(Key(snap.key)).copied() else {
            return Err(format!("key {} is not part of the job", snap.key));
        };
        let n = span.len as usize;
        let opt = OptState {
            t: snap.t,
            bufs: snap.state,
        };
        let optimizer = job.optimizer_of(span.tensor);
        if !opt.fits(optimizer, n) {
            return Err(format!(
                "optimizer state of key {} does not fit {optimizer}",
                snap.key
            ));
        }
        if snap.params.len() != n || snap.pending.iter().any(|(_, s, ..)| s.len() != n) {
            return Err(format!("key {} has the wrong length", snap.key));
        }
        if first_non_finite(&snap.params).is_some() {
            return Err(format!("key {} holds non-finite parameters", snap.key));
        }
        Ok(Chunk {
            params: Arc::new(snap.params),
            opt,
            group: job.group_of(span.tensor),
            pending: snap
                .pending
                .into_iter()
                .map(|(c, sum, pushes, epoch)| {
                    let staged = Staged { sum, pushes, epoch };
                    (c, staged)
                })
                .collect(),
            applied_through: snap.applied_through,
            segment: snap.segment,
            load: snap.load,
        })
    }

    pub(super) fn snap(&self, key: Key) -> ChunkSnap {
        ChunkSnap {
            key: key.0,
            params: self.params.to_vec(),
            state: self.opt.bufs.clone(),
            t: self.opt.t,
            pending: self
                .pending
                .iter()
                .map(|(k, s)| (*k, s.sum.clone(), s.pushes, s.epoch))
                .collect(),
            applied_through: self.applied_through,
            segment: self.segment,
            load: self.load,
        }
    }
}

/// Which copies a push goes to: the keys this shard is the primary of, or its backup copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    Primary,
    Backup,
}

/// A push as a shard takes it: the map epoch it was routed with, the worker, its step, its
/// chunks and their gradients (in the parts they arrived in), its span and covered ranges.
pub type PushRef<'a> = (
    MapEpoch,
    WorkerId,
    Clock,
    &'a [ChunkRef],
    &'a [Bytes],
    Option<&'a DataSpan>,
    &'a [KeyRange],
);

/// Removes `keys` from `held` (those it holds) with copies of their segments' ledgers, and
/// forgets the segments no key left in `held` belongs to. The caller holds the gate
/// exclusively.
pub(super) fn take_out(
    held: &DashMap<Key, Chunk>,
    ledgers: &Mutex<Ledgers>,
    keys: impl Iterator<Item = Key>,
) -> RangeExport {
    let mut chunks = Vec::new();
    let mut segments = BTreeSet::new();
    for k in keys {
        if let Some((key, chunk)) = held.remove(&k) {
            segments.insert(chunk.segment);
            chunks.push(chunk.snap(key));
        }
    }
    let mut ledgers = lock(ledgers);
    let export = RangeExport {
        chunks,
        ledgers: ledgers.export(&segments),
    };
    let used: BTreeSet<u32> = held.iter().map(|c| c.segment).collect();
    ledgers.retain(&used);
    export
}

/// Checks that `export` holds exactly keys `[start, end)`, in order.
pub(super) fn exactly(start: u64, end: u64, export: &RangeExport) -> Result<(), Refusal> {
    let in_order = start < end
        && export.chunks.len() as u64 == end - start
        && export
            .chunks
            .iter()
            .zip(start..end)
            .all(|(c, k)| c.key == k);
    if !in_order {
        return Err(Refusal::new(
            ErrorCode::InvalidRequest,
            format!("the export does not hold exactly keys {start}..{end}"),
        ));
    }
    Ok(())
}

/// Applies, in step order, every pending BSP update of a step before `through`.
pub(super) fn apply_due(job: &JobConfig, chunk: &mut Chunk, through: u64) {
    while let Some(entry) = chunk.pending.first_entry() {
        if *entry.key() >= through {
            break;
        }
        let staged = entry.remove();
        let optimizer = scheduled(job, chunk, staged.epoch, staged.pushes);
        opt_apply(chunk, optimizer.as_ref(), &staged);
    }
    chunk.applied_through = chunk.applied_through.max(through);
}

/// Applies the mean of a staged BSP step to `chunk` with `optimizer`.
pub(super) fn opt_apply(chunk: &mut Chunk, optimizer: &OptimizerSpec, staged: &Staged) {
    chunk.opt.apply(
        optimizer,
        Arc::make_mut(&mut chunk.params).as_mut_slice(),
        &staged.sum,
        1.0 / staged.pushes.max(1) as f32,
    );
}

/// The optimizer of `chunk`'s group as it applies the chunk's next update (of samples of
/// `epoch`, averaging `workers` gradients): the job's schedule evaluated at the chunk's
/// applied updates or at the epoch ([`edl_shared::proto::LrSchedule`]).
pub(super) fn scheduled<'a>(
    job: &'a JobConfig,
    chunk: &Chunk,
    epoch: u32,
    workers: u32,
) -> Cow<'a, OptimizerSpec> {
    let spec = job.group_optimizer(chunk.group);
    let schedule = &job.schedule;
    if schedule.is_constant() {
        return Cow::Borrowed(spec);
    }
    let n = match schedule.by {
        ScheduleUnit::Step => chunk.opt.t,
        ScheduleUnit::Epoch => u64::from(epoch),
    };
    Cow::Owned(schedule.apply_to(spec, n, workers))
}

/// How many steps ahead of a key's applied step a BSP push may be. Under BSP a worker is
/// granted step `c` only once every counting worker finished `c - 1`, and its pull or push
/// applies every step before that, so one or two steps are pending at most; a push far
/// ahead is not a real step, and is refused rather than staged.
pub(super) const MAX_STAGED_AHEAD: u64 = 16;

impl ShardState {
    /// Reads the chunks in `ranges`, applying due BSP updates first. The map epoch the client
    /// routed with does not matter as long as this shard holds every key asked for.
    pub fn pull(
        &self,
        epoch: MapEpoch,
        ranges: &[KeyRange],
        apply_through: Clock,
    ) -> Result<Frame<Response, Parts>, Refusal> {
        self.pull_in(epoch, ranges, apply_through, Some(Wire::F32))
    }

    /// [`ShardState::pull`], the values in `wire` (`None`: each chunk in its tensor's, as the
    /// job says): f32 as they lie, a 16-bit precision converted; a chunk at f32 if one of its
    /// parameters does not fit it (binary16 ends at 65,504). Each chunk names its precision.
    pub fn pull_in(
        &self,
        _epoch: MapEpoch,
        ranges: &[KeyRange],
        apply_through: Clock,
        wire: Option<Wire>,
    ) -> Result<Frame<Response, Parts>, Refusal> {
        let mut count = 0u64;
        for r in ranges {
            // Bounds what a request with many or huge ranges can make this shard allocate.
            if r.end < r.start
                || r.end > self.layout.num_keys()
                || count + (r.end - r.start) > self.layout.num_keys()
            {
                return Err(Refusal::new(
                    ErrorCode::UnknownKey,
                    format!("range {}..{} is not part of the job", r.start, r.end),
                ));
            }
            count += r.end - r.start;
        }
        let _gate = read_lock(&self.gate);
        // Refused whole, before any key changes: a pull that names a key this shard does not
        // hold must not apply BSP steps to, or count load on, the keys before it.
        if let Some(key) = ranges
            .iter()
            .flat_map(|r| (r.start..r.end).map(Key))
            .find(|k| !self.chunks.contains_key(k))
        {
            return Err(self.missing(key));
        }
        let mut refs = Vec::with_capacity(count as usize);
        let mut out = Vec::with_capacity(count as usize);
        let mut bytes = 0u64;
        for key in ranges.iter().flat_map(|r| (r.start..r.end).map(Key)) {
            let Some(mut chunk) = self.chunks.get_mut(&key) else {
                return Err(self.missing(key));
            };
            if self.bsp() {
                apply_due(&self.job, &mut chunk, apply_through.0);
            }
            chunk.load += chunk.params.len() as u64;
            let (held, len) = (wire_params(&chunk.params), chunk.params.len() as u32);
            drop(chunk);
            let want = wire.unwrap_or_else(|| {
                let tensor = self.layout.span(key).map_or(0, |s| s.tensor);
                self.job.wire_of(tensor).values
            });
            // At 16 bits if every value fits, else (fp16 past 65,504) at f32.
            let (wire, values) = match want {
                Wire::F32 => (Wire::F32, held),
                _ => match narrowed(&held, want) {
                    Some(narrow) => (want, narrow),
                    None => (Wire::F32, held),
                },
            };
            bytes += values.len() as u64;
            refs.push(ChunkRef::new(key, len).coded(wire, false));
            out.push(values);
        }
        self.load.pulls.fetch_add(1, Ordering::Relaxed);
        (self.load.bytes_out).fetch_add(bytes, Ordering::Relaxed);
        Ok(Frame::with_payload(
            Response::Pulled { chunks: refs },
            Parts(out),
        ))
    }

    /// Applies (ASP, SSP) or stages (BSP) a push. Everything is validated before any state
    /// changes, so a bad push changes nothing. Keys whose ledger segment has applied the
    /// push's data span already are skipped (acknowledged, not applied again). The gradients
    /// must be finite: `read_frame` checks them as they arrive, so that this needs no second
    /// pass over them.
    pub fn push(
        &self,
        epoch: MapEpoch,
        worker: WorkerId,
        clock: Clock,
        chunks: &[ChunkRef],
        payload: &[u8],
        span: Option<&DataSpan>,
    ) -> Result<Claim, Refusal> {
        let parts = [Bytes::copy_from_slice(payload)];
        self.push_covering(epoch, worker, clock, chunks, &parts, span, &[], 0)
    }

    /// [`ShardState::push`] of a payload in the parts it arrived in, read where they lie
    /// (no reassembly), and of a sparse push: the span also counts for the keys in `covers`,
    /// whose gradient is zero (none of it travels). `in_flight`: the bytes in flight on the
    /// shard's server, this push's included (0 where unknown); a large update is applied on two
    /// cores only if nothing else is (see [`SPLIT_BESIDE`]).
    #[allow(clippy::too_many_arguments)]
    pub fn push_covering(
        &self,
        epoch: MapEpoch,
        worker: WorkerId,
        clock: Clock,
        chunks: &[ChunkRef],
        payload: &[Bytes],
        span: Option<&DataSpan>,
        covers: &[KeyRange],
        in_flight: u64,
    ) -> Result<Claim, Refusal> {
        let push = (epoch, worker, clock, chunks, payload, span, covers);
        self.push_in(Side::Primary, push, in_flight, &mut || {})
    }

    /// [`ShardState::push_covering`] of a primary that forwards the push to its backups:
    /// `valid` runs once the push was found valid, before any chunk changes (also when its
    /// span was applied here already: the backups may not have it yet).
    pub fn push_forwarding(
        &self,
        push: PushRef<'_>,
        in_flight: u64,
        valid: &mut dyn FnMut(),
    ) -> Result<Claim, Refusal> {
        self.push_in(Side::Primary, push, in_flight, valid)
    }

    /// Applies a push a primary forwarded to this backup's copies, through their ledgers.
    pub fn replicate(&self, push: PushRef<'_>) -> Result<Claim, Refusal> {
        self.push_in(Side::Backup, push, 0, &mut || {})
    }

    /// The chunks and ledgers of one side.
    pub(super) fn side(&self, side: Side) -> (&DashMap<Key, Chunk>, &Mutex<Ledgers>) {
        match side {
            Side::Primary => (&self.chunks, &self.ledgers),
            Side::Backup => (&self.backup_chunks, &self.backup_ledgers),
        }
    }

    pub(super) fn push_in(
        &self,
        side: Side,
        (_epoch, worker, clock, chunks, payload, span, covers): PushRef<'_>,
        in_flight: u64,
        valid: &mut dyn FnMut(),
    ) -> Result<Claim, Refusal> {
        let (held, ledgers) = self.side(side);
        let bad = |(code, msg): (ErrorCode, String)| {
            Refusal::new(code, format!("push from {worker}: {msg}"))
        };
        let total = floats_in(chunks);
        let bytes: u64 = payload.iter().map(|p| p.len() as u64).sum();
        self.check_payload(chunks, payload).map_err(bad)?;
        // From the check of the keys to the last chunk, neither a checkpoint nor a range move
        // may cut this push in two.
        let _gate = read_lock(&self.gate);
        let missing = |key: Key| {
            let r = self.missing(key);
            Refusal {
                message: format!("push from {worker}: {}", r.message),
                ..r
            }
        };
        let mut segments = BTreeSet::new();
        for c in chunks {
            let chunk = held.get(&c.key).ok_or_else(|| missing(c.key))?;
            if chunk.params.len() != c.len as usize {
                return Err(bad((
                    ErrorCode::ShapeMismatch,
                    format!(
                        "{} has {} floats, push has {}",
                        c.key,
                        chunk.params.len(),
                        c.len
                    ),
                )));
            }
            if self.bsp() && clock.0 < chunk.applied_through {
                return Err(bad((
                    ErrorCode::StaleClock,
                    format!("step {} of {} was already applied", clock.0, c.key),
                )));
            }
            // Staging is bounded by what BSP can need: no worker is granted a step more than
            // one past the slowest, so steps far ahead of the applied one are not real.
            if self.bsp() && clock.0 >= chunk.applied_through.saturating_add(MAX_STAGED_AHEAD) {
                return Err(bad((
                    ErrorCode::InvalidRequest,
                    format!(
                        "step {} is {MAX_STAGED_AHEAD} or more steps ahead of the applied step \
                         {} of {}",
                        clock.0, chunk.applied_through, c.key
                    ),
                )));
            }
            segments.insert(chunk.segment);
        }
        if !covers.is_empty() && span.is_none() {
            return Err(bad((
                ErrorCode::InvalidRequest,
                "a push that covers further keys must carry a data span".into(),
            )));
        }
        // A range past the job's keys stops at the first such key (`UnknownKey`).
        for r in covers {
            for k in r.start..r.end {
                let chunk = held.get(&Key(k)).ok_or_else(|| missing(Key(k)))?;
                segments.insert(chunk.segment);
            }
        }
        // Claim the span last: once it is recorded, the chunks below are updated.
        let claims = match span {
            None => None,
            Some(span) => {
                let claims = lock(ledgers).claim(span, &segments).map_err(bad)?;
                if claims.values().all(|c| *c == Claim::AlreadyApplied) {
                    valid();
                    tracing::debug!(%worker, epoch = span.epoch, partition = span.partition,
                        start = span.start, "span already applied here; skipped");
                    return Ok(Claim::AlreadyApplied);
                }
                Some(claims)
            }
        };
        valid();
        self.load.pushes.fetch_add(1, Ordering::Relaxed);
        self.load.bytes_in.fetch_add(bytes, Ordering::Relaxed);
        let claims = claims.as_ref();
        // The epoch an epoch schedule counts: the samples', or the latest seen (no other
        // update reads it).
        let schedule = &self.job.schedule;
        let epoch = match span {
            _ if schedule.is_constant() || schedule.by != ScheduleUnit::Epoch => 0,
            Some(s) => {
                self.epoch_seen.fetch_max(s.epoch, Ordering::Relaxed);
                s.epoch
            }
            None => self.epoch_seen.load(Ordering::Relaxed),
        };
        // A large ASP/SSP update is applied on two cores where one is spare, each taking a
        // contiguous part of the chunks (no key is in both). BSP staging stays on one: it may
        // refuse mid-way.
        let spare_core = in_flight <= bytes + SPLIT_BESIDE;
        if !self.bsp()
            && spare_core
            && bytes >= PARALLEL_APPLY_BYTES
            && *CORES > 1
            && chunks.len() > 1
        {
            let mut floats = 0u64;
            let mine = chunks
                .iter()
                .take_while(|c| {
                    floats += u64::from(c.len);
                    floats * HERE_SHARE.1 < total * HERE_SHARE.0
                })
                .count()
                .clamp(1, chunks.len() - 1);
            let (first, second) = chunks.split_at(mine);
            let mut rest = Coded::new(payload);
            // Within the payload, which was checked to hold the chunks above.
            for c in first {
                rest.skip(c)
                    .map_err(|e| bad(coded_refusal(e, bytes, chunks)))?;
            }
            let at = (worker, clock, epoch);
            return std::thread::scope(|scope| {
                let other = scope.spawn(|| self.apply_chunks(held, at, second, rest, claims));
                let here = self.apply_chunks(held, at, first, Coded::new(payload), claims);
                let there = other
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p));
                here.and(there)
            });
        }
        self.apply_chunks(
            held,
            (worker, clock, epoch),
            chunks,
            Coded::new(payload),
            claims,
        )
    }

    /// Checks that `payload` holds the values of `chunks` as they say they travel. A plain f32
    /// push was checked for NaN and infinity on receipt (`read_frame`): only its length is
    /// checked here. One with 16-bit or sparse chunks is read whole (`coded::check`), once its
    /// chunks were found to be keys of the job at their lengths (a sparse record is spread
    /// over a chunk of that length) and, where any is sparse, distinct and in ascending
    /// order (a sparse chunk costs 4 bytes: named over and over, it would have the shard
    /// apply the whole model many times for a few bytes each).
    pub(super) fn check_payload(
        &self,
        chunks: &[ChunkRef],
        payload: &[Bytes],
    ) -> Result<(), (ErrorCode, String)> {
        let total = floats_in(chunks);
        let bytes: u64 = payload.iter().map(|p| p.len() as u64).sum();
        if chunks.iter().all(ChunkRef::is_plain) {
            if total * 4 != bytes {
                return Err((
                    ErrorCode::ShapeMismatch,
                    format!("{bytes} payload bytes for {total} floats"),
                ));
            }
            debug_assert!(
                {
                    let mut scan = edl_shared::proto::frame::FiniteScan::default();
                    payload.iter().for_each(|p| scan.part(p));
                    scan.result().is_ok()
                },
                "unchecked push payload"
            );
            return Ok(());
        }
        if let Some(c) = chunks
            .iter()
            .find(|c| self.layout.span(c.key).is_none_or(|s| s.len != c.len))
        {
            let code = match self.layout.span(c.key) {
                None => ErrorCode::UnknownKey,
                Some(_) => ErrorCode::ShapeMismatch,
            };
            let message = format!("{} of {} floats is not one of the job's keys", c.key, c.len);
            return Err((code, message));
        }
        if chunks.iter().any(|c| c.sparse) && chunks.windows(2).any(|w| w[0].key >= w[1].key) {
            return Err((
                ErrorCode::Malformed,
                "a sparse push's chunks must be distinct keys in ascending order".into(),
            ));
        }
        coded::check(payload, chunks).map_err(|e| coded_refusal(e, bytes, chunks))
    }

    /// Applies (ASP, SSP) or stages (BSP) the gradients of `chunks`, read from `grads` (each
    /// converted to f32 block by block as it is applied), for the keys whose ledger segment
    /// `claims` says to apply (all without a span): a push of `worker` at `clock` of samples
    /// of `epoch`. The push was validated.
    pub(super) fn apply_chunks(
        &self,
        held: &DashMap<Key, Chunk>,
        (worker, clock, epoch): (WorkerId, Clock, u32),
        chunks: &[ChunkRef],
        mut grads: Coded<'_>,
        claims: Option<&BTreeMap<u32, Claim>>,
    ) -> Result<Claim, Refusal> {
        // The push was checked whole: a payload that does not hold its chunks now is a bug.
        let broken = |e: ProtoError| {
            Refusal::new(
                ErrorCode::Internal,
                format!("push from {worker}: a checked payload did not read back: {e}"),
            )
        };
        for c in chunks {
            let len = c.len as usize;
            let chunk = held.get_mut(&c.key);
            let skip = match (&chunk, claims) {
                (None, _) => true,
                (Some(chunk), Some(cl)) => cl.get(&chunk.segment) != Some(&Claim::Apply),
                (Some(_), None) => false,
            };
            let Some(mut chunk) = chunk.filter(|_| !skip) else {
                // Past this key's gradient.
                grads.skip(c).map_err(broken)?;
                continue;
            };
            let chunk = &mut *chunk;
            chunk.load += u64::from(c.len);
            if self.bsp() {
                // Re-check under the chunk lock: a pull may have applied this step meanwhile.
                if clock.0 < chunk.applied_through {
                    return Err(Refusal::new(
                        ErrorCode::StaleClock,
                        format!("push from {worker}: step {} closed", clock.0),
                    ));
                }
                // A worker pushes step `c` only once it was granted `c`: every counting worker
                // has pushed every step before `c`, so those can be applied now (a pull would
                // do the same). This keeps staging to a step or two even for a client that
                // pushes without pulling.
                apply_due(&self.job, chunk, clock.0);
                let slot = chunk.pending.entry(clock.0).or_insert_with(|| Staged {
                    sum: vec![0.0; len],
                    pushes: 0,
                    epoch,
                });
                slot.epoch = slot.epoch.max(epoch);
                grads
                    .take(c, |at, g| {
                        let sums = slot.sum[at..].iter_mut();
                        match g {
                            F32Run::Values(v) => sums.zip(v).for_each(|(s, g)| *s += g),
                            F32Run::Le(b) => sums.zip(LeF32s(b).iter()).for_each(|(s, g)| *s += g),
                        }
                    })
                    .map_err(broken)?;
                slot.pushes += 1;
            } else {
                let optimizer = scheduled(&self.job, chunk, epoch, 1);
                let optimizer = optimizer.as_ref();
                let params = Arc::make_mut(&mut chunk.params).as_mut_slice();
                chunk.opt.start(optimizer, len);
                let opt = &mut chunk.opt;
                grads
                    .take(c, |at, g| opt.apply_run(optimizer, params, at, g, 1.0))
                    .map_err(broken)?;
            }
        }
        Ok(Claim::Apply)
    }

    pub(super) fn ledgers(&self) -> MutexGuard<'_, Ledgers> {
        // The ledger is only ever updated whole under the lock; keep serving if a holder panicked.
        self.ledgers.lock().unwrap_or_else(|p| p.into_inner())
    }
}
