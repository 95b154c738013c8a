//! The coordinator's dashboard (`--http ADDR`): a page bundled into the binary, and the JSON
//! API it polls (`/api/status`, `/api/history?from_ms=N`, `/api/shards`); `/metrics` too.

use std::sync::Arc;
use std::time::Duration;

use edl_shared::http::{Pages, Reply};
use edl_shared::proto::msg::ShardStats;
use edl_shared::proto::{Parts, Request, Response};

use super::Coordinator;
use crate::views;

/// The page, without a build step or anything fetched from elsewhere.
const PAGE: &str = include_str!("dashboard.html");

/// How long the dashboard waits for one shard's statistics.
const SHARD_WAIT: Duration = Duration::from_secs(2);

/// The dashboard of a coordinator.
pub struct Dashboard(pub Arc<Coordinator>);

impl Pages for Dashboard {
    async fn page(&self, path: &str, query: &str) -> Option<Reply> {
        let c = &self.0;
        Some(match path {
            "/" | "/index.html" => Reply::ok("text/html; charset=utf-8", PAGE),
            "/api/status" => {
                let body = {
                    let st = c.lock();
                    let now = edl_shared::clock::now();
                    let map = st.map();
                    views::status(
                        &st.status(now),
                        &st.members(now),
                        &st.shard_list(),
                        map.as_ref(),
                    )
                };
                Reply::json(body.to_string())
            }
            "/api/history" => {
                let from_ms = match query_u64(query, "from_ms") {
                    Ok(v) => v.unwrap_or(0),
                    Err(why) => return Some(Reply::error(400, why)),
                };
                let body = {
                    let st = c.lock();
                    views::history(&st.history(from_ms), &st.trace(u64::MAX))
                };
                Reply::json(body.to_string())
            }
            "/api/shards" => Reply::json(shards(c).await.to_string()),
            _ => return None,
        })
    }
}

/// Every shard's statistics, asked of the shards in parallel.
async fn shards(c: &Arc<Coordinator>) -> serde_json::Value {
    let entries = c.lock().shard_list();
    let Some(caller) = c.caller.get().cloned() else {
        return serde_json::Value::Array(Vec::new());
    };
    let mut asks = tokio::task::JoinSet::new();
    for (i, e) in entries.into_iter().enumerate() {
        let caller = caller.clone();
        asks.spawn(async move {
            let ask = caller.call(&e.addr, Request::ShardStats, Parts::default());
            let r = match tokio::time::timeout(SHARD_WAIT, ask).await {
                Ok(Ok(Response::ShardStats(s))) => Ok(s),
                // Waiting for the shard map to form, it holds and serves nothing.
                Ok(Err(err)) if crate::admin::unassigned(&e, &err) => Ok(ShardStats {
                    shard: e.id,
                    ranges: Vec::new(),
                    keys: 0,
                    floats: 0,
                    state_bytes: 0,
                    pushes: 0,
                    pulls: 0,
                    bytes_in: 0,
                    bytes_out: 0,
                    backups: Vec::new(),
                    lag: 0,
                }),
                Ok(Ok(_)) => Err("unexpected answer".to_string()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {SHARD_WAIT:?}")),
            };
            (i, views::shard_stats(&e, r.as_ref().map_err(Clone::clone)))
        });
    }
    let mut rows = asks.join_all().await;
    rows.sort_by_key(|(i, _)| *i);
    serde_json::Value::Array(rows.into_iter().map(|(_, v)| v).collect())
}

/// The value of `key` in a query string, if given; an error if it is not a number.
fn query_u64(query: &str, key: &str) -> Result<Option<u64>, String> {
    for pair in query.split('&') {
        if let Some(v) = pair.strip_prefix(key).and_then(|r| r.strip_prefix('=')) {
            return v
                .parse()
                .map(Some)
                .map_err(|_| format!("{key} must be a whole number, not {v:?}"));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::query_u64;

    #[test]
    fn query_values_are_read_and_bad_ones_refused() {
        assert_eq!(query_u64("from_ms=1500", "from_ms"), Ok(Some(1500)));
        assert_eq!(query_u64("a=1&from_ms=7", "from_ms"), Ok(Some(7)));
        assert_eq!(query_u64("", "from_ms"), Ok(None));
        assert!(query_u64("from_ms=x", "from_ms").is_err());
    }
}
