//! In-process network faults under quinn: a UDP socket wrapper that drops, delays, reorders,
//! duplicates and partitions datagrams according to a shared, seeded fault plan ([`Faults`]),
//! and limits bandwidth ([`Rate`]: a socket's datagrams leave its uplink one after another at
//! the link's rate, behind a drop-tail queue; held datagrams are released on tokio's
//! millisecond timer, so one may leave up to a millisecond early (one due within a
//! millisecond is sent at once) or late (one held is released on the timer's tick)).
//!
//! The kernels we test on have no `sch_netem`, so faults cannot come from the kernel; wrapping
//! the socket under quinn works anywhere, in CI too, and is deterministic in its decisions.
//!
//! # Where faults apply
//!
//! Faults apply on the **send side** only: a datagram meets its fate when a faulty socket sends
//! it. Delaying on the send side fits quinn's poll model: `try_send` can accept a datagram and
//! hand it to a timer queue that a tokio task drains through the inner socket later, whereas a
//! delay on the receive side would have to hide datagrams that `poll_recv` already has and
//! arrange its own wake-ups. It also means that one plan shared by every endpoint of an
//! in-process cluster applies each fault exactly once per datagram, and that in a cluster of
//! processes (each with `EDL_FAULTS`) every process faults its own outgoing traffic.
//!
//! A faulty socket reports `max_transmit_segments() == 1`, so quinn never batches datagrams
//! with segmentation offload (GSO) and every datagram meets its own fate; should a batch come
//! anyway, it is cut into its segments. Fault runs are slower for it, which does not matter.
//!
//! # Peers
//!
//! A [`Peer`] is a socket address, a name, or anyone. In an address, an unspecified IP
//! (`0.0.0.0`, `::`) matches any IP and port 0 matches any port, on either side of the match:
//! a client endpoint bound to `0.0.0.0:P` sends from its own point of view as `0.0.0.0:P`, and
//! its peers see it as `127.0.0.1:P`. Names map to addresses through [`Faults::name`], or
//! through [`Faults::labelled`]: every socket wrapped by a labelled handle registers its bound
//! address under the label, so a test can say "partition w1" without knowing its port.
//!
//! # Determinism
//!
//! Every wrapped socket draws its decisions from its own [`Dice`]: a `StdRng` seeded from the
//! plan's seed and the socket's creation order, drawing the same number of values for every
//! datagram. The same seed and the same sequence of datagrams give the same fates; which
//! datagrams quinn sends still depends on timing.
//!
//! # `EDL_FAULTS`
//!
//! [`FAULTS_ENV`] holds a spec for the binaries (see [`Faults::parse`]), for example
//! `seed=7,loss=0.02,delay=50ms,jitter=10ms,dup=0.01,partition=127.0.0.1:7001@5..10`.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use quinn::AsyncUdpSocket;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

mod socket;
mod spec;
#[cfg(test)]
mod tests;

pub use spec::FaultSpecError;

/// The environment variable holding a fault spec for every endpoint of a process.
pub const FAULTS_ENV: &str = "EDL_FAULTS";

/// One side of a link.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Peer {
    /// Everyone.
    Any,
    /// A socket address; an unspecified IP or port 0 is a wildcard.
    Addr(SocketAddr),
    /// The addresses registered under a name (none matches until one is registered).
    Name(String),
}

impl From<SocketAddr> for Peer {
    fn from(a: SocketAddr) -> Self {
        Peer::Addr(a)
    }
}

impl From<&str> for Peer {
    /// `*` is anyone, a text that parses as a socket address is that address, anything else
    /// is a name.
    fn from(s: &str) -> Self {
        let s = s.trim();
        if s == "*" {
            Peer::Any
        } else if let Ok(a) = s.parse() {
            Peer::Addr(a)
        } else {
            Peer::Name(s.to_string())
        }
    }
}

impl From<String> for Peer {
    fn from(s: String) -> Self {
        Peer::from(s.as_str())
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Any => f.write_str("*"),
            Peer::Addr(a) => write!(f, "{a}"),
            Peer::Name(n) => f.write_str(n),
        }
    }
}

/// What happens to datagrams on a link. The default is a clean link.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinkFaults {
    /// Probability that a datagram is lost.
    pub loss: f64,
    /// Fixed delay of every datagram.
    pub delay: Duration,
    /// Each datagram's delay is drawn uniformly from `delay ± jitter` (never below zero), so
    /// datagrams sent close together may overtake each other.
    pub jitter: Duration,
    /// Probability that a datagram is held `reorder_delay` longer than the others.
    pub reorder: f64,
    /// The extra delay of a reordered datagram.
    pub reorder_delay: Duration,
    /// Probability that a datagram is sent twice (the copy with its own delay).
    pub duplicate: f64,
    /// A bandwidth limit: the sending socket's datagrams on links with a rate leave it one
    /// after another at that rate, each held until its last bit is out (its uplink).
    pub rate: Option<Rate>,
}

