//! The client's way to a job's coordinators: one connection to the one believed to lead,
//! replaced when it fails or a standby answers, and an outage ridden out on a bounded schedule.
//!
//! A call knows whom it asked (the connection and its address travel together), so a standby's
//! answer is never taken for the leader's. During an outage the client tries every address
//! once a round, a leader named by a standby first ([`Round`]), each dial bounded by
//! [`DIAL_BOUND`], and pauses between rounds: a standby that still names a dead leader (its etcd
//! lease has not run out) costs one attempt a round, never a loop. The outage's start and end
//! are logged once for all the calls that share the link, and once more if it outlasts the
//! job's lease.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use edl_shared::leader::{Coordinators, Round};
use edl_shared::proto::frame::Frame;
use edl_shared::proto::{ErrorCode, Request, Response};
use edl_shared::transport::{CallError, Conn, Dialer, TransportSettings};

use crate::{Busy, ClientError, Outage, Server};

/// How often a client asks again while the job's coordinators elect a leader (a standby polls
/// the leader key four times a second).
pub(crate) const ELECTION_POLL: Duration = Duration::from_millis(200);

/// The idle timeout of a client's connections when it has several coordinators: how long a
/// dead leader's connection keeps a call waiting before the client moves on.
pub(crate) const FAILOVER_IDLE: Duration = Duration::from_secs(2);

/// How long a client with several coordinators gives one to answer a new connection: a live
/// process answers a handshake within milliseconds, and a dead address would otherwise keep
/// the round waiting for the whole handshake timeout.
pub(crate) const DIAL_BOUND: Duration = Duration::from_millis(500);

/// What a client needs to reconnect.
#[derive(Debug)]
pub(crate) struct Net {
    pub(crate) dialer: Dialer,
    pub(crate) settings: TransportSettings,
    pub(crate) name: String,
}

/// The connection to the coordinator, replaced when the coordinator restarts or another one
/// of the job's coordinators takes the lead.
#[derive(Clone, Debug)]
pub(crate) struct CoordLink {
    /// The job's coordinators (`--coordinator A,B,C`), the one in use among them.
    addrs: Arc<Mutex<Coordinators>>,
    /// The connection in use and the address it goes to; none while the next call must dial.
    link: Arc<Mutex<Option<Linked>>>,
    pub(crate) net: Arc<Net>,
    /// Numbers the connections made, so a failed one is dropped only if still in use.
    made: Arc<AtomicU64>,
    /// The outage every call sharing this link is in, if any: logged once for all of them.
    outage: Arc<Mutex<Option<tokio::time::Instant>>>,
    /// The job's lease, once known: an outage that outlasts it is logged (the coordinator may
    /// count this worker dead).
    lease: Arc<OnceLock<Duration>>,
}

/// A connection and the address it goes to.
#[derive(Clone, Debug)]
struct Linked {
    at: String,
    conn: Conn,
    id: u64,
}

impl CoordLink {
    /// A link over `conn`, a connection to `addrs`' current address.
    pub(crate) fn new(addrs: Coordinators, conn: Conn, net: Net) -> CoordLink {
        let at = addrs.current().to_string();
        CoordLink {
            addrs: Arc::new(Mutex::new(addrs)),
            link: Arc::new(Mutex::new(Some(Linked { at, conn, id: 0 }))),
            net: Arc::new(net),
            made: Arc::new(AtomicU64::new(1)),
            outage: Arc::new(Mutex::new(None)),
            lease: Arc::new(OnceLock::new()),
        }
    }

    /// Tells the link the job's lease (once known).
    pub(crate) fn set_lease(&self, lease: Duration) {
        let _ = self.lease.set(lease);
    }

    /// The addresses, as log lines name them.
    pub(crate) fn addrs(&self) -> String {
        self.addrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .to_string()
    }

    fn several(&self) -> bool {
        self.addrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .all()
            .len()
            > 1
    }

