//! What makes a coordinator's answers durable: its saves to the store (file, etcd, memory),
//! retried through an outage, training reports acknowledged from memory while the lead's
//! lease surely holds, and the checks that it still leads (fenced once deposed).

use super::*;

/// How often changes no answer waited for (leases that expired, stalls) are written.
pub(super) const PERSIST_EVERY: Duration = Duration::from_millis(500);

/// How long a write to an unavailable store waits before it is tried again, at most.
pub(super) const STORE_RETRY_MAX: Duration = Duration::from_secs(1);

/// How often a training report waiting for its write looks whether it may be acknowledged from
/// memory (while the store is unreachable and the lead surely holds).
pub(super) const FROM_MEMORY_AFTER: Duration = Duration::from_millis(100);

/// How long the store's writes must have failed before training reports are acknowledged from
/// memory: an outage, not the few failed requests of one etcd member's restart (which a retry
/// sends to another member) or of an election among etcd's members. A report acknowledged from
/// memory is not durable, so fewer of them mean less to recover if the coordinator then dies.
pub(super) const STORE_OUTAGE: Duration = Duration::from_secs(1);

/// Writes retried at once after a failure, before the retries back off: a request to an etcd
/// member that is down fails at once, and the next goes to another member.
pub(super) const STORE_RETRY_AT_ONCE: u32 = 2;

/// An answer that took this long (a long poll) is held until the coordinator has checked
/// again that it still leads ([`Coordinator::still_leads`]).
pub(super) const RECHECK_AFTER: Duration = Duration::from_millis(100);

/// What is left of the lead's lease below which nothing more is acknowledged from memory: a
/// report answered must reach its worker, and clocks may drift, before another coordinator
/// could lead.
pub(super) const LEASE_MARGIN: Duration = Duration::from_secs(1);

impl Coordinator {
    /// Makes the state durable if it changed since the last periodic save began: changes no
    /// answer waited for (a lease that expired, a stall).
    pub async fn save_changes(&self) {
        let now = self.version.load(Ordering::Acquire);
        if self.saved_version.swap(now, Ordering::AcqRel) != now {
            self.durable().await;
        }
    }

    /// Returns once every change made to the state before the call is durable in the store
    /// (at once without one); `false` if it never will be, because another coordinator leads
    /// now (the store fenced this one off: see [`Coordinator::deposed`]). Concurrent callers
    /// share a write: the first to get the writer writes the state as it is then, which holds
    /// the changes of everyone who asked before (group commit); a state equal to the one
    /// written last is not written again. While the store is unavailable the write is tried
    /// again, and the answers waiting on it wait: nothing is acknowledged that a crash could
    /// lose.
    pub async fn durable(&self) -> bool {
        self.durable_bytes().await.is_some()
    }

    /// [`Coordinator::durable`], returning the bytes written.
    pub(super) async fn durable_bytes(&self) -> Option<u64> {
        let Some(store) = self.store.as_ref() else {
            return Some(0);
        };
        let ticket = self.wanted.fetch_add(1, Ordering::AcqRel) + 1;
        let mut last = self.writing.lock().await;
        if self.deposed.is_cancelled() {
            return None;
        }
        if self.done.load(Ordering::Acquire) >= ticket {
            return Some(0);
        }
        // Every ticket up to here was taken after its changes: the snapshot holds them.
        let upto = self.wanted.load(Ordering::Acquire);
        let record: Arc<[u8]> = meta::encode(&self.snapshot()).into();
        let mut written = 0;
        if last.as_ref() != Some(&record) {
            let mut pause = Duration::from_millis(20);
            let mut failing_since: Option<tokio::time::Instant> = None;
            let mut failures = 0;
            loop {
                match store.write(record.clone()).await {
                    Ok(()) => {
                        *self.store_failing.lock().unwrap_or_else(|p| p.into_inner()) = None;
                        if self.from_memory.swap(false, Ordering::AcqRel) {
                            info!(
                                "the state store is back: everything acknowledged from memory is written"
                            );
                        }
                        break;
                    }
                    Err(StoreError::Fenced(why)) => {
                        self.fenced(store.as_ref(), &why);
                        return None;
                    }
                    Err(e) => {
                        let since = *failing_since.get_or_insert_with(tokio::time::Instant::now);
                        self.store_failing
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(since);
                        failures += 1;
                        if failures <= STORE_RETRY_AT_ONCE {
                            continue;
                        }
                        if pause == Duration::from_millis(20) || pause >= STORE_RETRY_MAX {
                            warn!(
                                store = %store.describe(),
                                waiting_ms = since.elapsed().as_millis() as u64,
                                "{e}; the answers that depend on the state wait until it is \
                                 written"
                            );
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(STORE_RETRY_MAX);
                    }
                }
            }
            if let Some(since) = failing_since {
                info!(
                    waited_ms = since.elapsed().as_millis() as u64,
                    "the state store is writable again"
                );
            }
            written = record.len() as u64;
            *last = Some(record);
        }
        self.done.fetch_max(upto, Ordering::AcqRel);
        Some(written)
    }

    /// The term of this coordinator's lead (its store's; 0 without an election), carried on
    /// its orders to shards.
    pub fn term(&self) -> u64 {
        self.store.as_ref().map_or(0, |s| s.term())
    }

    /// [`Coordinator::durable`] for a training report (a commit or clock, a data lease): while
    /// the store is unreachable and this coordinator surely still leads (its lease surely
    /// holds: [`MetaStore::lease_until`]), the answer goes without waiting for the write, which
    /// is made once the store is back. Should the coordinator die first, the restore rules
    /// recover what it acknowledged so (a commit past the saved one is counted, a lease it
    /// forgot is given back, and the shards' ledgers skip a span applied twice). Nothing else
    /// is acknowledged from memory: control operations wait for the store, and say so.
    pub(super) async fn durable_training(&self) -> bool {
        let Some(until) = self.store.as_ref().and_then(|s| s.lease_until()) else {
            return self.durable().await;
        };
        let write = self.durable();
        tokio::pin!(write);
        loop {
            tokio::select! {
                biased;
                ok = &mut write => return ok,
                _ = tokio::time::sleep(FROM_MEMORY_AFTER) => {}
            }
            let until = self
                .store
                .as_ref()
                .and_then(|s| s.lease_until())
                .unwrap_or(until);
            let margin = until.saturating_duration_since(tokio::time::Instant::now());
            // Never probed: no standby could revoke the lease. Probed: only while the standby
            // surely still sees this coordinator leading.
            let seen = self.probed_within_window().is_none_or(|fresh| fresh);
            let outage = self
                .store_failing
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some_and(|since| since.elapsed() >= STORE_OUTAGE);
            if outage && !self.deposed.is_cancelled() && margin > LEASE_MARGIN && seen {
                if !self.from_memory.swap(true, Ordering::AcqRel) {
                    warn!(
                        lease_left_ms = margin.as_millis() as u64,
                        "the state store is unreachable: training reports are acknowledged \
                         from memory while this coordinator's lead surely holds; control \
                         operations wait for the store"
                    );
                }
                return true;
            }
        }
    }

    /// Whether the last standby's probe came within the probe window (`None`: no standby ever
    /// probed this coordinator).
    pub(super) fn probed_within_window(&self) -> Option<bool> {
        let window = *self.probe_window.lock().unwrap_or_else(|p| p.into_inner());
        self.probed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|t| t.elapsed() < window)
    }

