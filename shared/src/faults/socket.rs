//! The faulty socket: decides each outgoing datagram's fate, sends it at once or holds it for
//! a task that sends it when due.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use quinn::udp::{EcnCodepoint, RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Dice, Fate, Faults, Rate, bump};

/// See [`Faults::wrap`].
pub(super) fn wrap(
    faults: &Faults,
    inner: Arc<dyn AsyncUdpSocket>,
) -> io::Result<Arc<dyn AsyncUdpSocket>> {
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| io::Error::other("fault layer needs a tokio runtime"))?;
    let local = inner.local_addr()?;
    if let Some(label) = &faults.label {
        faults.name(label, local);
    }
    let (tx, rx) = mpsc::unbounded_channel();
    runtime.spawn(deliver_later(inner.clone(), faults.clone(), rx));
    let stream = faults.plan.streams.fetch_add(1, Ordering::Relaxed);
    Ok(Arc::new(FaultySocket {
        inner,
        faults: faults.clone(),
        local,
        dice: Mutex::new(faults.dice(stream)),
        later: tx,
        seq: AtomicU64::new(0),
        uplink: Mutex::new(None),
    }))
}

/// A datagram held back until `due`.
#[derive(Debug)]
struct Held {
    due: Instant,
    seq: u64,
    to: SocketAddr,
    ecn: Option<EcnCodepoint>,
    src_ip: Option<IpAddr>,
    data: Vec<u8>,
}

impl PartialEq for Held {
    fn eq(&self, o: &Self) -> bool {
        (self.due, self.seq) == (o.due, o.seq)
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Held {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.due, self.seq).cmp(&(o.due, o.seq))
    }
}

/// Sends held datagrams through `inner` when they fall due, in order of due time (ties in
/// order of sending). Ends when the faulty socket is dropped.
async fn deliver_later(
    inner: Arc<dyn AsyncUdpSocket>,
    faults: Faults,
    mut rx: mpsc::UnboundedReceiver<Held>,
) {
    let mut heap: BinaryHeap<Reverse<Held>> = BinaryHeap::new();
    let mut poller = inner.clone().create_io_poller();
    loop {
        let next = heap.peek().map(|Reverse(h)| h.due);
        tokio::select! {
            held = rx.recv() => match held {
                Some(h) => heap.push(Reverse(h)),
                None => return,
            },
            _ = tokio::time::sleep_until(next.unwrap_or_else(Instant::now)), if next.is_some() => {
                let now = Instant::now();
                while heap.peek().is_some_and(|Reverse(h)| h.due <= now) {
                    let Some(Reverse(h)) = heap.pop() else { break };
                    send_held(&*inner, &mut poller, &faults, &h).await;
                }
            }
        }
    }
}

async fn send_held(
    inner: &dyn AsyncUdpSocket,
    poller: &mut Pin<Box<dyn UdpPoller>>,
    faults: &Faults,
    h: &Held,
) {
    let t = Transmit {
        destination: h.to,
        ecn: h.ecn,
        contents: &h.data,
        segment_size: None,
        src_ip: h.src_ip,
    };
    loop {
        match inner.try_send(&t) {
            Ok(()) => return bump(&faults.plan.stats.sent),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if std::future::poll_fn(|cx| poller.as_mut().poll_writable(cx))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            // Any other error loses the datagram, as the network would.
            Err(_) => return,
        }
    }
}

/// The resolution of tokio's timer, which releases held datagrams.
const TIMER_TICK: Duration = Duration::from_millis(1);

/// A UDP socket whose outgoing datagrams meet a fault plan.
#[derive(Debug)]
struct FaultySocket {
    inner: Arc<dyn AsyncUdpSocket>,
    faults: Faults,
    local: SocketAddr,
    dice: Mutex<Dice>,
    later: mpsc::UnboundedSender<Held>,
    /// Orders held datagrams due at the same instant by the order they were sent in.
    seq: AtomicU64,
    /// When the last datagram queued for a link with a rate will have left: the socket's
    /// uplink, shared by its datagrams to every peer.
    uplink: Mutex<Option<Instant>>,
}

