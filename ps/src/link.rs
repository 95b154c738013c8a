//! How servers reach shard servers: the coordinator (maps, moves, probes) and a shard handing a
//! key range to another. [`ShardLink`] is the seam: [`ShardCaller`] speaks QUIC; the
//! deterministic simulation (`edl-dst`) passes messages instead.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use edl_shared::Identity;
use edl_shared::proto::{Parts, Request, Response};
use edl_shared::transport::{CallError, Conn, TransportSettings, client_endpoint};

/// A boxed future, as [`ShardLink`]'s methods return.
pub type LinkFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// How a server reaches shard servers: [`ShardCaller`] (QUIC) in production; the
/// deterministic simulation passes messages instead.
pub trait ShardLink: Send + Sync + 'static {
    /// Whether a shard server answers at `addr` (within a few seconds).
    fn answers<'a>(&'a self, addr: &'a str) -> LinkFuture<'a, bool>;

    /// One request to the shard at `addr`, its payload sent as the parts it lies in.
    fn call<'a>(
        &'a self,
        addr: &'a str,
        req: Request,
        payload: Parts,
    ) -> LinkFuture<'a, Result<Response, CallError>>;
}

impl ShardLink for ShardCaller {
    fn answers<'a>(&'a self, addr: &'a str) -> LinkFuture<'a, bool> {
        Box::pin(ShardCaller::answers(self, addr))
    }

    fn call<'a>(
        &'a self,
        addr: &'a str,
        req: Request,
        payload: Parts,
    ) -> LinkFuture<'a, Result<Response, CallError>> {
        Box::pin(ShardCaller::call(self, addr, req, payload))
    }
}

/// Connections to shards, as a client with the caller's own certificate (its role is the
/// caller's: the coordinator's, or a shard's for a hand-off).
pub struct ShardCaller {
    endpoint: quinn::Endpoint,
    settings: TransportSettings,
    name: String,
    conns: tokio::sync::Mutex<HashMap<String, Conn>>,
}

/// How long a caller waits for one shard request (a resharding's, a hand-off's).
const SHARD_CALL: Duration = Duration::from_secs(60);
/// How long a caller waits for a shard to answer whether it is still there.
const PROBE: Duration = Duration::from_secs(3);

impl ShardCaller {
    /// A caller with `identity`.
    pub fn new(identity: &Identity, settings: &TransportSettings) -> Result<Self, CallError> {
        Ok(ShardCaller {
            endpoint: client_endpoint(identity, settings, false)?,
            settings: settings.clone(),
            name: identity.name.clone(),
            conns: tokio::sync::Mutex::new(HashMap::new()),
        })
    }

    /// Whether a shard server answers at `addr` (within a few seconds).
    pub async fn answers(&self, addr: &str) -> bool {
        let probe = async {
            let conn = Conn::connect(&self.endpoint, addr, &self.name, &self.settings).await?;
            let r = conn.call(Request::GetMap, Bytes::new()).await;
            conn.close();
            r
        };
        match tokio::time::timeout(PROBE, probe).await {
            Ok(Ok(_)) => true,
            // An answer, even an error (a shard not assigned yet), means a server is there.
            Ok(Err(CallError::Remote { .. })) => true,
            _ => false,
        }
    }

    /// One request to the shard at `addr`, on a cached connection (replaced once if it failed).
    pub async fn call(
        &self,
        addr: &str,
        req: Request,
        payload: Parts,
    ) -> Result<Response, CallError> {
        for attempt in 0..2 {
            // The cache is not held while connecting: a shard that does not answer must not
            // hold up calls to the others.
            let cached = match self.conns.lock().await.get(addr) {
                Some(c) if attempt == 0 => Some(c.clone()),
                _ => None,
            };
            let conn = match cached {
                Some(c) => c,
                None => {
                    let c = Conn::connect(&self.endpoint, addr, &self.name, &self.settings).await?;
                    self.conns.lock().await.insert(addr.to_string(), c.clone());
                    c
                }
            };
            let call = conn.call(req.clone(), payload.clone());
            match tokio::time::timeout(SHARD_CALL, call).await {
                Ok(Ok(f)) => return Ok(f.msg),
                Ok(Err(e @ CallError::Remote { .. })) => return Err(e),
                Ok(Err(e)) if attempt == 1 => return Err(e),
                Ok(Err(_)) => continue,
                Err(_) => {
                    return Err(CallError::TimedOut(format!(
                        "{addr} did not answer {} within {SHARD_CALL:?}",
                        req.name()
                    )));
                }
            }
        }
        Err(CallError::Address(format!("{addr} is unreachable")))
    }
}
