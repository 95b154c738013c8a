//! Routing requests to shards under a shard map that can change while the job runs.
//!
//! Every pull and push is split by the map in use into one request per shard. A shard that no
//! longer holds some of the keys refuses the whole request with `StaleEpoch` and its current
//! map, changing nothing; the client adopts the newer map (or asks the coordinator for the
//! current one), splits *only the refused part* again and sends it to the new owners. Parts
//! that other shards accepted are never sent twice, so a push is applied exactly once per key
//! even when a range moves in the middle of it.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use edl_shared::proto::frame::{bytes_to_f32s, extend_f32s, extend_finite_f32s};
use edl_shared::proto::ids::{Clock, Key, ShardId, Token, WorkerId};
use edl_shared::proto::msg::{ChunkRef, DataSpan, KeyRange};
use edl_shared::proto::{ErrorCode, Frame, KeyLayout, Request, Response, ShardMap};
use edl_shared::transport::{CallError, Conn};
use tokio::task::JoinSet;

use super::{ClientError, Job, call_shard, check_finite, connect_retry};

/// How long a request keeps being re-routed while the map changes under it.
const REROUTE_WINDOW: Duration = Duration::from_secs(30);

/// A connection to one shard and the keys a request sends it: ranges of keys, their runs of
/// floats in the flat parameter vector, and their chunks in payload order.
#[derive(Clone, Debug)]
pub(super) struct ShardLink {
    pub(super) id: ShardId,
    /// Replaced when the shard restarts and the client reconnects.
    pub(super) conn: Arc<Mutex<Conn>>,
    pub(super) ranges: Vec<KeyRange>,
    /// For each range: its flat float offset and length.
    pub(super) flat: Vec<(usize, usize)>,
    /// The chunks of the ranges, in payload order.
    pub(super) chunks: Vec<ChunkRef>,
}

impl ShardLink {
    pub(super) fn current(&self) -> Conn {
        self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The link for `ranges` of shard `id` (non-empty, inside the layout).
    fn new(
        layout: &KeyLayout,
        id: ShardId,
        conn: Arc<Mutex<Conn>>,
        ranges: Vec<KeyRange>,
    ) -> Result<ShardLink, String> {
        let mut flat = Vec::with_capacity(ranges.len());
        for r in &ranges {
            let first = layout.span(Key(r.start));
            let last = layout.span(Key(r.end.saturating_sub(1)));
            match (first, last) {
                (Some(a), Some(b)) if r.end > r.start => {
                    let end = b.offset + u64::from(b.len);
                    flat.push((a.offset as usize, (end - a.offset) as usize));
                }
                _ => {
                    return Err(format!(
                        "key range {}..{} is outside the job",
                        r.start, r.end
                    ));
                }
            }
        }
        let chunks = ranges
            .iter()
            .flat_map(|r| r.start..r.end)
            .filter_map(|k| layout.span(Key(k)))
            .map(|span| ChunkRef {
                key: span.key,
                len: span.len,
            })
            .collect();
        Ok(ShardLink {
            id,
            conn,
            ranges,
            flat,
            chunks,
        })
    }
}

/// The map in use, with one link per shard that holds keys (all of its keys).
#[derive(Debug)]
pub(super) struct Routing {
    pub(super) map: ShardMap,
    pub(super) links: Vec<ShardLink>,
}

impl Routing {
    /// The links a request for `wanted` takes: all of them for the whole model (`None`),
    /// otherwise one per shard holding any of `wanted`, cut down to those keys.
    fn parts(&self, layout: &KeyLayout, wanted: Option<&[KeyRange]>) -> Cow<'_, [ShardLink]> {
        let Some(wanted) = wanted else {
            return Cow::Borrowed(&self.links);
        };
        self.links
            .iter()
            .filter_map(|l| {
                let mut ranges: Vec<KeyRange> = Vec::new();
                for r in &l.ranges {
                    for w in wanted {
                        let (a, b) = (r.start.max(w.start), r.end.min(w.end));
                        if a < b {
                            ranges.push(KeyRange { start: a, end: b });
                        }
                    }
                }
                ranges.sort_unstable_by_key(|r| r.start);
                (!ranges.is_empty())
                    .then(|| ShardLink::new(layout, l.id, l.conn.clone(), ranges).ok())
                    .flatten()
            })
            .collect::<Vec<_>>()
            .into()
    }
}

