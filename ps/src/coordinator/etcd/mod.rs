//! A job's coordinator state in etcd (`edl-ps coordinator --meta etcd://H1:2379,H2:2379`), and
//! the election of one leader among the job's coordinators.
//!
//! Keys, under `/edl/JOB/coordinator/`:
//! - `leader`: the leading coordinator's advertised address, attached to its etcd lease. It
//!   is created only where absent (a transaction comparing its create revision with 0), so
//!   one coordinator holds it at a time; it vanishes when its holder's lease expires (the
//!   holder died or lost etcd for a whole TTL) and the standbys, which poll it, campaign.
//! - `term`: the number of elections won, raised by one in the transaction that takes
//!   `leader` (conditional on it being unchanged since it was read), so terms count elections
//!   and nothing else: a campaign that loses, a revoked lease or a state write moves no term.
//! - `state`: the durable state, one record (see [`super::meta`]). Every write is a
//!   transaction conditional on `leader`'s create revision being the one at which the writer
//!   took the key (its *fence*): a deposed leader's write fails, and it exits without
//!   answering the request that depended on it ([`StoreError::Fenced`]).
//!
//! A new leader reads `state` after it holds `leader`; etcd is linearizable, so it sees every
//! write its predecessor made while it led, which are the only ones that were acknowledged.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use edl_shared::Identity;
use edl_shared::proto::Request;
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::{BoxFuture, CallError, Conn, TransportSettings, client_endpoint};
use tokio::sync::watch;
use tracing::{info, warn};

use super::meta::{MetaStore, StoreError};

#[allow(clippy::all, clippy::pedantic, missing_docs)]
mod etcdserverpb;
mod rpc;

pub use rpc::Error;
use rpc::{Etcd, RequestOp};

/// How long one etcd request may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// How often a standby looks whether the leader's key is gone, at most.
const POLL: Duration = Duration::from_millis(250);

/// The flags of a component that may keep its state in etcd and stand by for another
/// (`edl-ps coordinator`, `edl-sched`).
#[derive(Clone, Debug, clap::Args)]
pub struct ElectionArgs {
    /// Keep the state in etcd (etcd://HOST:PORT[,HOST:PORT...], every member with its client
    /// port) instead of STATE_DIR. Several processes may run with the same --meta: one leads
    /// (through an etcd lease), the others stand by, tell clients where the leader is, and one
    /// of them takes over when it dies. Give clients every address (A,B).
    #[arg(long, value_name = "URL")]
    pub meta: Option<String>,
    /// With --meta: the address clients and the others reach this one at (default: --listen,
    /// which must then be a specific address).
    #[arg(long, value_name = "ADDR", requires = "meta")]
    pub advertise: Option<String>,
    /// With --meta: the leader's etcd lease. A coordinator rides out an etcd outage shorter
    /// than this (it acknowledges training reports from memory while its lease surely holds;
    /// control operations wait); a leader cut off from etcd this long steps down (and exits),
    /// and one that died is replaced after this long where no standby could tell it died
    /// (see --leader-dead-after).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration, requires = "meta")]
    pub leader_ttl: Duration,
    /// With --meta: a standby takes a leader that does not answer it as the leader for this
    /// long for dead, revokes its lease and campaigns. Shorter fails over sooner; a live
    /// leader that stops answering this long (a long pause, a cut link between the two) is
    /// replaced: safely (it is fenced off), but at the cost of a failover.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration, requires = "meta")]
    pub leader_dead_after: Duration,
}

impl ElectionArgs {
    /// With --meta, the election these flags ask for, advertised as `advertise` (--advertise
    /// if given, else what `default` says).
    pub fn elected(
        &self,
        default: impl FnOnce() -> anyhow::Result<String>,
    ) -> anyhow::Result<Option<super::ElectedConfig>> {
        let Some(url) = &self.meta else {
            return Ok(None);
        };
        Ok(Some(super::ElectedConfig {
            endpoints: parse_url(url).map_err(anyhow::Error::msg)?,
            advertise: match &self.advertise {
                Some(a) => a.clone(),
                None => default()?,
            },
            ttl: self.leader_ttl,
            dead_after: self.leader_dead_after,
        }))
    }
}