    /// Calls the coordinator; a failed connection is replaced and the call repeated for as
    /// long as the transport settings' `reconnect` allows (by default until a coordinator
    /// leads and answers). With several coordinators, each round of an outage tries every
    /// address once, a leader a standby named first, and pauses between rounds (see the
    /// module's docs). Every coordinator request can be repeated: a repeated clock report or
    /// leave is recognized, a partition leased twice returns to the pool when the worker
    /// leaves, and a standby does nothing with a request.
    pub(crate) async fn call(
        &self,
        req: Request,
        payload: Bytes,
    ) -> Result<Frame<Response>, CallError> {
        let addrs = self.addrs();
        let what = Server::Coordinator(&addrs);
        let mut outage = Outage::new(what, self.net.settings.reconnect).shared(&self.outage);
        let mut busy = Busy::default();
        let mut round = Round::default();
        // The address this call moved to, to be dialled unless the link goes there already.
        let mut next: Option<String> = None;
        loop {
            let linked = match self.linked(next.as_deref()) {
                Some(l) => l,
                None => {
                    let at = next.take().unwrap_or_else(|| self.current());
                    match self.dial(&at).await {
                        Ok(l) => l,
                        Err(e) => {
                            next = self.failed(&mut outage, &mut round, e, &at, None).await?;
                            continue;
                        }
                    }
                }
            };
            next = None;
            let err = match linked.conn.call(req.clone(), payload.clone()).await {
                Err(e) if e.code() == Some(ErrorCode::Busy) => {
                    busy.pause(what, &e).await;
                    continue;
                }
                Err(e) if e.connection_failed() => e,
                Err(e @ CallError::NotLeader { .. }) => e,
                other => {
                    outage.over();
                    return other;
                }
            };
            let named = match &err {
                CallError::NotLeader { leader: Some(l) } => Some(l.clone()),
                _ => None,
            };
            if named.as_deref() == Some(linked.at.as_str()) {
                // The one asked names itself: elected, and restoring its state. Asked again
                // on the same connection once it had time to.
                outage.record(err)?;
                self.outlasts_lease(&mut outage);
                outage.pause(Some(ELECTION_POLL)).await;
                continue;
            }
            self.unlink(&linked);
            next = self
                .failed(&mut outage, &mut round, err, &linked.at, named.as_deref())
                .await?;
        }
    }

    /// The connection in use, if it goes to `to` (or anywhere, with no `to`).
    fn linked(&self, to: Option<&str>) -> Option<Linked> {
        let link = self.link.lock().unwrap_or_else(|p| p.into_inner());
        link.as_ref()
            .filter(|l| to.is_none_or(|t| l.at == t))
            .cloned()
    }

    /// Drops `linked` if it is still the connection in use.
    fn unlink(&self, linked: &Linked) {
        let mut link = self.link.lock().unwrap_or_else(|p| p.into_inner());
        if link.as_ref().is_some_and(|l| l.id == linked.id) {
            *link = None;
        }
    }

    /// A heartbeat got no answer within `bound`: the connection in use may be dead, though
    /// its idle timeout has not run out. Starts the outage every call sharing the link is in
    /// (logged, if no call logged it yet) and closes the connection: the calls waiting on it
    /// fail at once and are repeated on a new one (every coordinator request can be), and the
    /// next call dials again.
    pub(crate) fn missed(&self, bound: Duration) {
        {
            let mut start = self.outage.lock().unwrap_or_else(|p| p.into_inner());
            if start.is_none() {
                *start = Some(tokio::time::Instant::now());
                tracing::warn!(
                    "the coordinator at {} did not answer a heartbeat within {bound:?}; \
                     dialling again until it answers",
                    self.addrs()
                );
            }
        }
        let dropped = self.link.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(linked) = dropped {
            linked.conn.close();
        }
    }

    /// Dials `at` (within [`DIAL_BOUND`] where there are other addresses to try) and makes it
    /// the connection in use.
    async fn dial(&self, at: &str) -> Result<Linked, CallError> {
        let net = &self.net;
        let conn = dial_within(&net.dialer, at, &net.name, &net.settings, self.several()).await?;
        let linked = Linked {
            at: at.to_string(),
            conn,
            id: self.made.fetch_add(1, Ordering::Relaxed),
        };
        *self.link.lock().unwrap_or_else(|p| p.into_inner()) = Some(linked.clone());
        Ok(linked)
    }

