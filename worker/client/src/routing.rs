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
use edl_shared::proto::frame::{Parts, Payload, extend_f32s, first_non_finite};
use edl_shared::proto::ids::{Clock, Key, ShardId, Token, WorkerId};
use edl_shared::proto::msg::{ChunkRef, DataSpan, KeyRange};
use edl_shared::proto::wire::{Wire, decode, encode_finite};
use edl_shared::proto::{ErrorCode, KeyLayout, Request, Response, ShardMap, WireSpec};
use edl_shared::transport::{CallError, Collect, Conn, Release, Sink};

use super::{ClientError, Gradients, Job, check_finite, connect_retry, refused_at};
use crate::topk::Residual;

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
            .map(|span| ChunkRef::new(span.key, span.len))
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

/// How tensor `tensor`'s values travel, `wires` giving each tensor's (exact where it gives
/// none).
pub(crate) fn tensor_wire(wires: &[WireSpec], tensor: usize) -> WireSpec {
    wires.get(tensor).copied().unwrap_or_default()
}

/// How key `key`'s values travel: its tensor's wire.
fn wire_of(layout: &KeyLayout, wires: &[WireSpec], key: Key) -> WireSpec {
    layout
        .span(key)
        .map_or_else(WireSpec::default, |s| tensor_wire(wires, s.tensor))
}

fn in_ranges(ranges: &[KeyRange], key: Key) -> bool {
    ranges.iter().any(|r| r.start <= key.0 && key.0 < r.end)
}

impl Job {
    /// How key `key`'s values travel: its tensor's wire.
    pub(crate) fn wire_of(&self, key: Key) -> WireSpec {
        wire_of(&self.layout, &self.wires, key)
    }

    /// Whether some tensor's pushes are top-k sparsified.
    pub(crate) fn sparsifies(&self) -> bool {
        self.wires.iter().any(|w| w.topk.is_some())
    }

    /// `link`'s chunks as a push sends them: each at its tensor's precision, sparse where the
    /// tensor is top-k sparsified and `sparse` says so.
    fn coded(&self, link: &ShardLink, sparse: bool) -> Vec<ChunkRef> {
        (link.chunks.iter())
            .map(|c| {
                let w = self.wire_of(c.key);
                c.coded(w.values, sparse && w.topk.is_some())
            })
            .collect()
    }