impl FaultySocket {
    /// Queues a datagram of `bytes` on the uplink at `rate`: how long to hold it, until its
    /// last bit is out, or `None` when the queue is full (it is dropped). One whose last bit
    /// is out within [`TIMER_TICK`] leaves at once, up to a tick early, instead of on the
    /// timer's next tick, up to a tick late: on an idle fast link a small datagram crosses in
    /// microseconds, not a millisecond, and the datagrams after it still wait their turn (a
    /// token bucket a tick of the rate deep).
    fn queue(&self, rate: Rate, bytes: usize) -> Option<Duration> {
        let now = Instant::now();
        let mut free = self.uplink.lock().unwrap_or_else(|p| p.into_inner());
        let start = free.map_or(now, |f| f.max(now));
        if start - now > rate.queue {
            return None;
        }
        let done = start + rate.serialize(bytes);
        *free = Some(done);
        let wait = done - now;
        Some(if wait < TIMER_TICK {
            Duration::ZERO
        } else {
            wait
        })
    }

    fn hold(&self, t: &Transmit, delay: Duration) {
        let h = Held {
            due: Instant::now() + delay,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            to: t.destination,
            ecn: t.ecn,
            src_ip: t.src_ip,
            data: t.contents.to_vec(),
        };
        // A closed queue means the runtime is shutting down: the datagram is lost.
        let _ = self.later.send(h);
    }

    /// Sends one datagram (no segments) according to its fate. `WouldBlock` is returned only
    /// for a datagram to be sent at once, before any counter moved.
    fn send_one(&self, t: &Transmit) -> io::Result<()> {
        let fate = self
            .dice
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .fate(self.local, t.destination);
        let c = &self.faults.plan.stats;
        match fate {
            Fate::Partitioned | Fate::Lost => {
                bump(&c.offered);
                bump(&c.dropped);
                if fate == Fate::Partitioned {
                    bump(&c.partitioned);
                }
            }
            Fate::Deliver {
                mut delay,
                copy,
                reordered,
                rate,
            } => {
                if let Some(rate) = rate {
                    let Some(wait) = self.queue(rate, t.contents.len()) else {
                        bump(&c.offered);
                        bump(&c.dropped);
                        bump(&c.overflowed);
                        return Ok(());
                    };
                    delay += wait;
                }
                if delay.is_zero() {
                    self.inner.try_send(t)?;
                    bump(&c.sent);
                } else {
                    self.hold(t, delay);
                    bump(&c.delayed);
                    if reordered {
                        bump(&c.reordered);
                    }
                }
                bump(&c.offered);
                if let Some(d) = copy {
                    bump(&c.duplicated);
                    // A copy crosses the uplink too, or is lost at a full queue.
                    match rate.map(|r| self.queue(r, t.contents.len())) {
                        Some(None) => {
                            bump(&c.dropped);
                            bump(&c.overflowed);
                        }
                        Some(Some(wait)) => self.hold(t, d + wait),
                        None => self.hold(t, d),
                    }
                }
            }
        }
        Ok(())
    }
}

impl AsyncUdpSocket for FaultySocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, t: &Transmit) -> io::Result<()> {
        let seg = t.segment_size.unwrap_or(t.contents.len()).max(1);
        if t.contents.len() <= seg {
            return self.send_one(t);
        }
        // quinn should not batch (max_transmit_segments is 1). If it does, each segment meets
        // its own fate; a segment that would block is held for the queue instead, since
        // returning WouldBlock now would make quinn send the earlier segments again.
        for chunk in t.contents.chunks(seg) {
            let one = Transmit {
                contents: chunk,
                segment_size: None,
                ..*t
            };
            match self.send_one(&one) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.hold(&one, Duration::ZERO);
                }
                other => other?,
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [io::IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        1
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}
