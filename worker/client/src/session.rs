//! A registered worker's session: lease batches, pull, push, commit steps, leave.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use edl_shared::proto::ids::{Clock, Key, Token, WorkerId};
use edl_shared::proto::msg::{DataSpan, KeyRange, Partition};
use edl_shared::proto::order::epoch_order;
use edl_shared::proto::{ErrorCode, Request, Response};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::CallError;

use super::routing::Grads;
use super::{ClientError, Gradients, Job, JobSpec, is_connection_failure, retry_not_ready};

/// A mini-batch leased to this worker: a data span of an epoch and the sample indices it
/// holds. It comes only from [`Session::next_batch`]; [`Session::push`] sends the gradient
/// computed from exactly these samples, and [`Session::commit`] (which consumes it) marks them
/// done. It cannot be cloned, so no gradient can be pushed for samples the worker was not
/// given, and none committed twice.
#[derive(Debug)]
pub struct Batch {
    span: DataSpan,
    order: Arc<Vec<u32>>,
    clock: Clock,
}

impl Batch {
    /// The indices of the batch's samples in the training set (positions `span.start..end`
    /// of the epoch's order). A span re-issued after a worker died has the same indices.
    pub fn indices(&self) -> &[u32] {
        &self.order[self.span.start as usize..self.span.end as usize]
    }

    /// The data span: the epoch, its partition and the positions in the epoch's order.
    pub fn span(&self) -> DataSpan {
        self.span
    }

    /// The epoch the batch belongs to (from 0).
    pub fn epoch(&self) -> u32 {
        self.span.epoch
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.span.len() as usize
    }

    /// True for a batch without samples (never handed out).
    pub fn is_empty(&self) -> bool {
        self.span.is_empty()
    }

    /// The step (clock) the batch's gradient belongs to.
    pub fn clock(&self) -> Clock {
        self.clock
    }
}

/// Sparse gradients of some rows of one tensor, for [`Session::push_rows`]: `values` holds
/// `rows.len()` rows of the tensor's row length, in the order of `rows` (a row named twice
/// is summed).
#[derive(Clone, Copy, Debug)]
pub struct RowGrads<'a> {
    /// The tensor's name.
    pub tensor: &'a str,
    /// The rows (first-dimension indices).
    pub rows: &'a [u32],
    /// Their gradients, row after row.
    pub values: &'a [f32],
}

/// Where the session stands in its leased data.
#[derive(Debug, Default)]
pub(super) struct Feed {
    /// The partition being worked through, and the position its next batch starts at.
    part: Option<(Partition, u32)>,
    /// The order of the epoch in use.
    order: Option<(u32, Arc<Vec<u32>>)>,
    /// The batch handed out and not yet committed, and whether its gradient was pushed.
    outstanding: Option<(DataSpan, bool)>,
    /// A partition lease was asked for and not answered (set while the request is out, so
    /// it stays set when the call is abandoned).
    leasing: bool,
    /// A step report (a commit) was sent and not answered, likewise.
    committing: bool,
}

/// What a session holds on the coordinator that leaving would hand back ([`Session::holdings`]).
/// A worker that ends without leaving gets it back to the pool only when its heartbeat lease
/// expires on the coordinator, which then counts the worker dead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holdings {
    /// The worker's registration.
    pub worker: WorkerId,
    /// The leased partition's positions not yet committed (`start` is where the committed
    /// samples end), if any: they return to the pool when the worker leaves or dies.
    pub uncommitted: Option<DataSpan>,
    /// How far the batch handed out last got, if it is not committed.
    pub batch: Option<BatchState>,
    /// A partition lease was asked for and not answered: the coordinator may hold one more
    /// partition for this worker (it returns to the pool, whole, with the rest).
    pub lease_unknown: bool,
}

/// How far an uncommitted batch got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchState {
    /// Handed out; its gradient not pushed, or its push not answered by every shard (a shard
    /// that applied it skips the span when it is re-issued).
    Handed(DataSpan),
    /// Its gradient pushed to every shard; not committed.
    Pushed(DataSpan),
    /// Its gradient pushed and its commit sent, with no answer: whether the coordinator has it
    /// is unknown. If it has, those samples are done; if not, they return to the pool with
    /// the rest (and the shards skip the gradient they applied when the span is re-issued).
    CommitUnknown(DataSpan),
}

/// `epoch E partition P positions A..B`.
fn span_text(s: &DataSpan) -> String {
    format!(
        "epoch {} partition {} positions {}..{}",
        s.epoch, s.partition, s.start, s.end
    )
}