/// `etcd://H1:2379,H2:2379` as etcd endpoints (`http://H1:2379`, ...).
pub fn parse_url(url: &str) -> Result<Vec<String>, String> {
    let rest = url.strip_prefix("etcd://").ok_or_else(|| {
        format!("{url:?} is not an etcd URL: expected etcd://HOST:PORT[,HOST:PORT...]")
    })?;
    let endpoints: Vec<String> = rest
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| format!("http://{e}"))
        .collect();
    if endpoints.is_empty() || rest.split(',').any(|e| !e.trim().contains(':')) {
        return Err(format!(
            "{url:?}: expected etcd://HOST:PORT[,HOST:PORT...] (every member with its client port)"
        ));
    }
    Ok(endpoints)
}

/// A connection to the etcd cluster that keeps one component's state (`/edl/JOB/NAME/`).
#[derive(Clone)]
pub struct EtcdMeta {
    client: Etcd,
    prefix: String,
    endpoints: Vec<String>,
}

/// A won election: the lease that keeps the leader's key, and the term it was won at.
pub struct Leadership {
    /// The election's number: one more than the last term won (`term` key).
    pub term: u64,
    /// The revision at which this coordinator took the leader key: its writes are
    /// conditional on the key's create revision being this one.
    fence: i64,
    /// Cancelled once the lease may have expired (etcd said so, or no keep-alive got through
    /// for a whole TTL): another coordinator may lead by now.
    pub lost: CancellationToken,
    /// Until when the lease surely holds: a TTL from the sending of the last keep-alive etcd
    /// answered (etcd extends the lease from when it receives it, later).
    held: Arc<std::sync::Mutex<tokio::time::Instant>>,
    lease: i64,
    /// Cancelled when the lead is given up: the keep-alive stops quietly.
    resigned: CancellationToken,
}

impl EtcdMeta {
    /// Connects to the etcd members `endpoints` for the state under `/edl/JOB/COMPONENT/`.
    /// Connecting is lazy: an unreachable etcd shows in the first request.
    pub async fn connect(
        endpoints: Vec<String>,
        job: &str,
        component: &str,
    ) -> anyhow::Result<Self> {
        let client = Etcd::connect(&endpoints, REQUEST_TIMEOUT)
            .map_err(|e| anyhow::anyhow!("etcd at {}: {e}", endpoints.join(",")))?;
        Ok(EtcdMeta {
            client,
            prefix: format!("/edl/{job}/{component}"),
            endpoints,
        })
    }

    fn leader_key(&self) -> String {
        format!("{}/leader", self.prefix)
    }

    fn state_key(&self) -> String {
        format!("{}/state", self.prefix)
    }

    fn term_key(&self) -> String {
        format!("{}/term", self.prefix)
    }

    /// The last term won (0 if none was), and the term key's mod revision (0 if absent). A
    /// value that is not a number is an error, not term 0: terms must never go back (shards
    /// refuse the orders of a term lower than one they saw).
    async fn last_term(&self) -> Result<(u64, i64), Error> {
        let Some(kv) = self.client.get(self.term_key()).await? else {
            return Ok((0, 0));
        };
        let value = String::from_utf8_lossy(&kv.value);
        let term = value.parse().map_err(|_| {
            Error::Invalid(format!(
                "{} holds {value:?}, not a term number",
                self.term_key()
            ))
        })?;
        Ok((term, kv.mod_revision))
    }

    /// Who leads now (the leader key's value), if anyone.
    pub async fn leader(&self) -> Result<Option<String>, Error> {
        Ok(self.holder().await?.map(|(leader, _)| leader))
    }

