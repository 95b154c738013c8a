//! A registered worker's session: pull, push, commit steps, lease data, leave.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use edl_shared::proto::ids::{Clock, Key, Token, WorkerId};
use edl_shared::proto::msg::{DataSpan, Partition};
use edl_shared::proto::{ErrorCode, Request, Response};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::CallError;

use super::{ClientError, Job, retry_not_ready};

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
    pub(super) drain: bool,
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

    /// True once an operator asked this worker to leave (seen on a clock grant).
    pub fn drain_requested(&self) -> bool {
        self.drain
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

    /// Pulls every parameter into `out`, with every BSP step this worker may see applied.
    pub async fn pull(&self, out: &mut [f32]) -> Result<(), ClientError> {
        self.check_lost()?;
        self.job.pull_all(out, self.granted).await
    }

    /// Pushes the gradient of the current step.
    pub async fn push(&self, grads: &[f32]) -> Result<(), ClientError> {
        self.check_lost()?;
        self.job
            .push_all((self.worker, self.token), self.clock, grads, None)
            .await
    }

    /// Pushes the gradient of the current step, computed from the samples of `span`. Shards
    /// that applied this span before (for a worker that died before committing it) skip it.
    pub async fn push_span(&self, grads: &[f32], span: DataSpan) -> Result<(), ClientError> {
        self.check_lost()?;
        self.job
            .push_all((self.worker, self.token), self.clock, grads, Some(span))
            .await
    }

    /// Pushes sparse gradients for the current step.
    pub async fn push_keys(&self, chunks: &[(Key, &[f32])]) -> Result<(), ClientError> {
        self.check_lost()?;
        self.job
            .push_keys((self.worker, self.token), self.clock, chunks)
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
    /// commits the span as used, then waits as [`Session::advance`] does.
    pub async fn commit(&mut self, span: DataSpan, loss_sum: f64) -> Result<Clock, ClientError> {
        self.end_step(span.epoch, span.len(), loss_sum, Some(span), false)
            .await
    }

    /// Commits the step of `span` without waiting for the others, before leaving. Safe to send
    /// after an interrupted [`Session::commit`]: a repeated report is recognized.
    pub async fn commit_last(&mut self, span: DataSpan, loss_sum: f64) -> Result<(), ClientError> {
        self.end_step(span.epoch, span.len(), loss_sum, Some(span), true)
            .await
            .map(|_| ())
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
        let resp = retry_not_ready(u32::MAX, || {
            self.job.coordinator.call(
                Request::Clock {
                    worker: self.worker,
                    clock: next,
                    epoch,
                    samples,
                    loss_sum,
                    span,
                    last,
                },
                Bytes::new(),
            )
        })
        .await;
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
                self.drain |= drain;
                Ok(min_clock)
            }
            other => Err(CallError::unexpected(&other).into()),
        }
    }

    /// Leases the next data partition. `None` means no data is left in any epoch.
    pub async fn next_partition(&mut self) -> Result<Option<Partition>, ClientError> {
        self.check_lost()?;
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