/// A link's bandwidth and its queue: a datagram that would wait longer than `queue` behind
/// the ones already queued is dropped (a router's drop-tail buffer), so that congestion
/// control sees loss as on a real bottleneck.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    /// Bits per second.
    pub bits_per_s: u64,
    /// The longest a datagram may wait for the link.
    pub queue: Duration,
}

impl Rate {
    /// The default queue: 20 ms of waiting (2.5 MB at 1 Gbit/s).
    pub const DEFAULT_QUEUE: Duration = Duration::from_millis(20);

    /// How long `bytes` take to cross the link.
    pub fn serialize(&self, bytes: usize) -> Duration {
        Duration::from_secs_f64(bytes as f64 * 8.0 / self.bits_per_s.max(1) as f64)
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.bits_per_s as f64;
        let (x, unit) = if b >= 1e9 {
            (b / 1e9, "Gbit/s")
        } else if b >= 1e6 {
            (b / 1e6, "Mbit/s")
        } else {
            (b / 1e3, "kbit/s")
        };
        write!(f, "{x} {unit}, a {} ms queue", self.queue.as_millis())
    }
}

impl LinkFaults {
    /// A clean link.
    pub fn clean() -> Self {
        LinkFaults::default()
    }

    /// With this loss probability (clamped to 0..=1).
    pub fn with_loss(mut self, p: f64) -> Self {
        self.loss = probability(p);
        self
    }

    /// With this fixed delay and jitter.
    pub fn with_delay(mut self, delay: Duration, jitter: Duration) -> Self {
        self.delay = delay;
        self.jitter = jitter;
        self
    }

    /// With probability `p` (clamped to 0..=1) of holding a datagram `extra` longer.
    pub fn with_reorder(mut self, p: f64, extra: Duration) -> Self {
        self.reorder = probability(p);
        self.reorder_delay = extra;
        self
    }

    /// With this duplication probability (clamped to 0..=1).
    pub fn with_duplicate(mut self, p: f64) -> Self {
        self.duplicate = probability(p);
        self
    }

    /// Limited to `bits_per_s`, with a queue of [`Rate::DEFAULT_QUEUE`].
    pub fn with_rate(mut self, bits_per_s: u64) -> Self {
        self.rate = Some(Rate {
            bits_per_s,
            queue: Rate::DEFAULT_QUEUE,
        });
        self
    }
}

/// A probability from any float: NaN counts as 0.
fn probability(p: f64) -> f64 {
    if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) }
}

/// What becomes of one datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Dropped by a partition.
    Partitioned,
    /// Dropped by random loss.
    Lost,
    /// Delivered after `delay` (zero: sent at once), and a second time after `copy` when
    /// duplicated. `reordered` says the delay includes the reorder hold.
    Deliver {
        /// The delay of the datagram.
        delay: Duration,
        /// The delay of its duplicate, if any.
        copy: Option<Duration>,
        /// Whether the datagram was held back to be reordered.
        reordered: bool,
        /// The link's bandwidth, which the sending socket adds its queueing and serialization
        /// to the delay for.
        rate: Option<Rate>,
    },
}

/// Counters over every socket of a plan, readable by tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Datagrams quinn handed to faulty sockets.
    pub offered: u64,
    /// Datagrams handed to the real sockets, duplicates included.
    pub sent: u64,
    /// Datagrams dropped, by loss or by a partition.
    pub dropped: u64,
    /// Of `dropped`, those dropped by a partition.
    pub partitioned: u64,
    /// Datagrams held back before sending (delay, jitter or reorder).
    pub delayed: u64,
    /// Of `delayed`, those held back longer to be reordered.
    pub reordered: u64,
    /// Datagrams sent twice.
    pub duplicated: u64,
    /// Datagrams dropped at a full queue of a link with a rate (also in `dropped`).
    pub overflowed: u64,
}

#[derive(Debug, Default)]
struct Counters {
    offered: AtomicU64,
    sent: AtomicU64,
    dropped: AtomicU64,
    partitioned: AtomicU64,
    delayed: AtomicU64,
    reordered: AtomicU64,
    duplicated: AtomicU64,
    overflowed: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A partition between two peers, always or during a window of plan time.
#[derive(Clone, Debug)]
struct Cut {
    a: Peer,
    b: Peer,
    window: Option<(Duration, Duration)>,
}

#[derive(Debug, Default)]
struct Rules {
    default: LinkFaults,
    /// Per-link rules, the latest first to match winning.
    links: Vec<(Peer, Peer, LinkFaults)>,
    cuts: Vec<Cut>,
    names: HashMap<String, Vec<SocketAddr>>,
}

impl Rules {
    fn matches(&self, p: &Peer, a: SocketAddr) -> bool {
        match p {
            Peer::Any => true,
            Peer::Addr(x) => addr_matches(*x, a),
            Peer::Name(n) => self
                .names
                .get(n)
                .is_some_and(|v| v.iter().any(|x| addr_matches(*x, a))),
        }
    }