    /// `link`'s floats as runs of one precision each: (offset, length, precision).
    fn runs(&self, link: &ShardLink) -> Vec<(usize, usize, Wire)> {
        let mut runs: Vec<(usize, usize, Wire)> = Vec::new();
        for span in link.chunks.iter().filter_map(|c| self.layout.span(c.key)) {
            let (off, len) = (span.offset as usize, span.len as usize);
            let wire = tensor_wire(&self.wires, span.tensor).values;
            match runs.last_mut() {
                Some((o, l, w)) if *w == wire && *o + *l == off => *l += len,
                _ => runs.push((off, len, wire)),
            }
        }
        runs
    }

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
                        let c = connect_retry(&net.dialer, &info.addr, &net.name, &net.settings)
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
        drop(slot);
        self.remapped.notify_waiters();
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
    /// by `make` from the shard's link, with the answer's payload going to the sink `sink`
    /// makes for the link as it arrives, and hands each answer to `take`. Every request is
    /// built before any is sent, so a `make` that fails sends nothing. The requests run at
    /// once, in the caller's task (so that sinks can write into the caller's buffers). Parts
    /// refused with `StaleEpoch` are routed again under the newer map until
    /// [`REROUTE_WINDOW`] ends.
    async fn fan_out<S: Sink<Response> + Send>(
        &self,
        mut wanted: Option<Vec<KeyRange>>,
        retry_connection: bool,
        make: impl Fn(&ShardLink, &ShardMap) -> Result<(Request, Parts), ClientError>,
        check: Option<&Check<'_>>,
        sink: impl Fn(&ShardLink) -> S,
        mut take: impl FnMut(&ShardLink, Response) -> Result<(), ClientError>,
    ) -> Result<(), ClientError> {
        let deadline = tokio::time::Instant::now() + REROUTE_WINDOW;
        loop {
            let routing = self.routing();
            let parts = routing.parts(&self.layout, wanted.as_deref());
            let requests = parts
                .iter()
                .map(|part| make(part, &routing.map))
                .collect::<Result<Vec<_>, _>>()?;
            // One request needs no gate: its shard checks every value before it acts on any,
            // and refuses the request whole.
            let gate = check.filter(|_| parts.len() > 1).map(Gate::new);
            let calls = parts.iter().zip(requests).map(|(part, request)| {
                self.traffic.sent(request.1.byte_len());
                let mut sink = Counted {
                    inner: sink(part),
                    bytes: 0,
                };
                let to = (part.id, part.conn.clone());
                let gate = gate.as_ref();
                async move {
                    let answer = self
                        .call_shard(to, request, retry_connection, &gate, &mut sink)
                        .await;
                    if answer.is_err() {
                        // A request that will not be sent complete holds back no other.
                        gate.inspect(|g| g.shut(None));
                    }
                    (answer, sink.bytes)
                }
            });
            let checks = async {
                if let Some(g) = &gate {
                    g.run(&parts).await;
                }
            };
            let (answers, ()) = tokio::join!(futures_util::future::join_all(calls), checks);
            if let Some(e) = gate.and_then(|g| g.into_error()) {
                return Err(e);
            }
            let mut refused: Vec<KeyRange> = Vec::new();
            let mut newest: Option<ShardMap> = None;
            let mut last_refusal = None;
            // A request withdrawn because another one failed: report that failure instead.
            let mut withdrawn = false;
            for (part, (answer, received)) in parts.iter().zip(answers) {
                self.traffic.received(received as usize);
                match answer {
                    Ok(msg) => take(part, msg)?,
                    Err(CallError::Withdrawn) => withdrawn = true,
                    Err(CallError::Remote {
                        code: Some(ErrorCode::StaleEpoch),
                        map,
                        message,
                    }) => {
                        refused.extend_from_slice(&part.ranges);
                        if let Some(m) = map
                            && newest.as_ref().is_none_or(|n| m.epoch > n.epoch)
                        {
                            newest = Some(*m);
                        }
                        last_refusal = Some(message);
                    }
                    Err(CallError::Refused(what)) => {
                        return Err(self.inconsistent(&part.id.to_string(), what));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if withdrawn {
                return Err(CallError::Withdrawn.into());
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

    /// Pulls every parameter into `out` (the flat vector), from all shards in parallel. Each
    /// shard's answer is written into `out` as it arrives, without an intermediate buffer. On
    /// an error, `out` may hold part of the new values.
    /// `apply_through` closes BSP steps before that clock first. The values travel at the
    /// job's wire precision.
    pub async fn pull_all(&self, out: &mut [f32], apply_through: Clock) -> Result<(), ClientError> {
        self.pull_into(out, apply_through, None).await
    }

    /// [`Job::pull_all`] at the precision `wire` (an evaluation or a checkpoint pulls the
    /// parameters exact, at f32, whatever the job's wire).
    pub async fn pull_all_in(
        &self,
        out: &mut [f32],
        apply_through: Clock,
        wire: Wire,
    ) -> Result<(), ClientError> {
        self.pull_into(out, apply_through, Some(wire)).await
    }

    /// [`Job::pull_all`] with every value at `wire`, or each tensor's at its own (`None`).
    async fn pull_into(
        &self,
        out: &mut [f32],
        apply_through: Clock,
        wire: Option<Wire>,
    ) -> Result<(), ClientError> {
        self.check_len(out.len())?;
        let layout = &self.layout;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut *out);
        self.pull(None, apply_through, wire, |key, at, part| {
            let off = layout.span(key).map_or(0, |s| s.offset as usize) * 4 + at;
            bytes[off..off + part.len()].copy_from_slice(part);
        })
        .await?;
        from_le_in_place(out);
        Ok(())
    }

    /// Pulls the keys in `wanted` (`None`: all), one request per shard in parallel. Once an
    /// answer's chunks are checked against what was asked (the layout and the keys asked of
    /// that shard), its payload is handed to `each` as it arrives: `each(key, at, bytes)`
    /// says that `bytes` are the chunk's little-endian float bytes from byte `at` on. The
    /// values travel at `wire`, or each tensor's at its own (`None`).
    pub(crate) async fn pull(
        &self,
        wanted: Option<Vec<KeyRange>>,
        apply_through: Clock,
        wire: Option<Wire>,
        each: impl FnMut(Key, usize, &[u8]) + Send,
    ) -> Result<(), ClientError> {
        let each = Mutex::new(each);
        self.fan_out(
            wanted,
            true,
            |link, map| {
                let req = Request::Pull {
                    epoch: map.epoch,
                    ranges: link.ranges.clone(),
                    apply_through,
                    wire,
                };
                Ok((req, Parts::default()))
            },
            None,
            |link| PullSink {
                layout: &self.layout,
                wires: &self.wires,
                ranges: link.ranges.clone(),
                each: &each,
                chunks: Vec::new(),
                at: (0, 0),
                wire,
                narrow: Vec::new(),
                wide: Vec::new(),
            },
            |_, msg| match msg {
                Response::Pulled { .. } => Ok(()),
                other => Err(CallError::unexpected(&other).into()),
            },
        )
        .await
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
        let layout = &self.layout;
        self.pull(Some(wanted), apply_through, None, |key, at, part| {
            let v = got
                .entry(key)
                .or_insert_with(|| vec![0.0; layout.span(key).map_or(0, |s| s.len as usize)]);
            bytemuck::cast_slice_mut::<f32, u8>(v)[at..at + part.len()].copy_from_slice(part);
        })
        .await?;
        got.values_mut().for_each(|v| from_le_in_place(v));
        keys.iter()
            .map(|k| {
                got.get(k)
                    .map(|v| (*k, v.clone()))
                    .ok_or_else(|| self.inconsistent("shards", format!("{k} was not returned")))
            })
            .collect()
    }

    /// Pushes the flat gradient vector `grads` for step `clock`, to all shards in parallel.
    /// Borrowed values are checked and copied into one wire buffer per shard in one pass;
    /// [`Gradients`] are checked and sent as they lie at f32, converted like borrowed ones at
    /// a 16-bit wire.
    pub(super) async fn push_all(
        &self,
        (worker, token): (WorkerId, Token),
        clock: Clock,
        grads: Grads<'_>,
        span: Option<DataSpan>,
    ) -> Result<(), ClientError> {
        self.check_len(grads.len())?;
        // Shards refuse non-finite values too, but each sees only its part: every part must
        // pass before any shard acts on its request, or a bad gradient would be applied on
        // some shards and refused on others. Borrowed values are checked as they are copied,
        // before anything is sent; shared ones while QUIC sends them, each request completed
        // only once every part passed (`Gate`), and not at all here when one shard is asked
        // (it refuses a bad gradient whole; the index is then found here).
        // Shared gradients are sent as they lie where every tensor travels at f32.
        let as_they_lie =
            matches!(grads, Grads::Shared(_)) && self.wires.iter().all(|w| w.values == Wire::F32);
        let shared_check = match &grads {
            // Sent as they lie: checked while QUIC sends them.
            Grads::Shared(g) if as_they_lie => Some(|link: &ShardLink| {
                link.flat.iter().try_for_each(|&(off, len)| {
                    match first_non_finite(&g[off..off + len]) {
                        Some(i) => Err(ClientError::NonFinite { index: off + i }),
                        None => Ok(()),
                    }
                })
            }),
            _ => None,
        };
        let check = shared_check.as_ref().map(|c| c as &Check<'_>);
        let pushed = self
            .fan_out(
                None,
                // Only a push with a data span may be repeated: a shard skips a span it applied.
                span.is_some(),
                |link, map| {
                    // A shard's ranges are contiguous runs of keys, hence contiguous runs of floats.
                    let payload = match &grads {
                        Grads::Shared(g) if as_they_lie => Parts(
                            link.flat
                                .iter()
                                .map(|&(off, len)| g.wire(off, len))
                                .collect(),
                        ),
                        // Copied (converted) and checked in one pass.
                        Grads::Shared(g) => encoded(&self.runs(link), g)?,
                        Grads::Borrowed(g) => encoded(&self.runs(link), g)?,
                    };
                    let chunks = self.coded(link, false);
                    let req = push_request(chunks, map, (worker, token), clock, (span, vec![]));
                    Ok((req, payload))
                },
                check,
                |_| Collect::default(),
                |_, _| Ok(()),
            )
            .await;
        match (pushed, &grads) {
            (Err(e), Grads::Shared(g)) if e.code() == Some(ErrorCode::NonFinite) => {
                check_finite(g)?;
                Err(e)
            }
            (pushed, _) => pushed,
        }
    }

    /// Pushes the top-k of `grads` plus `residual` for step `clock` (each tensor's wire names
    /// its k; a tensor without one is pushed whole), to all shards in parallel; the residual
    /// becomes what the push left for the keys of each shard that takes it. As for [`Job::push_all`], only a push with a data span may be
    /// repeated after a failure: the same step and span are sent again as first made (a
    /// shard that applied the span skips it), whatever `grads` holds then.
    pub(super) async fn push_topk(
        &self,
        (worker, token): (WorkerId, Token),
        clock: Clock,
        residual: &mut Residual,
        grads: &[f32],
        span: Option<DataSpan>,
    ) -> Result<(), ClientError> {
        self.check_len(grads.len())?;
        if !self.sparsifies() {
            let spec = self.job.wire;
            return Err(self.inconsistent(
                "client",
                format!("a top-k push in a job whose wire is {spec}"),
            ));
        }
        // Every value is checked as it is chosen, before anything is sent.
        let records = residual.push(&self.layout, grads, &self.wires, (clock, span))?;
        self.fan_out(
            None,
            span.is_some(),
            |link, map| {
                let chunks = self.coded(link, true);
                let req = push_request(chunks, map, (worker, token), clock, (span, vec![]));
                Ok((req, Parts(records.parts(&link.ranges))))
            },
            None,
            |_| Collect::default(),
            |link, _| {
                residual.taken(&link.flat);
                Ok(())
            },
        )
        .await?;
        residual.done();
        Ok(())
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
            // Positions count from the start of the model, as push_all's do.
            check_finite(v).map_err(|e| match (e, self.layout.span(*k)) {
                (ClientError::NonFinite { index }, Some(s)) => ClientError::NonFinite {
                    index: s.offset as usize + index,
                },
                (e, _) => e,
            })?;
        }
        let wanted = match span {
            Some(_) => None,
            None => Some(KeyRange::runs(chunks.iter().map(|(k, _)| k.0))),
        };
        self.fan_out(
            wanted,
            span.is_some(),
            |link, map| {
                // Each chunk at its tensor's precision.
                let (refs, values): (Vec<ChunkRef>, Vec<&[f32]>) = (chunks.iter())
                    .filter(|(k, _)| in_ranges(&link.ranges, *k))
                    .map(|(k, v)| {
                        let wire = self.wire_of(*k).values;
                        (ChunkRef::new(*k, v.len() as u32).coded(wire, false), *v)
                    })
                    .unzip();
                let bytes = (refs.iter())
                    .map(|c| c.len as usize * c.wire.value_bytes())
                    .sum::<usize>();
                let mut payload = BytesMut::with_capacity(bytes);
                for (c, v) in refs.iter().zip(&values) {
                    if c.wire == Wire::F32 {
                        // Checked above.
                        extend_f32s(&mut payload, v);
                    } else {
                        // Finite, but perhaps past binary16's range.
                        encode_finite(&mut payload, v, c.wire).map_err(|i| {
                            let at = self.layout.span(c.key).map_or(0, |s| s.offset as usize);
                            refused_at(v, i, at, c.wire)
                        })?;
                    }
                }
                let covers = match span {
                    Some(_) => link.ranges.clone(),
                    None => Vec::new(),
                };
                let req = push_request(refs, map, (worker, token), clock, (span, covers));
                Ok((req, Parts(vec![payload.freeze()])))
            },
            None,
            |_| Collect::default(),
            |_, _| Ok(()),
        )
        .await
    }
}

/// The request of a push of `chunks` (in payload order, coded) under `map`, of `span`'s
/// samples, covering `covers` too.
fn push_request(
    chunks: Vec<ChunkRef>,
    map: &ShardMap,
    (worker, token): (WorkerId, Token),
    clock: Clock,
    (span, covers): (Option<DataSpan>, Vec<KeyRange>),
) -> Request {
    Request::Push {
        epoch: map.epoch,
        worker,
        clock,
        chunks,
        span,
        covers,
        token,
    }
}

/// The values at `runs` (offset, length, precision) of `g`, as one payload, each checked as
/// it is copied; an error names the first value that is not finite in its run's precision.
fn encoded(runs: &[(usize, usize, Wire)], g: &[f32]) -> Result<Parts, ClientError> {
    let bytes = (runs.iter())
        .map(|&(_, len, wire)| len * wire.value_bytes())
        .sum::<usize>();
    let mut payload = BytesMut::with_capacity(bytes);
    for &(off, len, wire) in runs {
        encode_finite(&mut payload, &g[off..off + len], wire)
            .map_err(|i| refused_at(&g[off..off + len], i, off, wire))?;
    }
    Ok(Parts(vec![payload.freeze()]))
}

/// A pull answer's payload on its way into the caller's buffers: its chunks are checked
/// against what was asked once the header arrives, then every part is handed on as it
/// arrives, cut at chunk boundaries. A 16-bit chunk's values are gathered and handed on as
/// f32 once the chunk is whole.
struct PullSink<'a, F> {
    layout: &'a KeyLayout,
    /// Each tensor's wire.
    wires: &'a [WireSpec],
    /// The keys asked of this shard.
    ranges: Vec<KeyRange>,
    each: &'a Mutex<F>,
    /// The answer's chunks, and the chunk and byte in it the next part starts at.
    chunks: Vec<ChunkRef>,
    at: (usize, usize),
    /// The precision asked for (`None`: each tensor's own).
    wire: Option<Wire>,
    /// A 16-bit chunk's bytes so far, and its values decoded.
    narrow: Vec<u8>,
    wide: Vec<f32>,
}

impl<F: FnMut(Key, usize, &[u8])> Sink<Response> for PullSink<'_, F> {
    fn header(&mut self, msg: &Response, len: u64) -> Result<(), String> {
        self.chunks.clear();
        self.at = (0, 0);
        // A repeated call starts again: nothing of an earlier answer is kept.
        self.narrow.clear();
        let Response::Pulled { chunks } = msg else {
            return match len {
                0 => Ok(()),
                n => Err(format!("an answer of {n} payload bytes to a pull")),
            };
        };
        let mut bytes = 0u64;
        for c in chunks {
            let fits = self.layout.span(c.key).is_some_and(|s| s.len == c.len);
            if !fits || !in_ranges(&self.ranges, c.key) {
                return Err(format!(
                    "chunk {} of {} floats was not asked for",
                    c.key, c.len
                ));
            }
            // The precision asked for, or f32 where a value did not fit it.
            let asked =
                (self.wire).unwrap_or_else(|| wire_of(self.layout, self.wires, c.key).values);
            if c.sparse || (c.wire != asked && c.wire != Wire::F32) {
                let sparse = if c.sparse { "sparse " } else { "" };
                return Err(format!(
                    "{} came {sparse}at {}, asked at {asked}",
                    c.key, c.wire
                ));
            }
            bytes += u64::from(c.len) * c.wire.value_bytes() as u64;
        }
        if bytes != len {
            return Err(format!(
                "payload of {len} bytes for chunks of {bytes} bytes"
            ));
        }
        self.chunks.clone_from(chunks);
        Ok(())
    }

    fn part(&mut self, mut part: Bytes) {
        let mut each = self.each.lock().unwrap_or_else(|p| p.into_inner());
        while !part.is_empty() {
            let Some(c) = self.chunks.get(self.at.0) else {
                // The parts add up to the length `header` checked: nothing is left over.
                return;
            };
            let (key, wire) = (c.key, c.wire);
            let size = c.len as usize * wire.value_bytes();
            let n = part.len().min(size - self.at.1);
            if wire == Wire::F32 {
                each(key, self.at.1, &part[..n]);
            } else {
                self.narrow.extend_from_slice(&part[..n]);
            }
            let _ = part.split_to(n);
            self.at.1 += n;
            if self.at.1 == size {
                if wire != Wire::F32 {
                    self.wide.clear();
                    self.wide.resize(size / wire.value_bytes(), 0.0);
                    // Whole values, as many as the chunk holds: it cannot fail. Parameters
                    // are not checked here, as f32 ones are not (shards check what they hold).
                    let decoded = decode(&self.narrow, wire, &mut self.wide);
                    debug_assert!(decoded.is_ok(), "{decoded:?}");
                    self.narrow.clear();
                    // The values as little-endian f32 bytes, as an f32 answer has them.
                    from_le_in_place(&mut self.wide);
                    each(key, 0, bytemuck::cast_slice(&self.wide));
                }
                self.at = (self.at.0 + 1, 0);
            }
        }
    }
}

/// A check that every part of a request must pass before any shard acts on its part.
pub(super) type Check<'a> = dyn Fn(&ShardLink) -> Result<(), ClientError> + Sync + 'a;

/// Holds back the requests of one fan-out until every part has passed its [`Check`]: the
/// requests are sent at once, the parts are checked while QUIC sends them, and the requests
/// are completed once all parts passed, or withdrawn when one failed (a shard acts on a
/// request only once its stream is finished). A request that will not be sent complete
/// withdraws the others still waiting. Once open, the gate stays open: a request repeated on
/// a new connection is completed at once.
struct Gate<'a> {
    check: &'a Check<'a>,
    verdict: tokio::sync::watch::Sender<Verdict>,
    /// Why the gate shut, when a check failed.
    error: Mutex<Option<ClientError>>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Verdict {
    Waiting,
    Open,
    Shut,
}

impl<'a> Gate<'a> {
    fn new(check: &'a Check<'a>) -> Self {
        Gate {
            check,
            verdict: tokio::sync::watch::Sender::new(Verdict::Waiting),
            error: Mutex::new(None),
        }
    }

    /// Checks every link's part, once the requests had their turn to be sent, and opens the
    /// gate or shuts it.
    async fn run(&self, links: &[ShardLink]) {
        tokio::task::yield_now().await;
        for link in links {
            if let Err(e) = (self.check)(link) {
                self.shut(Some(e));
                return;
            }
        }
        self.verdict.send_modify(|v| {
            if *v == Verdict::Waiting {
                *v = Verdict::Open;
            }
        });
    }

    /// Withdraws every request still waiting: a check failed with `why`, or a request will
    /// not be sent complete.
    fn shut(&self, why: Option<ClientError>) {
        if let Some(e) = why {
            self.error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
        }
        self.verdict.send_modify(|v| {
            if *v == Verdict::Waiting {
                *v = Verdict::Shut;
            }
        });
    }

    /// The failed check's error, if one failed.
    fn into_error(self) -> Option<ClientError> {
        self.error.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

/// A request waits for the gate's verdict: whether to complete it.
impl Release for &Gate<'_> {
    async fn release(&self) -> bool {
        let mut rx = self.verdict.subscribe();
        // The sender lives as long as the gate: the wait ends only with a verdict.
        let verdict = rx.wait_for(|v| *v != Verdict::Waiting).await;
        verdict.is_ok_and(|v| *v == Verdict::Open)
    }
}

/// Counts the payload bytes that reach a sink.
struct Counted<S> {
    inner: S,
    bytes: u64,
}

impl<S: Sink<Response>> Sink<Response> for Counted<S> {
    fn header(&mut self, msg: &Response, len: u64) -> Result<(), String> {
        self.inner.header(msg, len)
    }

    fn part(&mut self, part: Bytes) {
        self.bytes += part.len() as u64;
        self.inner.part(part);
    }
}

/// Values written as little-endian bytes into `v`, read as the machine's floats (nothing to
/// do on little-endian machines).
pub(crate) fn from_le_in_place(v: &mut [f32]) {
    if cfg!(target_endian = "big") {
        for x in v {
            *x = f32::from_le_bytes(x.to_ne_bytes());
        }
    }
}

/// A gradient to push: borrowed (checked and copied into the wire buffers in one pass), or
/// [`Gradients`] (checked, then sent as they lie).
#[derive(Clone, Copy, Debug)]
pub(super) enum Grads<'a> {
    Borrowed(&'a [f32]),
    Shared(&'a Gradients),
}

impl Grads<'_> {
    fn len(&self) -> usize {
        match self {
            Grads::Borrowed(g) => g.len(),
            Grads::Shared(g) => g.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::{Init, TensorSpec};

    /// A layout of 3 keys of 4 floats (12 floats in all).
    fn layout() -> KeyLayout {
        let t = TensorSpec {
            name: "t".into(),
            shape: vec![12],
            init: Init::Zeros,
        };
        KeyLayout::new(&[t], 4)
    }

    fn pulled(keys: &[u64]) -> Response {
        Response::Pulled {
            chunks: keys.iter().map(|&k| ChunkRef::new(Key(k), 4)).collect(),
        }
    }

    /// A sink for a pull of keys 1 and 2 of [`layout`], at f32.
    fn sink<'a, F>(layout: &'a KeyLayout, each: &'a Mutex<F>) -> PullSink<'a, F> {
        PullSink {
            layout,
            wires: &[],
            ranges: vec![KeyRange { start: 1, end: 3 }],
            each,
            chunks: Vec::new(),
            at: (0, 0),
            wire: Some(Wire::F32),
            narrow: Vec::new(),
            wide: Vec::new(),
        }
    }

    #[test]
    fn a_pull_answer_goes_where_its_chunks_belong_whatever_its_parts() {
        let layout = layout();
        let want: Vec<f32> = (0..8).map(|i| i as f32 + 0.5).collect();
        let wire: Vec<u8> = want.iter().flat_map(|v| v.to_le_bytes()).collect();
        for cut in [1, 3, 4, 7, 16, 32] {
            let mut out = [0f32; 12];
            {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out[..]);
                let each = Mutex::new(|key: Key, at: usize, part: &[u8]| {
                    let off = layout.span(key).map_or(0, |s| s.offset as usize) * 4 + at;
                    bytes[off..off + part.len()].copy_from_slice(part);
                });
                let mut sink = sink(&layout, &each);
                sink.header(&pulled(&[1, 2]), 32).expect("asked for");
                for part in wire.chunks(cut) {
                    sink.part(Bytes::copy_from_slice(part));
                }
            }
            assert_eq!(
                &out[..4],
                &[0.0; 4],
                "key 0 was not asked for (parts of {cut})"
            );
            assert_eq!(&out[4..], &want[..], "parts of {cut}");
        }
    }

    #[test]
    fn each_chunk_of_a_pull_answer_comes_at_its_tensors_wire_or_at_f32() {
        // Keys 0-1 of tensor "a" at bf16, key 2 of tensor "b" at f32 (the job's).
        let t = |name: &str, len| TensorSpec {
            name: name.into(),
            shape: vec![len],
            init: Init::Zeros,
        };
        let layout = KeyLayout::new(&[t("a", 8), t("b", 4)], 4);
        let wires = ["bf16".parse().expect("bf16"), WireSpec::default()];
        let mut out = [0f32; 12];
        {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out[..]);
            let each = Mutex::new(|key: Key, at: usize, part: &[u8]| {
                let off = layout.span(key).map_or(0, |s| s.offset as usize) * 4 + at;
                bytes[off..off + part.len()].copy_from_slice(part);
            });
            let mut sink = PullSink {
                wires: &wires,
                ranges: vec![KeyRange { start: 0, end: 3 }],
                wire: None,
                ..sink(&layout, &each)
            };
            // Key 2 at bf16 was not asked for; key 1 at f32 (a value past fp16, say) may be.
            let chunks = |w: [Wire; 3]| Response::Pulled {
                chunks: (0..3)
                    .map(|k| ChunkRef::new(Key(k), 4).coded(w[k as usize], false))
                    .collect(),
            };
            let e = (sink.header(&chunks([Wire::Bf16; 3]), 24)).expect_err("key 2 at f32");
            assert!(e.contains("at bf16, asked at f32"), "{e}");
            let answer = chunks([Wire::Bf16, Wire::F32, Wire::F32]);
            sink.header(&answer, 8 + 16 + 16).expect("asked for");
            let mut payload = BytesMut::new();
            encode_finite(&mut payload, &[1.5, -2.0, 0.25, 8.0], Wire::Bf16).expect("finite");
            extend_f32s(&mut payload, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
            for part in payload.chunks(3) {
                sink.part(Bytes::copy_from_slice(part));
            }
        }
        let want = [1.5, -2.0, 0.25, 8.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        assert_eq!(out, want);
    }

    #[test]
    fn a_pull_answer_that_does_not_fit_the_request_is_refused_before_its_payload() {
        let layout = layout();
        let each = Mutex::new(|_: Key, _: usize, _: &[u8]| panic!("nothing may be written"));
        let mut sink = sink(&layout, &each);
        let not_asked = sink.header(&pulled(&[0]), 16).expect_err("key 0 not asked");
        assert!(not_asked.contains("not asked for"), "{not_asked}");
        let wrong_len = Response::Pulled {
            chunks: vec![ChunkRef::new(Key(1), 3)],
        };
        assert!(sink.header(&wrong_len, 12).is_err());
        // An f32 pull answered at 16 bits.
        let Response::Pulled { chunks, .. } = pulled(&[1, 2]) else {
            unreachable!("pulled answers Pulled")
        };
        let narrow = Response::Pulled {
            chunks: chunks.iter().map(|c| c.coded(Wire::Bf16, false)).collect(),
        };
        let e = sink.header(&narrow, 16).expect_err("not asked at bf16");
        assert!(e.contains("bf16"), "{e}");
        let sparse = Response::Pulled {
            chunks: chunks.iter().map(|c| c.coded(Wire::F32, true)).collect(),
        };
        let e = sink.header(&sparse, 32).expect_err("pulls are dense");
        assert!(e.contains("sparse"), "{e}");
        let short = sink.header(&pulled(&[1, 2]), 31).expect_err("length");
        assert!(short.contains("31"), "{short}");
        let other = sink
            .header(&Response::Ack, 8)
            .expect_err("payload on an ack");
        assert!(other.contains("8 payload bytes"), "{other}");
        assert!(sink.header(&Response::Ack, 0).is_ok());
    }
}