    /// Who leads now, and the lease that keeps the key.
    async fn holder(&self) -> Result<Option<(String, i64)>, Error> {
        Ok(self.client.get(self.leader_key()).await?.map(holder_of))
    }

    /// Campaigns until this component (advertised as `me`) leads, with a lease of `ttl`;
    /// meanwhile `standby` says who leads. `None` if `stop` came first. A leader that does not
    /// answer `prober` as the leader for its `dead_after` has its lease revoked (the key goes
    /// at once, and the campaign goes on), rather than waited out.
    async fn campaign(
        &self,
        me: &str,
        ttl: Duration,
        standby: &watch::Sender<Option<String>>,
        stop: &CancellationToken,
        prober: &Prober,
    ) -> Option<Leadership> {
        let mut failing = false;
        // The leader that stopped answering, its lease, and since when.
        let mut silent: Option<(String, i64, tokio::time::Instant)> = None;
        // The leader the key named last, and its lease.
        let mut seen: Option<(String, i64)> = None;
        loop {
            match self.try_lead(me, ttl).await {
                Ok(Ok(won)) => return Some(won),
                // Lost a race to a term that is over already: campaign again at once.
                Ok(Err((leader, _))) if leader.is_empty() => {}
                // The key names this address: a process here before this one (killed, its
                // lease not run out yet). No one leads until it expires, or is revoked.
                Ok(Err((leader, lease))) if leader == me => {
                    if standby.borrow().is_some() {
                        standby.send_replace(None);
                    }
                    failing = false;
                    self.revoke_dead(&leader, lease, "this address's last process")
                        .await;
                }
                Ok(Err((leader, lease))) => {
                    seen = Some((leader.clone(), lease));
                    if standby.borrow().as_deref() != Some(leader.as_str()) {
                        info!(%leader, "standing by: another coordinator leads");
                        standby.send_replace(Some(leader.clone()));
                    }
                    failing = false;
                    if prober.leads(&leader).await {
                        silent = None;
                    } else {
                        let since = match &silent {
                            Some((l, s, at)) if *l == leader && *s == lease => *at,
                            _ => tokio::time::Instant::now(),
                        };
                        silent = Some((leader.clone(), lease, since));
                        if since.elapsed() >= prober.dead_after {
                            self.revoke_dead(&leader, lease, "does not answer as the leader")
                                .await;
                            silent = None;
                        }
                    }
                }
                Err(e) => {
                    if !failing {
                        warn!(etcd = %self.endpoints.join(","), "cannot campaign: {e}; trying again");
                    }
                    failing = true;
                    standby.send_replace(None);
                    // The leader last seen is asked all the same: it learns that a standby
                    // sees it (and so that its lease will not be revoked), which lets it go
                    // on acknowledging training from memory while etcd is out for both.
                    if let Some((leader, lease)) = &seen {
                        if prober.leads(leader).await {
                            silent = None;
                        } else if silent.is_none() {
                            silent = Some((leader.clone(), *lease, tokio::time::Instant::now()));
                        }
                    }
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = tokio::time::sleep(POLL.min(ttl / 4)) => {}
            }
        }
    }

    /// A candidate's way to the lead (`me`, advertised so; `standby` names the leader
    /// meanwhile): campaigns, then names itself (a standby probing it, and a client, find it
    /// leading while it starts) and `start`s with the lead and the state record etcd holds.
    /// `None` if `stop` came first; an error (the lead given up) if the record cannot be read
    /// or `start` fails.
    pub async fn lead<T>(
        &self,
        me: &str,
        ttl: Duration,
        prober: &Prober,
        standby: &watch::Sender<Option<String>>,
        stop: &CancellationToken,
        start: impl AsyncFnOnce(&Leadership, Option<Vec<u8>>) -> anyhow::Result<T>,
    ) -> anyhow::Result<Option<(Leadership, T)>> {
        let Some(lead) = self.campaign(me, ttl, standby, stop, prober).await else {
            return Ok(None);
        };
        standby.send_replace(Some(me.to_string()));
        let started = match self.load().await {
            Ok(record) => start(&lead, record).await,
            Err(e) => Err(anyhow::anyhow!("etcd: {e}")),
        };
        match started {
            Ok(t) => Ok(Some((lead, t))),
            Err(e) => {
                self.resign(&lead).await;
                Err(e.context("taking the lead"))
            }
        }
    }

    /// Revokes the lease of a leader found dead: its key goes at once.
    async fn revoke_dead(&self, leader: &str, lease: i64, why: &str) {
        match self.client.lease_revoke(lease).await {
            Ok(_) => warn!(%leader, "the leader {why}: revoked its lease; campaigning"),
            Err(e) => warn!(%leader, "the leader {why}, and revoking its lease failed: {e}"),
        }
    }

    /// One attempt: takes the leader key if it is free; else says who holds it, and its lease.
    async fn try_lead(
        &self,
        me: &str,
        ttl: Duration,
    ) -> Result<Result<Leadership, (String, i64)>, Error> {
        // Who holds the key is read within a poll's time: a standby whose etcd does not answer
        // goes on probing the leader, which needs to hear from it (see `Prober`). (Taking the
        // key, below, is never cut short: a key taken unawares would stand for a whole TTL.)
        match tokio::time::timeout(POLL, self.holder()).await {
            Ok(Ok(Some(holder))) => return Ok(Err(holder)),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(Error::TimedOut(POLL));
            }
        }
        let (last, term_rev) = self.last_term().await?;
        let client = &self.client;
        let ttl_s = ttl.as_secs().max(1) as i64;
        let granted = tokio::time::Instant::now();
        let lease = client.lease_grant(ttl_s).await?;
        let key = self.leader_key();
        let term = last + 1;
        // The key is taken and the term raised together, only if no one took the key and no
        // one won a term since the term was read.
        let resp = client
            .txn(
                vec![
                    rpc::created_at(key.clone(), 0),
                    rpc::modified_at(self.term_key(), term_rev),
                ],
                vec![
                    rpc::put(key.clone(), me, lease),
                    rpc::put(self.term_key(), term.to_string(), 0),
                ],
                vec![rpc::get(key)],
            )
            .await?;
        if !resp.succeeded {
            // Lost the race; the lease is no use.
            let _ = client.lease_revoke(lease).await;
            let holder = rpc::first_read(&resp).cloned().map(holder_of);
            return Ok(Err(holder.unwrap_or_default()));
        }
        let fence = resp.header.map_or(0, |h| h.revision);
        let (lost, resigned) = (CancellationToken::new(), CancellationToken::new());
        // The lease was granted before the key was taken: it holds a TTL from then at least.
        let held = Arc::new(std::sync::Mutex::new(granted + ttl));
        tokio::spawn(keep_alive(
            client.clone(),
            lease,
            ttl,
            held.clone(),
            lost.clone(),
            resigned.clone(),
        ));
        Ok(Ok(Leadership {
            term,
            fence,
            lost,
            held,
            lease,
            resigned,
        }))
    }

