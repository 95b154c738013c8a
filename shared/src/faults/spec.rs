//! Fault specs (`EDL_FAULTS`): parsing into a plan, and the process-wide plan of the
//! environment.

use std::sync::OnceLock;
use std::time::Duration;

use thiserror::Error;

use super::{Cut, FAULTS_ENV, Faults, LinkFaults, Peer, Rate};

impl Faults {
    /// Parses a fault spec: comma-separated `key=value` items.
    ///
    /// - `seed=N`: the seed (default 0).
    /// - `loss=P`, `dup=P`, `reorder=P`: probabilities from 0 to 1 for every link.
    /// - `delay=D`, `jitter=D`, `reorder_delay=D` (default 10ms): durations with a unit, `us`,
    ///   `ms` or `s` (`50ms`, `1.5s`).
    /// - `rate=R`: every socket's uplink limited to `R` bits per second (`kbit`, `mbit` or
    ///   `gbit`: `100mbit`, `1gbit`), with `queue=D` (default 20ms) the longest a datagram
    ///   waits for it before it is dropped.
    /// - `partition=A[/B][@FROM..TO]`, repeatable: drop everything between `A` and `B`
    ///   (everyone when `B` is left out) from `FROM` to `TO` seconds of plan time (plan time
    ///   starts when the spec is read: for `EDL_FAULTS`, as the process sets up its first
    ///   endpoint). `FROM..` never ends; without `@` the partition is permanent. Peers are
    ///   socket addresses (`127.0.0.1:7001`, `[::1]:7001`; IP `0.0.0.0` or port 0 are
    ///   wildcards) or `*`.
    ///
    /// An empty spec, `off` or `none` mean no faults (`Ok(None)`).
    pub fn parse(spec: &str) -> Result<Option<Faults>, FaultSpecError> {
        let spec = spec.trim();
        if spec.is_empty() || spec == "off" || spec == "none" {
            return Ok(None);
        }
        let mut seed = 0;
        let mut link = LinkFaults {
            reorder_delay: Duration::from_millis(10),
            ..LinkFaults::default()
        };
        let mut cuts = Vec::new();
        let mut queue = None;
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let bad = |why: &str| FaultSpecError::Item {
                item: item.to_string(),
                why: why.to_string(),
            };
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| bad("expected key=value"))?;
            let value = value.trim();
            match key.trim() {
                "seed" => seed = value.parse().map_err(|_| bad("not an unsigned integer"))?,
                "loss" => link.loss = parse_probability(value).map_err(bad)?,
                "dup" => link.duplicate = parse_probability(value).map_err(bad)?,
                "reorder" => link.reorder = parse_probability(value).map_err(bad)?,
                "delay" => link.delay = parse_duration(value).map_err(bad)?,
                "jitter" => link.jitter = parse_duration(value).map_err(bad)?,
                "reorder_delay" => link.reorder_delay = parse_duration(value).map_err(bad)?,
                "partition" => cuts.push(parse_cut(value).map_err(bad)?),
                "rate" => link.rate = Some(value.parse().map_err(|e: String| bad(&e))?),
                "queue" => queue = Some(parse_duration(value).map_err(bad)?),
                _ => return Err(bad("unknown key")),
            }
        }
        if let Some(queue) = queue {
            let rate = link.rate.as_mut().ok_or(FaultSpecError::Item {
                item: format!("queue={queue:?}"),
                why: "a queue belongs to a rate: give rate= too".into(),
            })?;
            rate.queue = queue;
        }
        let faults = Faults::new(seed);
        faults.set_default(link);
        for c in cuts {
            faults.add_cut(c.a, c.b, c.window);
        }
        Ok(Some(faults))
    }

    /// The plan of [`FAULTS_ENV`], read once per process and shared by every endpoint. A
    /// malformed spec is refused (no faults) with an error printed once.
    pub fn from_env() -> Option<Faults> {
        static ENV: OnceLock<Option<Faults>> = OnceLock::new();
        ENV.get_or_init(|| {
            let spec = std::env::var(FAULTS_ENV).ok()?;
            match Faults::parse(&spec) {
                Ok(f) => {
                    if f.is_some() {
                        // Loud on purpose: a process under faults must never pass for a
                        // healthy one. Printed as well as logged, as tracing may not be set up.
                        eprintln!("{FAULTS_ENV}: network faults injected: {spec}");
                        tracing::warn!(spec = %spec, "network faults injected ({FAULTS_ENV})");
                    }
                    f
                }
                Err(e) => {
                    // Printed as well as logged: tracing may not be set up yet.
                    eprintln!("{FAULTS_ENV} refused, running without faults: {e}");
                    tracing::error!(error = %e, "{FAULTS_ENV} refused, running without faults");
                    None
                }
            }
        })
        .clone()
    }
}