    fn link(&self, from: SocketAddr, to: SocketAddr) -> LinkFaults {
        self.links
            .iter()
            .rev()
            .find(|(f, t, _)| self.matches(f, from) && self.matches(t, to))
            .map_or(self.default, |(_, _, l)| *l)
    }

    fn cut(&self, from: SocketAddr, to: SocketAddr, at: Duration) -> bool {
        self.cuts.iter().any(|c| {
            let active = c.window.is_none_or(|(t0, t1)| t0 <= at && at < t1);
            active
                && ((self.matches(&c.a, from) && self.matches(&c.b, to))
                    || (self.matches(&c.b, from) && self.matches(&c.a, to)))
        })
    }
}

/// Whether the address pattern `p` names `a`; unspecified IPs and port 0 are wildcards on
/// either side (a socket bound to `0.0.0.0:P` is `127.0.0.1:P` to its loopback peers).
fn addr_matches(p: SocketAddr, a: SocketAddr) -> bool {
    let port = p.port() == 0 || a.port() == 0 || p.port() == a.port();
    let ip = p.ip().is_unspecified() || a.ip().is_unspecified() || same_ip(p.ip(), a.ip());
    port && ip
}

fn same_ip(a: IpAddr, b: IpAddr) -> bool {
    a.to_canonical() == b.to_canonical()
}

#[derive(Debug)]
struct Plan {
    seed: u64,
    start: Instant,
    rules: Mutex<Rules>,
    stats: Counters,
    streams: AtomicU64,
}

/// A shared, cloneable fault plan: link faults, partitions, names and statistics. Every clone
/// (and every socket wrapped with one) sees the same plan; changes apply at once.
#[derive(Clone, Debug)]
pub struct Faults {
    plan: Arc<Plan>,
    label: Option<Arc<str>>,
}

impl Faults {
    /// An empty plan (clean links, no partitions) whose decisions derive from `seed`. Plan
    /// time, used by scheduled partitions, starts now.
    pub fn new(seed: u64) -> Faults {
        Faults {
            plan: Arc::new(Plan {
                seed,
                start: Instant::now(),
                rules: Mutex::default(),
                stats: Counters::default(),
                streams: AtomicU64::new(0),
            }),
            label: None,
        }
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.plan.seed
    }

    /// Plan time: how long ago the plan was made.
    pub fn elapsed(&self) -> Duration {
        self.plan.start.elapsed()
    }

    fn rules(&self) -> MutexGuard<'_, Rules> {
        // The rules stay consistent whatever panicked while holding the lock.
        self.plan.rules.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A handle on the same plan whose wrapped sockets register their address under `name`.
    pub fn labelled(&self, name: &str) -> Faults {
        Faults {
            plan: self.plan.clone(),
            label: Some(Arc::from(name)),
        }
    }

    /// The label of this handle, if any.
    pub fn label(&self) -> Option<&str> {
        self.label.as_deref()
    }

    /// Registers `addr` under `name` (a name may hold several addresses).
    pub fn name(&self, name: &str, addr: SocketAddr) {
        let mut r = self.rules();
        let v = r.names.entry(name.to_string()).or_default();
        if !v.contains(&addr) {
            v.push(addr);
        }
    }

    /// The addresses registered under `name`.
    pub fn addrs_of(&self, name: &str) -> Vec<SocketAddr> {
        self.rules().names.get(name).cloned().unwrap_or_default()
    }

    /// Sets the faults of every link that no [`Faults::set_link`] rule matches.
    pub fn set_default(&self, faults: LinkFaults) {
        self.rules().default = faults;
    }

    /// Sets the faults of datagrams sent from `from` to `to` (one direction). The latest rule
    /// that matches a datagram wins over earlier ones and over the default.
    pub fn set_link(&self, from: impl Into<Peer>, to: impl Into<Peer>, faults: LinkFaults) {
        self.rules().links.push((from.into(), to.into(), faults));
    }

    /// Makes every link clean again (partitions stay).
    pub fn clear_links(&self) {
        let mut r = self.rules();
        r.default = LinkFaults::clean();
        r.links.clear();
    }

