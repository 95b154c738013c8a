//! The etcd v3 calls the coordinators make (a range read, a transaction, a lease's grant,
//! revoke and keep-alive), over gRPC with tonic, from code generated out of
//! `ps/proto/etcd.proto` and committed ([`super::etcdserverpb`]): building EDL needs no
//! `protoc`. The test below regenerates that code where `protoc` is installed and fails if it
//! differs from the committed file.
//!
//! Like etcd's own client, requests carry `hasleader: true`: a member that lost its cluster's
//! leader refuses them at once instead of waiting for an election; a channel balances over
//! every member given.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

pub use super::etcdserverpb::RequestOp;
use super::etcdserverpb::{
    Compare, KeyValue, LeaseGrantRequest, LeaseKeepAliveRequest, LeaseKeepAliveResponse,
    LeaseRevokeRequest, PutRequest, RangeRequest, TxnRequest, TxnResponse, compare,
    kv_client::KvClient, lease_client::LeaseClient, request_op, response_op,
};

/// A failed etcd call.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// etcd (or the channel to it) answered with an error status.
    #[error("{}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    /// An endpoint that is not a URI.
    #[error("{0}")]
    Endpoint(#[from] tonic::transport::Error),
    /// An answer that breaks what EDL keeps in etcd (a term that is not a number).
    #[error("{0}")]
    Invalid(String),
    /// No answer in time.
    #[error("no answer within {} ms", .0.as_millis())]
    TimedOut(Duration),
}

/// Asks every request to be refused by a member without a leader (`hasleader`).
#[derive(Clone, Copy)]
pub struct RequireLeader;

impl tonic::service::Interceptor for RequireLeader {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert(
            "hasleader",
            tonic::metadata::MetadataValue::from_static("true"),
        );
        Ok(req)
    }
}

type Svc = InterceptedService<Channel, RequireLeader>;

/// A client of one etcd cluster. Cloning is cheap (the channel is shared).
#[derive(Clone)]
pub struct Etcd {
    kv: KvClient<Svc>,
    lease: LeaseClient<Svc>,
}

