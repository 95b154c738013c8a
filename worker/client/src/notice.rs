//! Being asked to leave: a drain (leave after the current step) or a preemption notice
//! (leave before a deadline, abandoning the step if it cannot finish in time). The coordinator
//! says so in heartbeat answers and clock grants; a worker that gets a spot notice itself
//! (a signal from a cloud agent) passes it on with [`Notices::preempt`].

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use edl_shared::proto::ids::WorkerId;
use edl_shared::proto::{Frame, Request, Response};
use tokio::sync::Notify;

use crate::{ClientError, CoordLink};

/// What the worker was told, shared by the session, its heartbeat and [`Notices`] handles.
#[derive(Debug, Default)]
pub(crate) struct NoticeState {
    drain: AtomicBool,
    deadline: Mutex<Option<Instant>>,
    changed: Notify,
}

impl NoticeState {
    pub(crate) fn drain(&self) -> bool {
        self.drain.load(Ordering::SeqCst)
    }

    /// Records a drain and, with a notice, the deadline (the earliest one told wins).
    pub(crate) fn tell(&self, drain: bool, notice: Option<Duration>) {
        if drain {
            self.drain.store(true, Ordering::SeqCst);
        }
        // A notice too long for the clock is no deadline at all.
        if let Some(d) = notice.and_then(|n| Instant::now().checked_add(n)) {
            let mut g = self.deadline.lock().unwrap_or_else(|p| p.into_inner());
            *g = Some(g.map_or(d, |old| old.min(d)));
        }
        if drain || notice.is_some() {
            self.changed.notify_waiters();
        }
    }

    fn deadline(&self) -> Option<Instant> {
        *self.deadline.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A handle on a session's leave notices, usable while the session is busy in a step (it
/// borrows nothing from the session).
#[derive(Clone, Debug)]
pub struct Notices {
    pub(crate) state: std::sync::Arc<NoticeState>,
    pub(crate) coordinator: CoordLink,
    pub(crate) worker: WorkerId,
}

impl Notices {
    /// The worker is asked to leave after its current step (a drain or a preemption).
    pub fn drain_requested(&self) -> bool {
        self.state.drain()
    }

    /// When the worker must be gone, if it got a preemption notice.
    pub fn deadline(&self) -> Option<Instant> {
        self.state.deadline()
    }

    /// Resolves once a preemption deadline, less `margin` (the time leaving takes), has
    /// passed; never without a notice. An earlier deadline told meanwhile is kept.
    pub async fn expired(&self, margin: Duration) {
        loop {
            let changed = self.state.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.state.deadline() {
                Some(d) => {
                    let at = d.checked_sub(margin).unwrap_or(d);
                    tokio::select! {
                        biased;
                        _ = tokio::time::sleep_until(at.into()) => return,
                        _ = changed => {}
                    }
                }
                None => changed.await,
            }
        }
    }

    /// A preemption notice this worker received itself (a spot instance's warning): the
    /// worker must be gone before `notice` runs out, and the coordinator is told, so that it
    /// can ask for a substitute at once. When one is coming the worker trains on until the
    /// coordinator drains it (the substitute was admitted) or the deadline nears; otherwise,
    /// or if the coordinator cannot be reached, it leaves after its current step.
    pub async fn preempt(&self, notice: Duration) -> Result<(), ClientError> {
        self.state.tell(false, Some(notice));
        let notice_ms = notice.as_millis().min(u128::from(u64::MAX)) as u64;
        let r = self
            .coordinator
            .call(
                Request::Preempt {
                    worker: self.worker,
                    notice_ms,
                },
                Bytes::new(),
            )
            .await;
        match r {
            Ok(Frame {
                msg: Response::Placed(_),
                ..
            }) => Ok(()),
            Ok(_) => {
                self.state.tell(true, None);
                Ok(())
            }
            Err(e) => {
                self.state.tell(true, None);
                Err(e.into())
            }
        }
    }
}