    /// Drops everything between `a` and `b`, both ways, until healed.
    pub fn partition(&self, a: impl Into<Peer>, b: impl Into<Peer>) {
        self.add_cut(a.into(), b.into(), None);
    }

    /// Drops everything between `a` and everyone else until healed.
    pub fn isolate(&self, a: impl Into<Peer>) {
        self.add_cut(a.into(), Peer::Any, None);
    }

    /// Drops everything between `a` and `b` from plan time `from` until `to`.
    pub fn partition_during(
        &self,
        a: impl Into<Peer>,
        b: impl Into<Peer>,
        from: Duration,
        to: Duration,
    ) {
        self.add_cut(a.into(), b.into(), Some((from, to)));
    }

    fn add_cut(&self, a: Peer, b: Peer, window: Option<(Duration, Duration)>) {
        self.rules().cuts.push(Cut { a, b, window });
    }

    /// Removes the partitions between `a` and `b` (in either order), scheduled ones too. To
    /// heal an [`Faults::isolate`], pass [`Peer::Any`] (`"*"`) as `b`.
    pub fn heal(&self, a: impl Into<Peer>, b: impl Into<Peer>) {
        let (a, b) = (a.into(), b.into());
        self.rules()
            .cuts
            .retain(|c| !((c.a == a && c.b == b) || (c.a == b && c.b == a)));
    }

    /// Removes every partition, scheduled ones too.
    pub fn heal_all(&self) {
        self.rules().cuts.clear();
    }

    /// Whether a datagram from `from` to `to` would be dropped by a partition now.
    pub fn is_partitioned(&self, from: SocketAddr, to: SocketAddr) -> bool {
        self.rules().cut(from, to, self.elapsed())
    }

    /// The counters so far, over every socket of the plan.
    pub fn stats(&self) -> FaultStats {
        let c = &self.plan.stats;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FaultStats {
            offered: r(&c.offered),
            sent: r(&c.sent),
            dropped: r(&c.dropped),
            partitioned: r(&c.partitioned),
            delayed: r(&c.delayed),
            reordered: r(&c.reordered),
            duplicated: r(&c.duplicated),
            overflowed: r(&c.overflowed),
        }
    }

    /// A new decision stream: stream `n` of a plan draws the same values for every plan with
    /// the same seed. Wrapped sockets take the next stream each.
    pub fn dice(&self, stream: u64) -> Dice {
        // Spread the stream number over the seed's bits so neighbouring streams differ.
        let seed = self
            .plan
            .seed
            .wrapping_add(stream.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        Dice {
            faults: self.clone(),
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// Wraps `inner` so that its outgoing datagrams meet this plan's faults, and registers its
    /// bound address under this handle's label. Must run inside a tokio runtime: a task per
    /// socket sends the delayed datagrams.
    pub fn wrap(&self, inner: Arc<dyn AsyncUdpSocket>) -> io::Result<Arc<dyn AsyncUdpSocket>> {
        socket::wrap(self, inner)
    }
}

/// A seeded stream of fault decisions over a plan.
#[derive(Debug)]
pub struct Dice {
    faults: Faults,
    rng: StdRng,
}

impl Dice {
    /// The fate of a datagram from `from` to `to` sent now.
    pub fn fate(&mut self, from: SocketAddr, to: SocketAddr) -> Fate {
        let at = self.faults.elapsed();
        self.fate_at(from, to, at)
    }

    /// The fate of a datagram from `from` to `to` sent at plan time `at`. Every call draws the
    /// same number of values whatever the faults, so a change of rules between two calls does
    /// not shift the decisions of later ones.
    pub fn fate_at(&mut self, from: SocketAddr, to: SocketAddr, at: Duration) -> Fate {
        let rolls: [f64; 5] = std::array::from_fn(|_| self.rng.random::<f64>());
        let [lose, jitter, reorder, dup, copy_jitter] = rolls;
        let (link, cut) = {
            let r = self.faults.rules();
            (r.link(from, to), r.cut(from, to, at))
        };
        if cut {
            return Fate::Partitioned;
        }
        if lose < link.loss {
            return Fate::Lost;
        }
        let reordered = reorder < link.reorder;
        let delay_of = |roll: f64| {
            // Uniform in delay ± jitter, never below zero.
            let spread = link.jitter.as_secs_f64() * (2.0 * roll - 1.0);
            let mut d = Duration::from_secs_f64((link.delay.as_secs_f64() + spread).max(0.0));
            if reordered {
                d += link.reorder_delay;
            }
            d
        };
        Fate::Deliver {
            delay: delay_of(jitter),
            copy: (dup < link.duplicate).then(|| delay_of(copy_jitter)),
            reordered: reordered && !link.reorder_delay.is_zero(),
            rate: link.rate,
        }
    }
}