impl Etcd {
    /// A client of the members at `endpoints` (`http://HOST:PORT`). Connecting is lazy: an
    /// unreachable cluster shows in the first request, which fails within `timeout` (a
    /// connection: within `timeout` too). HTTP/2 pings every second find a dead connection.
    pub fn connect(endpoints: &[String], timeout: Duration) -> Result<Etcd, Error> {
        let endpoints = endpoints
            .iter()
            .map(|e| {
                Ok(Endpoint::from_shared(e.clone())?
                    .connect_timeout(timeout)
                    .timeout(timeout)
                    .http2_keep_alive_interval(Duration::from_secs(1))
                    .keep_alive_timeout(timeout)
                    .keep_alive_while_idle(true))
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let channel = Channel::balance_list(endpoints.into_iter());
        Ok(Etcd {
            kv: KvClient::with_interceptor(channel.clone(), RequireLeader),
            lease: LeaseClient::with_interceptor(channel, RequireLeader),
        })
    }

    /// The key-value pair at `key`, if any.
    pub async fn get(&self, key: impl Into<Vec<u8>>) -> Result<Option<KeyValue>, Error> {
        let req = RangeRequest {
            key: key.into(),
            ..Default::default()
        };
        let resp = self.kv.clone().range(req).await?.into_inner();
        Ok(resp.kvs.into_iter().next())
    }

    /// Runs a transaction: `success` if every comparison in `when` holds, else `failure`.
    pub async fn txn(
        &self,
        when: Vec<Compare>,
        success: Vec<RequestOp>,
        failure: Vec<RequestOp>,
    ) -> Result<TxnResponse, Error> {
        let req = TxnRequest {
            compare: when,
            success,
            failure,
        };
        Ok(self.kv.clone().txn(req).await?.into_inner())
    }

    /// A new lease of `ttl_s` seconds: its ID.
    pub async fn lease_grant(&self, ttl_s: i64) -> Result<i64, Error> {
        let req = LeaseGrantRequest { ttl: ttl_s, id: 0 };
        let resp = self.lease.clone().lease_grant(req).await?.into_inner();
        if !resp.error.is_empty() {
            return Err(Error::Invalid(format!("lease not granted: {}", resp.error)));
        }
        Ok(resp.id)
    }

    /// Revokes lease `id`: the keys attached to it go at once.
    pub async fn lease_revoke(&self, id: i64) -> Result<(), Error> {
        let req = LeaseRevokeRequest { id };
        self.lease.clone().lease_revoke(req).await?;
        Ok(())
    }

    /// A keep-alive stream for lease `id`. Its first keep-alive is sent as it opens (etcd
    /// answers the stream's headers only with a first message); [`KeepAlive::beat`] gives its
    /// answer.
    pub async fn lease_keep_alive(&self, id: i64) -> Result<KeepAlive, Error> {
        let (beats, rx) = mpsc::channel(4);
        let first = tokio::time::Instant::now();
        // The receiver is alive: the send cannot fail.
        let _ = beats.send(LeaseKeepAliveRequest { id }).await;
        let answers = self
            .lease
            .clone()
            .lease_keep_alive(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(KeepAlive {
            id,
            beats,
            answers,
            pending: Some(first),
        })
    }
}

/// An open keep-alive stream of one lease.
pub struct KeepAlive {
    id: i64,
    beats: mpsc::Sender<LeaseKeepAliveRequest>,
    answers: tonic::Streaming<LeaseKeepAliveResponse>,
    /// When the keep-alive not yet answered was sent (the one sent on opening).
    pending: Option<tokio::time::Instant>,
}

impl KeepAlive {
    /// Sends a keep-alive (unless one sent before is still unanswered) and waits for etcd's
    /// answer: when the keep-alive answered was sent, and the lease's TTL in seconds from
    /// when etcd got it (0 or less: the lease is gone). `None` if the stream ended.
    pub async fn beat(&mut self) -> Result<Option<(tokio::time::Instant, i64)>, Error> {
        let sent = match self.pending {
            Some(at) => at,
            None => {
                let at = tokio::time::Instant::now();
                if self
                    .beats
                    .send(LeaseKeepAliveRequest { id: self.id })
                    .await
                    .is_err()
                {
                    return Ok(None);
                }
                self.pending = Some(at);
                at
            }
        };
        let answer = self.answers.message().await?;
        self.pending = None;
        Ok(answer.map(|a| (sent, a.ttl)))
    }
}

/// Holds if `key` was created at revision `rev` (0: the key does not exist).
pub fn created_at(key: impl Into<Vec<u8>>, rev: i64) -> Compare {
    equal(key, compare::TargetUnion::CreateRevision(rev))
}

/// Holds if `key` was last modified at revision `rev` (0: the key does not exist).
pub fn modified_at(key: impl Into<Vec<u8>>, rev: i64) -> Compare {
    equal(key, compare::TargetUnion::ModRevision(rev))
}

/// Holds if `key`'s field that `value` names equals it.
fn equal(key: impl Into<Vec<u8>>, value: compare::TargetUnion) -> Compare {
    use compare::{CompareTarget, TargetUnion};
    let target = match value {
        TargetUnion::Version(_) => CompareTarget::Version,
        TargetUnion::CreateRevision(_) => CompareTarget::Create,
        TargetUnion::ModRevision(_) => CompareTarget::Mod,
        TargetUnion::Value(_) => CompareTarget::Value,
        TargetUnion::Lease(_) => CompareTarget::Lease,
    };
    Compare {
        result: compare::CompareResult::Equal.into(),
        target: target.into(),
        key: key.into(),
        target_union: Some(value),
    }
}

/// A put of `value` at `key`, attached to `lease` (0: none).
pub fn put(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>, lease: i64) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestPut(PutRequest {
            key: key.into(),
            value: value.into(),
            lease,
        })),
    }
}

/// A read of `key`.
pub fn get(key: impl Into<Vec<u8>>) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestRange(RangeRequest {
            key: key.into(),
            ..Default::default()
        })),
    }
}

/// The first key-value pair a transaction's reads found.
pub fn first_read(resp: &TxnResponse) -> Option<&KeyValue> {
    resp.responses.iter().find_map(|r| match &r.response {
        Some(response_op::Response::ResponseRange(range)) => range.kvs.first(),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// The committed `etcdserverpb.rs` is what `ps/proto/etcd.proto` generates (with
    /// `protoc`, formatted by rustfmt). `EDL_BLESS=1` writes it instead of comparing.
    #[test]
    fn generated_code_matches_the_proto() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let committed = root.join("src/coordinator/etcd/etcdserverpb.rs");
        let has_protoc = std::process::Command::new(
            std::env::var_os("PROTOC").unwrap_or_else(|| "protoc".into()),
        )
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
        if !has_protoc {
            edl_shared::skip::missing(
                "EDL_REQUIRE_PROTOC",
                "",
                "protoc",
                "apt-get install protobuf-compiler",
            );
            return;
        }
        let out = tempfile::tempdir().expect("temp dir");
        tonic_prost_build::configure()
            .build_server(false)
            .out_dir(out.path())
            .compile_protos(&[root.join("proto/etcd.proto")], &[root.join("proto")])
            .expect("protoc compiles ps/proto/etcd.proto");
        let generated = out.path().join("etcdserverpb.rs");
        let fmt = std::process::Command::new("rustfmt")
            .args(["--edition", "2024"])
            .arg(&generated)
            .status()
            .expect("rustfmt runs");
        assert!(fmt.success(), "rustfmt failed on the generated code");
        let fresh = std::fs::read_to_string(&generated).expect("generated code");
        edl_shared::docgen::check(&committed, &fresh).unwrap_or_else(|e| panic!("{e}"));
    }
}