    /// Whether this coordinator still leads, checked before a request is answered (an
    /// elected one's: a single coordinator always leads). One a standby probed within the
    /// probe window surely does: no standby revokes its lease before the window is over.
    /// Any other (one that was paused, or cut off from its standbys) asks the store, in a
    /// round trip shared by the requests that arrived before it was sent: a leader deposed
    /// while it was paused must not answer from the state it held, which the new leader has
    /// moved on from. `false` once deposed. While the store cannot be reached, one that no
    /// standby ever probed goes on answering within its lease, as it acknowledges training
    /// from memory (no standby knows it, and none can take the lead without the store); one a
    /// standby probed, but not lately, waits (as a control operation does) until a probe comes
    /// or the store answers: that standby may be about to revoke its lease.
    pub(super) async fn still_leads(&self) -> bool {
        let Some(store) = self.store.as_ref().filter(|s| s.term() > 0) else {
            return true;
        };
        // Only a check sent after this moment covers the request (moved on after each retry).
        let mut arrived = tokio::time::Instant::now();
        let mut pause = Duration::from_millis(20);
        let mut failing_since: Option<tokio::time::Instant> = None;
        loop {
            if self.deposed.is_cancelled() {
                return false;
            }
            let lease_holds = store.lease_until().is_none_or(|until| {
                until.saturating_duration_since(tokio::time::Instant::now()) > LEASE_MARGIN
            });
            let probed = self.probed_within_window();
            if lease_holds && probed == Some(true) {
                return true;
            }
            if lease_holds && probed.is_none() && failing_since.is_some() {
                return true;
            }
            let mut last = self.confirmed.lock().await;
            if self.deposed.is_cancelled() {
                return false;
            }
            // A check sent after the request arrived covers it, whatever it found: waiters
            // share one round trip, and one failure, rather than each sending its own.
            let (confirmed, failure) = match *last {
                Some((sent, ok)) if sent >= arrived => (ok, None),
                _ => {
                    let sent = tokio::time::Instant::now();
                    match store.confirm().await {
                        Ok(()) => {
                            *last = Some((sent, true));
                            (true, None)
                        }
                        Err(StoreError::Fenced(why)) => {
                            self.fenced(store.as_ref(), &why);
                            return false;
                        }
                        Err(e) => {
                            *last = Some((sent, false));
                            (false, Some(e))
                        }
                    }
                }
            };
            drop(last);
            if confirmed {
                return true;
            }
            let since = *failing_since.get_or_insert_with(tokio::time::Instant::now);
            if let Some(e) = failure
                && (pause == Duration::from_millis(20) || pause >= STORE_RETRY_MAX)
            {
                warn!(
                    store = %store.describe(),
                    waiting_ms = since.elapsed().as_millis() as u64,
                    "{e}; cannot confirm that this coordinator still leads: answers wait"
                );
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(STORE_RETRY_MAX);
            arrived = tokio::time::Instant::now();
        }
    }

    /// The store fenced this coordinator off (`why`): another one leads. It answers nothing
    /// more, and its process ends.
    pub(super) fn fenced(&self, store: &dyn MetaStore, why: &str) {
        if !self.deposed.is_cancelled() {
            tracing::error!(
                store = %store.describe(),
                "{why}: this coordinator was deposed and answers nothing more"
            );
        }
        self.deposed.cancel();
    }

    /// How long after a standby's probe this coordinator may still acknowledge from memory
    /// (three quarters of a standby's `dead_after`: a standby revokes the lease only after its
    /// probes failed for a whole `dead_after`, all of them after the last one answered).
    pub fn set_probe_window(&self, window: Duration) {
        *self.probe_window.lock().unwrap_or_else(|p| p.into_inner()) = window;
    }

    /// Cancelled once the store fenced this coordinator off: another one leads.
    pub fn deposed(&self) -> CancellationToken {
        self.deposed.clone()
    }
}