    /// The state record, if one was written.
    pub async fn load(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(self.client.get(self.state_key()).await?.map(|kv| kv.value))
    }

    /// The store a leader of `term` writes the state to.
    pub fn store(&self, leadership: &Leadership) -> EtcdStore {
        EtcdStore {
            meta: self.clone(),
            term: leadership.term,
            fence: leadership.fence,
            held: leadership.held.clone(),
        }
    }

    /// Gives the lead up (at shutdown): the leader key goes at once, not after a TTL.
    pub async fn resign(&self, leadership: &Leadership) {
        leadership.resigned.cancel();
        let _ = self.client.lease_revoke(leadership.lease).await;
    }
}

/// Who a leader key names, and the lease that keeps it.
fn holder_of(kv: etcdserverpb::KeyValue) -> (String, i64) {
    (String::from_utf8_lossy(&kv.value).into_owned(), kv.lease)
}

/// Keeps the leader's lease alive, [`KEEP_ALIVE_EVERY`] (or a third of its TTL) apart, and
/// `held` up to date; cancels `lost` once the lease may have expired: etcd answered that it
/// has, or nothing got through for a whole TTL.
async fn keep_alive(
    client: Etcd,
    lease: i64,
    ttl: Duration,
    held: Arc<std::sync::Mutex<tokio::time::Instant>>,
    lost: CancellationToken,
    resigned: CancellationToken,
) {
    let until = || *held.lock().unwrap_or_else(|p| p.into_inner());
    let mut stream = None;
    loop {
        if resigned.is_cancelled() {
            return;
        }
        if tokio::time::Instant::now() >= until() {
            warn!(
                ttl_ms = ttl.as_millis() as u64,
                "no keep-alive of the leader's lease got through for a whole TTL: stepping down"
            );
            lost.cancel();
            return;
        }
        if stream.is_none() {
            stream = tokio::time::timeout(REQUEST_TIMEOUT, client.lease_keep_alive(lease))
                .await
                .ok()
                .and_then(Result::ok);
        }
        if let Some(keeper) = stream.as_mut() {
            match tokio::time::timeout(REQUEST_TIMEOUT, keeper.beat()).await {
                Ok(Ok(Some((sent, left)))) if left > 0 => {
                    let mut h = held.lock().unwrap_or_else(|p| p.into_inner());
                    *h = (*h).max(sent + ttl);
                }
                Ok(Ok(Some(_))) if resigned.is_cancelled() => return,
                Ok(Ok(Some(_))) => {
                    warn!("etcd says the leader's lease expired: stepping down");
                    lost.cancel();
                    return;
                }
                _ => stream = None,
            }
        }
        let next = (ttl / 3)
            .min(KEEP_ALIVE_EVERY)
            .min(until().saturating_duration_since(tokio::time::Instant::now()));
        tokio::select! {
            _ = resigned.cancelled() => return,
            _ = tokio::time::sleep(next) => {}
        }
    }
}

