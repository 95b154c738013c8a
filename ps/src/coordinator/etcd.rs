//! A job's coordinator state in etcd (`edl-ps coordinator --meta etcd://H1:2379,H2:2379`), and
//! the election of one leader among the job's coordinators.
//!
//! Keys, under `/edl/JOB/coordinator/`:
//! - `leader`: the leading coordinator's advertised address, attached to its etcd lease. It
//!   is created only where absent (a transaction comparing its create revision with 0), so
//!   one coordinator holds it at a time; it vanishes when its holder's lease expires (the
//!   holder died or lost etcd for a whole TTL) and the standbys, which poll it, campaign.
//! - `state`: the durable state, one record (see [`super::meta`]). Every write is a
//!   transaction conditional on `leader`'s create revision being the writer's *term* (the
//!   revision at which it took the key): a deposed leader's write fails, and it exits
//!   without answering the request that depended on it ([`StoreError::Fenced`]).
//!
//! A new leader reads `state` after it holds `leader`; etcd is linearizable, so it sees every
//! write its predecessor made while it led, which are the only ones that were acknowledged.

use std::sync::Arc;
use std::time::Duration;

use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::BoxFuture;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
};
use tokio::sync::watch;
use tracing::{info, warn};

use super::meta::{MetaStore, StoreError};

/// How long one etcd request may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// How often a standby looks whether the leader's key is gone, at most.
const POLL: Duration = Duration::from_millis(250);

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
    client: Client,
    prefix: String,
    endpoints: Vec<String>,
}

/// A won election: the lease that keeps the leader's key, and the term it was won at.
pub struct Leadership {
    /// The revision at which this coordinator took the leader key: its term.
    pub term: i64,
    /// Cancelled once the lease may have expired (etcd said so, or no keep-alive got through
    /// for a whole TTL): another coordinator may lead by now.
    pub lost: CancellationToken,
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
        let options = ConnectOptions::new()
            .with_connect_timeout(REQUEST_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT)
            .with_keep_alive(Duration::from_secs(1), REQUEST_TIMEOUT)
            .with_require_leader(true);
        let client = Client::connect(endpoints.clone(), Some(options))
            .await
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