/// Why a fault spec was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FaultSpecError {
    /// An item of the spec is malformed.
    #[error("bad fault spec item {item:?}: {why}")]
    Item {
        /// The item as written.
        item: String,
        /// What is wrong with it.
        why: String,
    },
}

fn parse_probability(v: &str) -> Result<f64, &'static str> {
    match v.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err("not a probability from 0 to 1"),
    }
}

impl std::str::FromStr for Rate {
    type Err = String;

    /// A rate in `kbit`, `mbit` or `gbit` (per second: `1gbit`, `2.5Mbit/s`, `64kbps`), with
    /// the default queue.
    fn from_str(s: &str) -> Result<Rate, String> {
        Ok(Rate {
            bits_per_s: parse_rate(s).map_err(str::to_string)?,
            queue: Rate::DEFAULT_QUEUE,
        })
    }
}

fn parse_rate(v: &str) -> Result<u64, &'static str> {
    let v = v.trim().to_ascii_lowercase();
    let v = v.strip_suffix("/s").unwrap_or(&v);
    // `kbps` and the like: bits per second too.
    let v = match v.strip_suffix("bps") {
        Some(n) => format!("{n}bit"),
        None => v.to_string(),
    };
    let (num, scale) = if let Some(n) = v.strip_suffix("gbit") {
        (n, 1e9)
    } else if let Some(n) = v.strip_suffix("mbit") {
        (n, 1e6)
    } else if let Some(n) = v.strip_suffix("kbit") {
        (n, 1e3)
    } else {
        return Err("a rate needs a unit: kbit, mbit or gbit (e.g. 1gbit)");
    };
    match num.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x * scale >= 1000.0 && x * scale < 1e13 => Ok((x * scale) as u64),
        _ => Err("a rate is a number from 1kbit to 10000gbit"),
    }
}

fn parse_duration(v: &str) -> Result<Duration, &'static str> {
    let (num, scale) = if let Some(n) = v.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1.0)
    } else {
        return Err("a duration needs a unit: us, ms or s");
    };
    seconds(num, scale)
}

fn seconds(num: &str, scale: f64) -> Result<Duration, &'static str> {
    match num.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => {
            Duration::try_from_secs_f64(x * scale).map_err(|_| "duration out of range")
        }
        _ => Err("not a non-negative number"),
    }
}

fn parse_cut(v: &str) -> Result<Cut, &'static str> {
    let (peers, window) = match v.split_once('@') {
        Some((p, w)) => (p, Some(w)),
        None => (v, None),
    };
    let peer = |s: &str| -> Result<Peer, &'static str> {
        match Peer::from(s) {
            Peer::Name(_) => Err("a peer is a socket address or *"),
            p => Ok(p),
        }
    };
    let (a, b) = match peers.split_once('/') {
        Some((a, b)) => (peer(a)?, peer(b)?),
        None => (peer(peers)?, Peer::Any),
    };
    let window = match window {
        None => None,
        Some(w) => {
            let (from, to) = w
                .split_once("..")
                .ok_or("a window is FROM..TO in seconds")?;
            let from = seconds(from.trim_end_matches('s'), 1.0)?;
            let to = match to.trim() {
                "" => Duration::MAX,
                t => seconds(t.trim_end_matches('s'), 1.0)?,
            };
            if to <= from {
                return Err("a window must end after it starts");
            }
            Some((from, to))
        }
    };
    Ok(Cut { a, b, window })
}