/// The longest time between two keep-alives of the leader's lease.
const KEEP_ALIVE_EVERY: Duration = Duration::from_secs(1);

/// How a standby finds the leader dead: it asks the leader the key names, over the cluster's
/// transport, whether it leads (a `GetJob`, which any server answers: a leader with the job or
/// an error, a standby with `NotLeader`). A leader that does not answer so for `dead_after`
/// (killed, stopped, cut off from the standby) has its lease revoked: failover within about
/// `dead_after` instead of the lease's TTL, which can then be long enough to ride out an etcd
/// outage.
pub struct Prober {
    endpoint: quinn::Endpoint,
    name: String,
    settings: TransportSettings,
    conn: tokio::sync::Mutex<Option<(String, Conn)>>,
    /// How long a leader may not answer before it counts as dead.
    pub dead_after: Duration,
}

/// How long one probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

impl Prober {
    /// A prober with the credentials of `identity`.
    pub fn new(
        identity: &Identity,
        settings: &TransportSettings,
        dead_after: Duration,
    ) -> anyhow::Result<Prober> {
        Ok(Prober {
            endpoint: client_endpoint(identity, settings, false)?,
            name: identity.name.clone(),
            settings: settings.clone(),
            conn: tokio::sync::Mutex::new(None),
            dead_after,
        })
    }