    /// Who leads now (the leader key's value), if anyone.
    pub async fn leader(&self) -> Result<Option<String>, etcd_client::Error> {
        let resp = self.client.clone().get(self.leader_key(), None).await?;
        Ok(resp
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
    }

    /// Campaigns until this component (advertised as `me`) leads, with a lease of `ttl`;
    /// meanwhile `standby` says who leads. `None` if `stop` came first.
    pub async fn campaign(
        &self,
        me: &str,
        ttl: Duration,
        standby: &watch::Sender<Option<String>>,
        stop: &CancellationToken,
    ) -> Option<Leadership> {
        let mut failing = false;
        loop {
            match self.try_lead(me, ttl).await {
                Ok(Ok(won)) => return Some(won),
                // The key names this address: a process here before this one (killed, its
                // lease not run out yet). No one leads until it expires.
                Ok(Err(leader)) if leader == me => {
                    if standby.borrow().is_some() {
                        standby.send_replace(None);
                    }
                    failing = false;
                }
                Ok(Err(leader)) => {
                    if standby.borrow().as_deref() != Some(leader.as_str()) {
                        info!(%leader, "standing by: another coordinator leads");
                        standby.send_replace(Some(leader));
                    }
                    failing = false;
                }
                Err(e) => {
                    if !failing {
                        warn!(etcd = %self.endpoints.join(","), "cannot campaign: {e}; trying again");
                    }
                    failing = true;
                    standby.send_replace(None);
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = tokio::time::sleep(POLL.min(ttl / 4)) => {}
            }
        }
    }

    /// One attempt: takes the leader key if it is free; else says who holds it.
    async fn try_lead(
        &self,
        me: &str,
        ttl: Duration,
    ) -> Result<Result<Leadership, String>, etcd_client::Error> {
        if let Some(leader) = self.leader().await? {
            return Ok(Err(leader));
        }
        let mut client = self.client.clone();
        let ttl_s = ttl.as_secs().max(1) as i64;
        let lease = client.lease_grant(ttl_s, None).await?.id();
        let key = self.leader_key();
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                me,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key, None)]);
        let resp = client.txn(txn).await?;
        if !resp.succeeded() {
            // Lost the race; the lease is no use.
            let _ = client.lease_revoke(lease).await;
            let holder = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => g
                    .kvs()
                    .first()
                    .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
                _ => None,
            });
            return Ok(Err(holder.unwrap_or_default()));
        }
        let term = resp.header().map_or(0, |h| h.revision());
        let (lost, resigned) = (CancellationToken::new(), CancellationToken::new());
        tokio::spawn(keep_alive(
            client,
            lease,
            ttl,
            lost.clone(),
            resigned.clone(),
        ));
        Ok(Ok(Leadership {
            term,
            lost,
            lease,
            resigned,
        }))
    }

    /// The state record, if one was written.
    pub async fn load(&self) -> Result<Option<Vec<u8>>, etcd_client::Error> {
        let resp = self.client.clone().get(self.state_key(), None).await?;
        Ok(resp.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// The store a leader of `term` writes the state to.
    pub fn store(&self, leadership: &Leadership) -> EtcdStore {
        EtcdStore {
            meta: self.clone(),
            term: leadership.term,
        }
    }

    /// Gives the lead up (at shutdown): the leader key goes at once, not after a TTL.
    pub async fn resign(&self, leadership: &Leadership) {
        leadership.resigned.cancel();
        let _ = self.client.clone().lease_revoke(leadership.lease).await;
    }
}

/// Keeps the leader's lease alive, a third of its TTL apart; cancels `lost` once it may have
/// expired: etcd answered that it has, or nothing got through for a whole TTL.
async fn keep_alive(
    mut client: Client,
    lease: i64,
    ttl: Duration,
    lost: CancellationToken,
    resigned: CancellationToken,
) {
    let mut last_ok = tokio::time::Instant::now();
    let mut stream = None;
    loop {
        if resigned.is_cancelled() {
            return;
        }
        if last_ok.elapsed() >= ttl {
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
        if let Some((keeper, answers)) = stream.as_mut() {
            let beat = async {
                keeper.keep_alive().await?;
                answers.message().await
            };
            match tokio::time::timeout(REQUEST_TIMEOUT, beat).await {
                Ok(Ok(Some(resp))) if resp.ttl() > 0 => last_ok = tokio::time::Instant::now(),
                Ok(Ok(Some(_))) if resigned.is_cancelled() => return,
                Ok(Ok(Some(_))) => {
                    warn!("etcd says the leader's lease expired: stepping down");
                    lost.cancel();
                    return;
                }
                _ => stream = None,
            }
        }
        tokio::select! {
            _ = resigned.cancelled() => return,
            _ = tokio::time::sleep(ttl / 3) => {}
        }
    }
}

/// The state of a job's coordinator in etcd, written by the leader of one term.
pub struct EtcdStore {
    meta: EtcdMeta,
    term: i64,
}

impl MetaStore for EtcdStore {
    fn write(&self, record: Arc<[u8]>) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let leader = self.meta.leader_key();
            let txn = Txn::new()
                .when([Compare::create_revision(
                    leader.clone(),
                    CompareOp::Equal,
                    self.term,
                )])
                .and_then([TxnOp::put(self.meta.state_key(), record.to_vec(), None)])
                .or_else([TxnOp::get(leader, None)]);
            let resp = self
                .meta
                .client
                .clone()
                .txn(txn)
                .await
                .map_err(|e| StoreError::Unavailable(format!("etcd: {e}")))?;
            if resp.succeeded() {
                return Ok(());
            }
            let holder = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| {
                    format!(
                        "{} leads since revision {}",
                        String::from_utf8_lossy(kv.value()),
                        kv.create_revision()
                    )
                }),
                _ => None,
            });
            Err(StoreError::Fenced(format!(
                "the lead won at revision {} is lost ({})",
                self.term,
                holder.unwrap_or_else(|| "no one leads".into())
            )))
        })
    }

    fn term(&self) -> u64 {
        u64::try_from(self.term).unwrap_or(0)
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