fn in_ranges(ranges: &[KeyRange], key: Key) -> bool {
    ranges.iter().any(|r| r.start <= key.0 && key.0 < r.end)
}

impl Job {
    pub(super) fn routing(&self) -> Arc<Routing> {
        self.routing
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Starts routing with `map` if it is newer than the map in use, connecting to shards
    /// not seen before; true if it was adopted.
    pub(super) async fn adopt(&self, map: ShardMap) -> Result<bool, ClientError> {
        let current = self.routing();
        if !current.links.is_empty() && map.epoch <= current.map.epoch {
            return Ok(false);
        }
        let mut links = Vec::new();
        for info in &map.shards {
            let ranges: Vec<KeyRange> = map
                .ranges_of(info.id)
                .map(|r| KeyRange {
                    start: r.start,
                    end: r.end,
                })
                .collect();
            if ranges.is_empty() {
                continue;
            }
            let conn = {
                let mut conns = self.conns.lock().await;
                match conns.get(&info.id) {
                    Some(c) => c.clone(),
                    None => {
                        let net = &self.net;
                        let c = connect_retry(&net.endpoint, &info.addr, &net.name, &net.settings)
                            .await?;
                        let c = Arc::new(Mutex::new(c));
                        conns.insert(info.id, c.clone());
                        c
                    }
                }
            };
            let link = ShardLink::new(&self.layout, info.id, conn, ranges)
                .map_err(|what| self.inconsistent("coordinator", what))?;
            links.push(link);
        }
        let mut slot = self.routing.write().unwrap_or_else(|p| p.into_inner());
        // Another task may have adopted a newer map meanwhile.
        if !slot.links.is_empty() && map.epoch <= slot.map.epoch {
            return Ok(false);
        }
        tracing::debug!(epoch = %map.epoch, "routing with a new shard map");
        *slot = Arc::new(Routing { map, links });
        Ok(true)
    }

    /// Adopts the coordinator's current map if it is newer than the one in use; true if so.
    pub(super) async fn refresh_map(&self) -> Result<bool, ClientError> {
        let resp = self.coordinator.call(Request::GetMap, Bytes::new()).await?;
        match resp.msg {
            Response::Map(m) => self.adopt(m).await,
            other => Err(CallError::unexpected(&other).into()),
        }
    }

    /// After a refusal: adopts `seen` if it is newer than the map in use, otherwise asks the
    /// coordinator; if neither is newer (the refusing shard was behind), waits a moment.
    async fn reroute(&self, seen: Option<ShardMap>) -> Result<(), ClientError> {
        if let Some(map) = seen
            && self.adopt(map).await?
        {
            return Ok(());
        }
        if !self.refresh_map().await? {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Sends one request per shard for the keys in `wanted` (`None`: the whole model), built
    /// by `make` from the shard's link, and hands each answer to `take`. Every request is built
    /// before any is sent, so a `make` that fails sends nothing. Parts refused with
    /// `StaleEpoch` are routed again under the newer map until [`REROUTE_WINDOW`] ends.
    async fn fan_out(
        &self,
        mut wanted: Option<Vec<KeyRange>>,
        retry_connection: bool,
        make: impl Fn(&ShardLink, &ShardMap) -> Result<(Request, Bytes), ClientError>,
        mut take: impl FnMut(&ShardLink, Frame<Response>) -> Result<(), ClientError>,
    ) -> Result<(), ClientError> {
        let deadline = tokio::time::Instant::now() + REROUTE_WINDOW;
        loop {
            let routing = self.routing();
            let parts = routing.parts(&self.layout, wanted.as_deref());
            let requests = parts
                .iter()
                .map(|part| make(part, &routing.map))
                .collect::<Result<Vec<_>, _>>()?;
            let mut set = JoinSet::new();
            for (i, (part, (req, payload))) in parts.iter().zip(requests).enumerate() {
                self.traffic.sent(payload.len());
                let call = call_shard(
                    (part.id, part.conn.clone()),
                    self.net.clone(),
                    self.coordinator.clone(),
                    req,
                    payload,
                    retry_connection,
                );
                set.spawn(async move { (i, call.await) });
            }
            let mut refused: Vec<KeyRange> = Vec::new();
            let mut newest: Option<ShardMap> = None;
            let mut last_refusal = None;
            while let Some(joined) = set.join_next().await {
                let Ok((i, resp)) = joined else {
                    return Err(self.inconsistent("client", "shard request task failed".into()));
                };
                match resp {
                    Ok(frame) => {
                        self.traffic.received(frame.payload.len());
                        take(&parts[i], frame)?
                    }
                    Err(CallError::Remote {
                        code: Some(ErrorCode::StaleEpoch),
                        map,
                        message,
                    }) => {
                        refused.extend_from_slice(&parts[i].ranges);
                        if let Some(m) = map
                            && newest.as_ref().is_none_or(|n| m.epoch > n.epoch)
                        {
                            newest = Some(*m);
                        }
                        last_refusal = Some(message);
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if refused.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(CallError::Remote {
                    code: Some(ErrorCode::StaleEpoch),
                    message: last_refusal.unwrap_or_default(),
                    map: newest.map(Box::new),
                }
                .into());
            }
            self.reroute(newest).await?;
            wanted = Some(refused);
        }
    }

    /// Pulls every parameter into `out` (the flat vector), from all shards in parallel.
    /// `apply_through` closes BSP steps before that clock first.
    pub async fn pull_all(&self, out: &mut [f32], apply_through: Clock) -> Result<(), ClientError> {
        self.check_len(out.len())?;
        self.pull(None, apply_through, |key, floats| {
            let off = self.layout.span(key).map_or(0, |s| s.offset as usize);
            bytes_to_f32s(floats, &mut out[off..off + floats.len() / 4])
        })
        .await
    }

    /// Pulls the keys in `wanted` (`None`: all), one request per shard in parallel, and hands
    /// each chunk's bytes to `each` once checked against what was asked.
    pub(crate) async fn pull(
        &self,
        wanted: Option<Vec<KeyRange>>,
        apply_through: Clock,
        mut each: impl FnMut(Key, &[u8]) -> Result<(), edl_shared::proto::ProtoError>,
    ) -> Result<(), ClientError> {
        self.fan_out(
            wanted,
            true,
            |link, map| {
                let req = Request::Pull {
                    epoch: map.epoch,
                    ranges: link.ranges.clone(),
                    apply_through,
                };
                Ok((req, Bytes::new()))
            },
            |link, resp| {
                let Response::Pulled { chunks } = &resp.msg else {
                    return Err(CallError::unexpected(&resp.msg).into());
                };
                self.scatter(link, chunks, &resp.payload, &mut each)
            },
        )
        .await
    }

    /// Walks a pulled payload: checks every chunk against the layout and the keys asked of
    /// `link`, and hands each chunk's bytes to `each`.
    fn scatter(
        &self,
        link: &ShardLink,
        chunks: &[ChunkRef],
        payload: &[u8],
        mut each: impl FnMut(Key, &[u8]) -> Result<(), edl_shared::proto::ProtoError>,
    ) -> Result<(), ClientError> {
        let from = link.id.to_string();
        let mut at = 0usize;
        for c in chunks {
            let fits = self.layout.span(c.key).is_some_and(|s| s.len == c.len);
            if !fits || !in_ranges(&link.ranges, c.key) {
                return Err(self.inconsistent(
                    &from,
                    format!("chunk {} of {} floats was not asked for", c.key, c.len),
                ));
            }
            let n = c.len as usize * 4;
            let bytes = payload.get(at..at + n).ok_or_else(|| {
                self.inconsistent(&from, "payload shorter than its chunks".into())
            })?;
            each(c.key, bytes).map_err(|e| self.inconsistent(&from, e.to_string()))?;
            at += n;
        }
        if at != payload.len() {
            return Err(self.inconsistent(&from, "payload longer than its chunks".into()));
        }
        Ok(())
    }

    /// Pulls only `keys` (a sparse read), one request per shard that holds any of them;
    /// returns each key's floats, in the order asked.
    pub async fn pull_keys(
        &self,
        keys: &[Key],
        apply_through: Clock,
    ) -> Result<Vec<(Key, Vec<f32>)>, ClientError> {
        if let Some(k) = keys.iter().find(|k| self.layout.span(**k).is_none()) {
            return Err(self.inconsistent("client", format!("{k} is not in the shard map")));
        }
        let mut got: HashMap<Key, Vec<f32>> = HashMap::with_capacity(keys.len());
        let wanted = KeyRange::runs(keys.iter().map(|k| k.0));
        self.pull(Some(wanted), apply_through, |key, floats| {
            let mut v = vec![0.0; floats.len() / 4];
            bytes_to_f32s(floats, &mut v)?;
            got.insert(key, v);
            Ok(())
        })
        .await?;
        keys.iter()
            .map(|k| {
                got.get(k)
                    .map(|v| (*k, v.clone()))
                    .ok_or_else(|| self.inconsistent("shards", format!("{k} was not returned")))
            })
            .collect()
    }

    /// Pushes the flat gradient vector `grads` for step `clock`, to all shards in parallel.
    pub(super) async fn push_all(
        &self,
        (worker, token): (WorkerId, Token),
        clock: Clock,
        grads: &[f32],
        span: Option<DataSpan>,
    ) -> Result<(), ClientError> {
        self.check_len(grads.len())?;
        self.fan_out(
            None,
            // Only a push with a data span may be repeated: a shard skips a span it applied.
            span.is_some(),
            |link, map| {
                // Shards refuse non-finite values too, but each sees only its part: checking
                // every part before any is sent keeps a bad gradient from being applied on
                // some shards and refused on others. A shard's ranges are contiguous runs of
                // keys, hence contiguous runs of floats.
                let floats = link.flat.iter().map(|&(_, len)| len).sum::<usize>();
                let mut payload = BytesMut::with_capacity(floats * 4);
                for &(off, len) in &link.flat {
                    extend_finite_f32s(&mut payload, &grads[off..off + len])
                        .map_err(|i| ClientError::NonFinite { index: off + i })?;
                }
                let req = Request::Push {
                    epoch: map.epoch,
                    worker,
                    clock,
                    chunks: link.chunks.clone(),
                    span,
                    covers: Vec::new(),
                    token,
                };
                Ok((req, payload.freeze()))
            },
            |_, _| Ok(()),
        )
        .await
    }

    /// Pushes `(key, values)` pairs for step `clock`, each a whole chunk (a sparse write);
    /// every other key's gradient is zero and does not travel. With a data span, every shard
    /// is asked, covering all the keys it holds (`Request::Push::covers`) so that its ledger
    /// records the span, and the push may be repeated after a connection failure (a shard
    /// skips a span it applied); without one, only the shards holding the keys are asked.
    /// Every chunk is checked (known key, its length, finite) before anything is sent.
    pub async fn push_keys(
        &self,
        (worker, token): (WorkerId, Token),
        clock: Clock,
        chunks: &[(Key, &[f32])],
        span: Option<DataSpan>,
    ) -> Result<(), ClientError> {
        for (k, v) in chunks {
            if self
                .layout
                .span(*k)
                .is_none_or(|s| s.len as usize != v.len())
            {
                return Err(self.inconsistent("client", format!("{k} does not fit the job")));
            }
            check_finite(v)?;
        }
        let wanted = match span {
            Some(_) => None,
            None => Some(KeyRange::runs(chunks.iter().map(|(k, _)| k.0))),
        };
        self.fan_out(
            wanted,
            span.is_some(),
            |link, map| {
                let mine: Vec<&(Key, &[f32])> = chunks
                    .iter()
                    .filter(|(k, _)| in_ranges(&link.ranges, *k))
                    .collect();
                let floats = mine.iter().map(|(_, v)| v.len()).sum::<usize>();
                let mut payload = BytesMut::with_capacity(floats * 4);
                for (_, v) in &mine {
                    extend_f32s(&mut payload, v);
                }
                let req = Request::Push {
                    epoch: map.epoch,
                    worker,
                    clock,
                    chunks: mine
                        .iter()
                        .map(|(k, v)| ChunkRef {
                            key: *k,
                            len: v.len() as u32,
                        })
                        .collect(),
                    span,
                    covers: match span {
                        Some(_) => link.ranges.clone(),
                        None => Vec::new(),
                    },
                    token,
                };
                Ok((req, payload.freeze()))
            },
            |_, _| Ok(()),
        )
        .await
    }
}