impl std::fmt::Display for Holdings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}'s registration", self.worker)?;
        if let Some(u) = &self.uncommitted {
            write!(f, "; {} leased and not committed", span_text(u))?;
        }
        match &self.batch {
            None => {}
            Some(BatchState::Handed(s)) => write!(
                f,
                "; the last batch ({}) not pushed to every shard",
                span_text(s)
            )?,
            Some(BatchState::Pushed(s)) => write!(
                f,
                "; the last batch ({}) pushed, not committed",
                span_text(s)
            )?,
            Some(BatchState::CommitUnknown(s)) => write!(
                f,
                "; the last batch's commit ({}) unknown: sent, not answered",
                span_text(s)
            )?,
        }
        if self.lease_unknown {
            write!(
                f,
                "; a partition lease asked for and not answered (one more partition may be \
                 leased to it)"
            )?;
        }
        Ok(())
    }
}

/// A registered worker's session.
#[derive(Debug)]
pub struct Session {
    pub(super) job: Job,
    pub(super) worker: WorkerId,
    /// The coordinator's token for `worker`, which every push carries to the shards.
    pub(super) token: Token,
    pub(super) clock: Clock,
    pub(super) granted: Clock,
    pub(super) stop: CancellationToken,
    pub(super) lost: Arc<AtomicBool>,
    pub(super) notice: Arc<crate::notice::NoticeState>,
    pub(super) feed: Feed,
    /// Top-k pushes' error feedback: held for a push's whole length, so that pushes of one
    /// session take their residual in turn. Dropped with the session.
    pub(super) residual: tokio::sync::Mutex<crate::topk::Residual>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Session {
    /// This worker's id.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// The coordinator's token for this worker, which every push carries (for tools that
    /// speak the protocol directly).
    pub fn token(&self) -> Token {
        self.token
    }

    /// The job connection.
    pub fn job(&self) -> &Job {
        &self.job
    }

    /// Steps completed (the clock of the next push).
    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// True once this worker is asked to leave after its current step: an operator drained
    /// it, a replacement took its place, or it got a preemption notice (seen on a clock
    /// grant or a heartbeat answer).
    pub fn drain_requested(&self) -> bool {
        self.notice.drain()
    }

    /// A handle on this worker's leave notices that borrows nothing from the session: to
    /// watch for a preemption deadline during a step, or to pass on a spot notice.
    pub fn notices(&self) -> crate::Notices {
        crate::Notices {
            state: self.notice.clone(),
            coordinator: self.job.coordinator.clone(),
            worker: self.worker,
        }
    }

    /// What this session holds that [`Session::leave`] would hand back: its registration, the
    /// uncommitted rest of its leased partition, how far its last batch got, and whether a
    /// lease or a commit is still unanswered (a call abandoned midway, e.g. by a timeout,
    /// leaves its outcome unknown). For a worker that must say what it could not return
    /// before it exits.
    pub fn holdings(&self) -> Holdings {
        let feed = &self.feed;
        let uncommitted = feed.part.and_then(|(part, next)| {
            // The batch handed out last belongs to this partition: committing it was the
            // last thing that moved the committed position.
            let start = feed.outstanding.map_or(next, |(s, _)| s.start);
            let end = part.start + part.len;
            (start < end).then_some(DataSpan {
                epoch: part.epoch,
                partition: part.index,
                start,
                end,
            })
        });
        let batch = feed.outstanding.map(|(span, pushed)| match pushed {
            false => BatchState::Handed(span),
            true if feed.committing => BatchState::CommitUnknown(span),
            true => BatchState::Pushed(span),
        });
        Holdings {
            worker: self.worker,
            uncommitted,
            batch,
            lease_unknown: feed.leasing,
        }
    }

    /// Stops heartbeating, as a worker that hangs would (tests use this to simulate a failure).
    pub fn stop_heartbeat(&self) {
        self.stop.cancel();
    }

    fn check_lost(&self) -> Result<(), ClientError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(ClientError::Dropped(self.worker));
        }
        Ok(())
    }

    fn map_dropped(&self, e: ClientError) -> ClientError {
        match &e {
            ClientError::Call(c) if c.code() == Some(ErrorCode::UnknownWorker) => {
                ClientError::Dropped(self.worker)
            }
            _ => e,
        }
    }

    /// The model's tensors.
    pub fn spec(&self) -> &JobSpec {
        self.job.spec()
    }

    /// The next mini-batch of the job's data, or `None` once every epoch's data is leased
    /// out and done. Partitions are leased from the coordinator as needed (waiting while
    /// others hold the last of the data, which comes back if they die); a partition is cut
    /// into batches of the job's batch size from its (possibly re-issued) start. The batch
    /// handed out before must be committed first.
    pub async fn next_batch(&mut self) -> Result<Option<Batch>, ClientError> {
        if let Some((span, _)) = self.feed.outstanding {
            return Err(ClientError::Batch(format!(
                "the batch of epoch {} positions {}..{} is not committed yet",
                span.epoch, span.start, span.end
            )));
        }
        let cfg = self.job.config();
        let (samples, seed, batch_size) = (cfg.train_samples, cfg.seed, cfg.batch_size.max(1));
        loop {
            if let Some((part, next)) = self.feed.part
                && next < part.start + part.len
            {
                let span = DataSpan {
                    epoch: part.epoch,
                    partition: part.index,
                    start: next,
                    end: (next + batch_size).min(part.start + part.len),
                };
                let order = match &self.feed.order {
                    Some((e, o)) if *e == part.epoch => o.clone(),
                    _ => {
                        let o = Arc::new(epoch_order(seed, part.epoch, samples));
                        self.feed.order = Some((part.epoch, o.clone()));
                        o
                    }
                };
                self.feed.part = Some((part, span.end));
                self.feed.outstanding = Some((span, false));
                return Ok(Some(Batch {
                    span,
                    order,
                    clock: self.clock,
                }));
            }
            self.feed.part = None;
            let Some(part) = self.next_partition().await? else {
                return Ok(None);
            };
            if part.len == 0 || u64::from(part.start) + u64::from(part.len) > u64::from(samples) {
                return Err(self.job.inconsistent(
                    "coordinator",
                    format!(
                        "partition {}..{} is outside an epoch of {samples} samples",
                        part.start,
                        u64::from(part.start) + u64::from(part.len)
                    ),
                ));
            }
            self.feed.part = Some((part, part.start));
        }
    }

    /// Checks that `batch` is the one handed out and in what state.
    fn check_batch(&self, batch: &Batch, pushed: bool) -> Result<(), ClientError> {
        match self.feed.outstanding {
            Some((span, p)) if span == batch.span && batch.clock == self.clock => {
                if p == pushed {
                    Ok(())
                } else if p {
                    Err(ClientError::Batch(
                        "the batch's gradient was pushed already".into(),
                    ))
                } else {
                    Err(ClientError::Batch(
                        "push the batch's gradient before committing it".into(),
                    ))
                }
            }
            _ => Err(ClientError::Batch(
                "the batch is not the one this session handed out last".into(),
            )),
        }
    }

    /// Pushes the gradient computed from `batch`'s samples: the flat vector over the whole
    /// model. Shards that applied this span before (for a worker that died before
    /// committing it) skip it, so a re-issued batch's gradient is applied once.
    pub async fn push(&mut self, batch: &Batch, grads: &[f32]) -> Result<(), ClientError> {
        self.push_from(batch, Grads::Borrowed(grads)).await
    }

    /// [`Session::push`] of [`Gradients`]: sent as they lie, with no copy into a wire buffer
    /// (the fastest way to push large tensors).
    pub async fn push_gradients(
        &mut self,
        batch: &Batch,
        grads: &Gradients,
    ) -> Result<(), ClientError> {
        self.push_from(batch, Grads::Shared(grads)).await
    }

    async fn push_from(&mut self, batch: &Batch, grads: Grads<'_>) -> Result<(), ClientError> {
        self.check_batch(batch, false)?;
        self.push_grads(grads, Some(batch.span)).await?;
        self.feed.outstanding = Some((batch.span, true));
        Ok(())
    }

    /// Pushes the gradient of the current step, with its data span if it has one.
    async fn push_grads(
        &self,
        grads: Grads<'_>,
        span: Option<DataSpan>,
    ) -> Result<(), ClientError> {
        self.check_lost()?;
        let me = (self.worker, self.token);
        if self.job.sparsifies() {
            let values: &[f32] = match grads {
                Grads::Borrowed(g) => g,
                Grads::Shared(g) => g,
            };
            let mut residual = self.residual.lock().await;
            return (self.job)
                .push_topk(me, self.clock, &mut residual, values, span)
                .await;
        }
        self.job.push_all(me, self.clock, grads, span).await
    }

    /// The magnitude of this worker's top-k residual (the sum of the absolute values its
    /// pushes have held back and not sent yet); 0 in a job that pushes every value.
    pub async fn residual_l1(&self) -> f64 {
        self.residual.lock().await.l1()
    }

    /// Pushes sparse gradients computed from `batch`'s samples: the given rows of the given
    /// tensors; every other parameter's gradient is zero. Only the keys (chunks) holding
    /// those rows travel, each whole (zero outside the rows); every shard still records the
    /// batch's span, so the data ledger stays exact.
    pub async fn push_rows(
        &mut self,
        batch: &Batch,
        grads: &[RowGrads<'_>],
    ) -> Result<(), ClientError> {
        self.check_batch(batch, false)?;
        self.check_lost()?;
        let spec = self.job.spec();
        let mut chunks: BTreeMap<Key, Vec<f32>> = BTreeMap::new();
        for g in grads {
            let t = spec.require(g.tensor)?;
            if g.values.len() != g.rows.len() * t.row_len() {
                return Err(ClientError::RowShape {
                    what: format!(
                        "{} rows of tensor {:?} need {} values, {} given",
                        g.rows.len(),
                        g.tensor,
                        g.rows.len() * t.row_len(),
                        g.values.len()
                    ),
                });
            }
            for p in spec.pieces(t, g.rows)? {
                let chunk = chunks
                    .entry(p.key)
                    .or_insert_with(|| vec![0.0; p.chunk_len]);
                let src = &g.values[p.buf_at..p.buf_at + p.len];
                for (d, v) in chunk[p.at..p.at + p.len].iter_mut().zip(src) {
                    *d += v;
                }
            }
        }
        let chunks: Vec<(Key, &[f32])> = chunks.iter().map(|(k, v)| (*k, v.as_slice())).collect();
        self.job
            .push_keys(
                (self.worker, self.token),
                self.clock,
                &chunks,
                Some(batch.span),
            )
            .await
            .map_err(|e| self.map_dropped(e))?;
        self.feed.outstanding = Some((batch.span, true));
        Ok(())
    }

    /// Pulls rows `rows` of tensor `tensor` into `out` (`rows.len()` rows of the tensor's row
    /// length, in the order of `rows`), with every BSP step this worker may see applied. Only
    /// the keys (chunks) holding those rows travel, and their floats go straight into `out`.
    pub async fn pull_rows(
        &self,
        tensor: &str,
        rows: &[u32],
        out: &mut [f32],
    ) -> Result<(), ClientError> {
        self.check_lost()?;
        let spec = self.job.spec();
        let t = spec.require(tensor)?;
        if out.len() != rows.len() * t.row_len() {
            return Err(ClientError::RowShape {
                what: format!(
                    "{} rows of tensor {tensor:?} need {} floats of output, {} given",
                    rows.len(),
                    rows.len() * t.row_len(),
                    out.len()
                ),
            });
        }
        let mut pieces = spec.pieces(t, rows)?;
        pieces.sort_unstable_by_key(|p| p.key);
        let mut keys: Vec<Key> = pieces.iter().map(|p| p.key).collect();
        keys.dedup();
        let mut seen = vec![false; keys.len()];
        let wanted = KeyRange::runs(keys.iter().map(|k| k.0));
        let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut *out);
        self.job
            .pull(Some(wanted), self.granted, None, |key, at, part| {
                // `part` holds the chunk's bytes from `at` on: copy what falls in each piece.
                let from = pieces.partition_point(|p| p.key < key);
                for p in pieces[from..].iter().take_while(|p| p.key == key) {
                    let (start, end) = (p.at * 4, (p.at + p.len) * 4);
                    let (a, b) = (start.max(at), end.min(at + part.len()));
                    if a < b {
                        let to = p.buf_at * 4 + (a - start);
                        dst[to..to + (b - a)].copy_from_slice(&part[a - at..b - at]);
                    }
                }
                if let Ok(i) = keys.binary_search(&key) {
                    seen[i] = true;
                }
            })
            .await
            .map_err(|e| self.map_dropped(e))?;
        crate::routing::from_le_in_place(out);
        match seen.iter().position(|s| !s) {
            Some(i) => Err(self
                .job
                .inconsistent("shards", format!("{} was not returned", keys[i]))),
            None => Ok(()),
        }
    }

    /// Checks, without sending anything, that [`Session::commit`] would take `batch`: it is
    /// the batch handed out last and its gradient was pushed. For callers (the Python binding)
    /// that must know before they give the batch up.
    pub fn check_commit(&self, batch: &Batch) -> Result<(), ClientError> {
        self.check_batch(batch, true)
    }

    /// Commits `batch`, whose gradient was pushed: its samples are done. Then waits until
    /// the consistency model lets this worker start the next step. `loss_sum` is the sum of
    /// the batch's per-sample losses (the coordinator reports their mean per epoch). Returns
    /// the slowest active worker's clock.
    pub async fn commit(&mut self, batch: Batch, loss_sum: f64) -> Result<Clock, ClientError> {
        self.check_batch(&batch, true)?;
        let clock = self.commit_span(batch.span, loss_sum).await?;
        self.feed.outstanding = None;
        Ok(clock)
    }

    /// Pulls every parameter into `out`, with every BSP step this worker may see applied.
    pub async fn pull(&self, out: &mut [f32]) -> Result<(), ClientError> {
        self.check_lost()?;
        self.job.pull_all(out, self.granted).await
    }

    /// Pushes the gradient of the current step with no data span: for jobs without a data
    /// ledger (synthetic load, benchmarks). Training on data uses [`Session::push`].
    pub async fn push_step(&self, grads: &[f32]) -> Result<(), ClientError> {
        self.push_grads(Grads::Borrowed(grads), None).await
    }

    /// [`Session::push_step`] of [`Gradients`], sent as they lie.
    pub async fn push_step_gradients(&self, grads: &Gradients) -> Result<(), ClientError> {
        self.push_grads(Grads::Shared(grads), None).await
    }

    /// Pushes the gradient of the current step, computed from the samples of `span` (the
    /// low-level form of [`Session::push`], for tools that keep their own spans). Shards
    /// that applied this span before (for a worker that died before committing it) skip it.
    pub async fn push_span(&self, grads: &[f32], span: DataSpan) -> Result<(), ClientError> {
        self.push_grads(Grads::Borrowed(grads), Some(span)).await
    }

    /// Pushes sparse gradients for the current step.
    pub async fn push_keys(&self, chunks: &[(Key, &[f32])]) -> Result<(), ClientError> {
        self.check_lost()?;
        self.job
            .push_keys((self.worker, self.token), self.clock, chunks, None)
            .await
    }

    /// Ends the current step: reports its progress and waits until the consistency model lets
    /// this worker start the next one. Returns the slowest active worker's clock.
    pub async fn advance(
        &mut self,
        epoch: u32,
        samples: u32,
        loss_sum: f64,
    ) -> Result<Clock, ClientError> {
        self.end_step(epoch, samples, loss_sum, None, false).await
    }

    /// Ends a step whose gradients came from `span` (pushed with [`Session::push_span`]):
    /// commits the span as used, then waits as [`Session::advance`] does (the low-level form
    /// of [`Session::commit`]).
    pub async fn commit_span(
        &mut self,
        span: DataSpan,
        loss_sum: f64,
    ) -> Result<Clock, ClientError> {
        self.end_step(span.epoch, span.len(), loss_sum, Some(span), false)
            .await
    }

    /// Commits the step of `span` without waiting for the others, before leaving. Safe to send
    /// after an interrupted [`Session::commit`]: a repeated report is recognized.
    pub async fn commit_last(&mut self, span: DataSpan, loss_sum: f64) -> Result<(), ClientError> {
        self.end_step(span.epoch, span.len(), loss_sum, Some(span), true)
            .await?;
        if self.feed.outstanding.is_some_and(|(s, _)| s == span) {
            self.feed.outstanding = None;
        }
        Ok(())
    }

    async fn end_step(
        &mut self,
        epoch: u32,
        samples: u32,
        loss_sum: f64,
        span: Option<DataSpan>,
        last: bool,
    ) -> Result<Clock, ClientError> {
        self.check_lost()?;
        let next = Clock(self.clock.0 + 1);
        self.feed.committing = true;
        let mut span = span;
        let (mut samples, mut loss_sum) = (samples, loss_sum);
        // The payload bytes since the last report go with this one, put back unless it was
        // answered (refused, failed, or abandoned midway: a report of this clock that had
        // arrived is counted already, and the coordinator counts a repeat of it as nothing).
        let mut taken = crate::Unreported::take(&self.job.traffic);
        let traffic = taken.bytes;
        let resp = loop {
            let r = self
                .report_step(next, epoch, (samples, loss_sum), span, last, traffic)
                .await;
            match (&r, span) {
                // The coordinator does not hold the span's partition as leased to this worker
                // (its state lost the lease): the span goes back, uncommitted. Its gradient
                // is in the shards' ledgers, so whoever commits the span next is skipped
                // there and counts it once. The step itself is reported without it, and the
                // next batch comes from a new lease.
                (Err(e), Some(s)) if e.code() == Some(ErrorCode::LeaseUnknown) => {
                    tracing::warn!(
                        worker = %self.worker,
                        "{e}: giving epoch {} positions {}..{} back and leasing again",
                        s.epoch,
                        s.start,
                        s.end
                    );
                    self.feed.part = None;
                    if self.feed.outstanding.is_some_and(|(o, _)| o == s) {
                        self.feed.outstanding = None;
                    }
                    (span, samples, loss_sum) = (None, 0, 0.0);
                }
                _ => break r,
            }
        };
        // An answer, even a refusal, settles the report; a failed connection does not.
        if !matches!(&resp, Err(e) if is_connection_failure(e)) {
            self.feed.committing = false;
        }
        taken.counted = resp.is_ok();
        // A Clock retried after a long-poll timeout repeats only the wait: the coordinator
        // treats a report of the clock it already holds as a duplicate.
        let resp = match resp {
            Ok(r) => r,
            Err(e) => return Err(self.map_dropped(e.into())),
        };
        match resp.msg {
            Response::ClockGranted { min_clock, drain } => {
                self.clock = next;
                self.granted = min_clock;
                self.notice.tell(drain, None);
                Ok(min_clock)
            }
            other => Err(CallError::unexpected(&other).into()),
        }
    }

    /// Reports the end of step `next` (see [`Session::end_step`]).
    async fn report_step(
        &self,
        next: Clock,
        epoch: u32,
        (samples, loss_sum): (u32, f64),
        span: Option<DataSpan>,
        last: bool,
        (bytes_pushed, bytes_pulled): (u64, u64),
    ) -> Result<edl_shared::proto::Frame<Response>, CallError> {
        retry_not_ready(u32::MAX, || {
            self.job.coordinator.call(
                Request::Clock {
                    worker: self.worker,
                    clock: next,
                    epoch,
                    samples,
                    loss_sum,
                    span,
                    last,
                    bytes_pushed,
                    bytes_pulled,
                },
                Bytes::new(),
            )
        })
        .await
    }

    /// Leases the next data partition. `None` means no data is left in any epoch.
    pub async fn next_partition(&mut self) -> Result<Option<Partition>, ClientError> {
        self.check_lost()?;
        self.feed.leasing = true;
        let r = self.lease_partition().await;
        // An answer, even a refusal, settles the lease; a failed connection does not.
        if !matches!(&r, Err(ClientError::Call(e)) if is_connection_failure(e)) {
            self.feed.leasing = false;
        }
        r
    }

    async fn lease_partition(&mut self) -> Result<Option<Partition>, ClientError> {
        loop {
            let r = self
                .job
                .coordinator
                .call(
                    Request::NextPartition {
                        worker: self.worker,
                    },
                    Bytes::new(),
                )
                .await;
            match r {
                Ok(resp) => {
                    return match resp.msg {
                        Response::Partition { partition, clock } => {
                            self.clock = clock;
                            self.granted = self.granted.max(clock);
                            Ok(partition)
                        }
                        other => Err(CallError::unexpected(&other).into()),
                    };
                }
                // The long poll timed out while others still hold the remaining data.
                Err(e) if e.code() == Some(ErrorCode::NotReady) => {}
                Err(e) => return Err(self.map_dropped(e.into())),
            }
        }
    }

    /// Leaves gracefully: the coordinator stops counting this worker and returns its data.
    /// A caller that may give up on the leave (a bounded shutdown) takes
    /// [`Session::holdings`] first, to say what it could not hand back.
    pub async fn leave(self) -> Result<(), ClientError> {
        self.stop.cancel();
        let r = self
            .job
            .coordinator
            .call(
                Request::Leave {
                    worker: self.worker,
                },
                Bytes::new(),
            )
            .await;
        match r {
            Ok(_) => Ok(()),
            // Already gone (a repeated leave after a reconnect, or dropped meanwhile): the
            // worker is no longer registered, which is what leaving asks for.
            Err(e) if e.code() == Some(ErrorCode::UnknownWorker) => {
                tracing::warn!(worker = %self.worker, "already unregistered when leaving");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }
}