    /// True if the server at `addr` answers as the leader (or as one starting to lead, which
    /// names itself).
    pub async fn leads(&self, addr: &str) -> bool {
        let mut held = self.conn.lock().await;
        for fresh in [false, true] {
            if fresh || held.as_ref().is_none_or(|(a, _)| a != addr) {
                let dial = Conn::connect(&self.endpoint, addr, &self.name, &self.settings);
                match tokio::time::timeout(PROBE_TIMEOUT, dial).await {
                    Ok(Ok(c)) => *held = Some((addr.to_string(), c)),
                    _ => {
                        *held = None;
                        return false;
                    }
                }
            }
            let Some((_, conn)) = held.as_ref() else {
                return false;
            };
            let ask = conn.call(Request::GetJob, Bytes::new());
            match tokio::time::timeout(PROBE_TIMEOUT, ask).await {
                Ok(Err(CallError::NotLeader { leader })) => {
                    return leader.as_deref() == Some(addr);
                }
                Ok(Err(e)) if e.connection_failed() => *held = None,
                Ok(_) => return true,
                Err(_) => {
                    *held = None;
                    return false;
                }
            }
        }
        false
    }
}

/// The state of a job's coordinator in etcd, written by the leader of one term.
pub struct EtcdStore {
    meta: EtcdMeta,
    term: u64,
    /// The leader key's create revision while this term leads.
    fence: i64,
    held: Arc<std::sync::Mutex<tokio::time::Instant>>,
}

impl EtcdStore {
    /// Runs `ops` in a transaction conditional on this term still leading: `Fenced`
    /// (naming who leads now) if it does not, `Unavailable` if etcd does not answer in time.
    /// The client's own timeout covers a request once a member's connection has it, not the
    /// wait for one: bounded here too, so that a request that hangs counts as failing (and
    /// training reports go on from memory) instead of holding every answer.
    async fn as_leader(&self, ops: Vec<RequestOp>) -> Result<(), StoreError> {
        let leader = self.meta.leader_key();
        let txn = self.meta.client.txn(
            vec![rpc::created_at(leader.clone(), self.fence)],
            ops,
            vec![rpc::get(leader)],
        );
        let resp = tokio::time::timeout(2 * REQUEST_TIMEOUT, txn)
            .await
            .map_err(|_| {
                StoreError::Unavailable(format!(
                    "etcd: no answer within {} s",
                    (2 * REQUEST_TIMEOUT).as_secs()
                ))
            })?
            .map_err(|e| StoreError::Unavailable(format!("etcd: {e}")))?;
        if resp.succeeded {
            return Ok(());
        }
        let holder = rpc::first_read(&resp).map(|kv| {
            format!(
                "{} leads since revision {}",
                String::from_utf8_lossy(&kv.value),
                kv.create_revision
            )
        });
        Err(StoreError::Fenced(format!(
            "the lead of term {} (won at revision {}) is lost ({})",
            self.term,
            self.fence,
            holder.unwrap_or_else(|| "no one leads".into())
        )))
    }
}

impl MetaStore for EtcdStore {
    fn write(&self, record: Arc<[u8]>) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let put = rpc::put(self.meta.state_key(), record.to_vec(), 0);
            self.as_leader(vec![put]).await
        })
    }

    fn confirm(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(self.as_leader(Vec::new()))
    }

    fn term(&self) -> u64 {
        self.term
    }

    fn lease_until(&self) -> Option<tokio::time::Instant> {
        Some(*self.held.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn describe(&self) -> String {
        format!(
            "etcd {} ({})",
            self.meta.endpoints.join(","),
            self.meta.state_key()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_urls_name_every_member_with_its_port() {
        assert_eq!(
            parse_url("etcd://a:2379, b:2379").expect("url"),
            ["http://a:2379", "http://b:2379"]
        );
        assert!(
            parse_url("http://a:2379")
                .expect_err("refused")
                .contains("not an etcd URL")
        );
        assert!(
            parse_url("etcd://a")
                .expect_err("refused")
                .contains("HOST:PORT")
        );
        assert!(
            parse_url("etcd://")
                .expect_err("refused")
                .contains("HOST:PORT")
        );
    }
}
