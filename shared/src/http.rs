//! A small HTTP/1.1 server (hyper) for what operators look at: `/metrics` on every process
//! (`--metrics ADDR`), and on the coordinator its dashboard and JSON API (`--http ADDR`).
//!
//! Plain HTTP without authentication: bind it to a loopback or cluster-internal address. It
//! serves GET only, answers every other method 405, and never reads a request body.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::{debug, info};

use crate::shutdown::CancellationToken;

/// One answer.
#[derive(Clone, Debug)]
pub struct Reply {
    /// The HTTP status.
    pub status: u16,
    /// Its content type.
    pub content_type: &'static str,
    /// The body.
    pub body: Bytes,
}

impl Reply {
    /// 200 with `body` of `content_type`.
    pub fn ok(content_type: &'static str, body: impl Into<Bytes>) -> Reply {
        Reply {
            status: 200,
            content_type,
            body: body.into(),
        }
    }

    /// 200 with a JSON body.
    pub fn json(body: impl Into<Bytes>) -> Reply {
        Self::ok("application/json", body)
    }

    /// An error status with a plain-text reason.
    pub fn error(status: u16, why: impl Into<String>) -> Reply {
        Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            body: Bytes::from(why.into() + "\n"),
        }
    }
}

/// What a process serves besides `/metrics`.
pub trait Pages: Send + Sync + 'static {
    /// The answer for `path` with `query` (without the `?`), or `None` for 404.
    fn page(&self, path: &str, query: &str) -> impl Future<Output = Option<Reply>> + Send;
}

/// Serves `/metrics` alone.
#[derive(Clone, Copy, Debug)]
pub struct MetricsOnly;

impl Pages for MetricsOnly {
    async fn page(&self, _path: &str, _query: &str) -> Option<Reply> {
        None
    }
}

/// Binds `addr` and serves `pages` and `/metrics` until `shutdown` is cancelled; returns the
/// bound address (port 0 picks one).
pub async fn serve<P: Pages>(
    addr: SocketAddr,
    pages: Arc<P>,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    info!(addr = %bound, "HTTP serving (/metrics)");
    tokio::spawn(async move {
        loop {
            let (stream, _) = tokio::select! {
                _ = shutdown.cancelled() => break,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        debug!(error = %e, "HTTP accept failed");
                        continue;
                    }
                },
            };
            let pages = pages.clone();
            let stop = shutdown.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| answer(pages.clone(), req));
                let conn = http1::Builder::new()
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(stream), service);
                tokio::select! {
                    _ = stop.cancelled() => {}
                    r = conn => if let Err(e) = r { debug!(error = %e, "HTTP connection ended"); },
                }
            });
        }
    });
    Ok(bound)
}

async fn answer<P: Pages>(
    pages: Arc<P>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let reply = if req.method() != Method::GET && req.method() != Method::HEAD {
        Reply::error(405, "only GET is served")
    } else {
        let path = req.uri().path();
        let query = req.uri().query().unwrap_or("");
        match pages.page(path, query).await {
            Some(r) => r,
            None if path == "/metrics" => {
                Reply::ok(crate::metrics::CONTENT_TYPE, crate::metrics::render())
            }
            None => Reply::error(404, format!("nothing at {path}")),
        }
    };
    let mut resp = Response::new(Full::new(reply.body));
    *resp.status_mut() = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::OK);
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(reply.content_type),
    );
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    Ok(resp)
}

/// Starts `/metrics` on `addr` when one is given, logging where; an address that cannot be
/// bound is an error.
pub async fn serve_metrics(
    addr: Option<SocketAddr>,
    shutdown: CancellationToken,
) -> std::io::Result<Option<SocketAddr>> {
    match addr {
        None => Ok(None),
        Some(a) => serve(a, Arc::new(MetricsOnly), shutdown)
            .await
            .map(Some)
            .map_err(|e| {
                std::io::Error::new(e.kind(), format!("cannot serve metrics on {a}: {e}"))
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn serves_metrics_and_refuses_other_paths_and_methods() {
        let stop = CancellationToken::new();
        let addr = serve(
            "127.0.0.1:0".parse().expect("an address"),
            Arc::new(MetricsOnly),
            stop.clone(),
        )
        .await
        .expect("binds");
        let get = |path: &str, method: &str| {
            let req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut s = tokio::net::TcpStream::connect(addr)
                    .await
                    .expect("connects");
                s.write_all(req.as_bytes()).await.expect("sends");
                let mut out = String::new();
                s.read_to_string(&mut out).await.expect("reads");
                out
            }
        };
        let m = get("/metrics", "GET").await;
        assert!(m.starts_with("HTTP/1.1 200"), "{m}");
        assert!(m.contains("# EOF"), "{m}");
        assert!(get("/nope", "GET").await.starts_with("HTTP/1.1 404"));
        assert!(get("/metrics", "POST").await.starts_with("HTTP/1.1 405"));
        stop.cancel();
    }
}