    /// An attempt at `at` failed (`named`: the leader its answer named): records it (the
    /// error is given back at the outage's limit) and returns the address to try next, after
    /// a pause if the round is over.
    async fn failed(
        &self,
        outage: &mut Outage<'_>,
        round: &mut Round,
        err: CallError,
        at: &str,
        named: Option<&str>,
    ) -> Result<Option<String>, CallError> {
        let election = matches!(err, CallError::NotLeader { .. });
        // A standby that names a leader not yet tried is a redirect, not an outage (every
        // round ends, so redirects alone cannot loop).
        match named.filter(|l| *l != at && !round.tried(l)) {
            Some(leader) => {
                tracing::info!(%leader, "the coordinator at {at} stands by: following the leader")
            }
            None => {
                outage.record(err)?;
                self.outlasts_lease(outage);
            }
        }
        let next = {
            let mut addrs = self.addrs.lock().unwrap_or_else(|p| p.into_inner());
            addrs.next_in(round, at, named).map(str::to_string)
        };
        match next {
            Some(next) => {
                tracing::debug!(from = at, to = %next, "trying the next coordinator");
                Ok(Some(next))
            }
            None => {
                // Every address failed this round: while coordinators elect a leader, ask
                // again as often as a standby looks; else back off.
                outage.pause(election.then_some(ELECTION_POLL)).await;
                Ok(Some(self.current()))
            }
        }
    }

    /// The address in use.
    fn current(&self) -> String {
        let addrs = self.addrs.lock().unwrap_or_else(|p| p.into_inner());
        addrs.current().to_string()
    }

    /// Logs, once per outage, that it has lasted longer than the job's lease.
    fn outlasts_lease(&self, outage: &mut Outage<'_>) {
        if let Some(&lease) = self.lease.get() {
            outage.warn_past(
                lease,
                "longer than the job's lease: a coordinator that leads may count this worker \
                 dead; still trying",
            );
        }
    }
}

/// Dials `at`; with `several` coordinators to try, within [`DIAL_BOUND`] (a timeout then, as
/// the handshake's own would be).
async fn dial_within(
    dialer: &Dialer,
    at: &str,
    name: &str,
    settings: &TransportSettings,
    several: bool,
) -> Result<Conn, CallError> {
    let dial = Conn::dial(dialer, at, name, settings);
    if !several {
        return dial.await;
    }
    tokio::time::timeout(DIAL_BOUND, dial)
        .await
        .unwrap_or(Err(CallError::Connection(quinn::ConnectionError::TimedOut)))
}

/// Connects to one of the job's coordinators, trying each address in turn while none
/// answers (which leads is settled by the first call: a standby names the leader).
pub(crate) async fn connect_any(
    dialer: &Dialer,
    addrs: &mut Coordinators,
    name: &str,
    settings: &TransportSettings,
) -> Result<Conn, ClientError> {
    let list = addrs.to_string();
    let mut outage = Outage::new(Server::Coordinator(&list), settings.reconnect);
    let several = addrs.all().len() > 1;
    loop {
        let mut last = None;
        for _ in 0..addrs.all().len() {
            match dial_within(dialer, addrs.current(), name, settings, several).await {
                Ok(c) => {
                    outage.over();
                    return Ok(c);
                }
                // A coordinator that does not answer may be starting up, or down: try the
                // others, then again. Anything else (a refused certificate, a wrong version)
                // is final.
                Err(e @ CallError::Connection(quinn::ConnectionError::TimedOut)) => {
                    last = Some(e);
                    addrs.advance();
                }
                Err(e) => {
                    return Err(crate::unreachable(vec![addrs.current().to_string()], e).into());
                }
            }
        }
        if let Some(e) = last {
            outage
                .failed(e)
                .await
                .map_err(|e| crate::unreachable(addrs.all().to_vec(), e))?;
        }
    }
}
