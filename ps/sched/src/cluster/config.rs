//! The cluster file: the pool of worker slots and how jobs run on it.
//!
//! ```toml
//! policy = "elastic"        # fifo | tiresias | elastic | goodput
//! shards = 1                # shard servers per job
//! resize_interval = "5s"    # the least time between two resizes of one job
//! resize_overhead = 0.25    # and at most this share of its time spent growing
//! operators = ["ops"]       # admin certificate names that may cancel any job
//! data_dir = "/usr/share/datasets/fashion-mnist"  # workers' data when a job names none
//! worker_args = []          # extra edl-worker arguments for every worker
//! slots = 4                 # slot0..slot3 on this host, or name each:
//! # [[slot]]
//! # name = "gpu0"
//! # host = "localhost"
//! # gpu = 0                 # its worker sees this device alone (CUDA_VISIBLE_DEVICES)
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use serde::Deserialize;

/// The most slots a cluster file may declare.
pub const MAX_SLOTS: u32 = 4096;
/// The most shard servers per job.
pub const MAX_SHARDS: u32 = 64;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    policy: Option<String>,
    shards: Option<u32>,
    resize_interval: Option<String>,
    resize_overhead: Option<f64>,
    tiresias_threshold: Option<String>,
    operators: Option<Vec<String>>,
    data_dir: Option<PathBuf>,
    worker_args: Option<Vec<String>>,
    slots: Option<u32>,
    slot: Option<Vec<RawSlot>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSlot {
    name: String,
    host: Option<String>,
    gpu: Option<u32>,
}

pub use edl_launch::{LOCAL_HOST, Slot};

/// A checked cluster file.
#[derive(Clone, Debug)]
pub struct Cluster {
    /// The policy's name (see [`crate::policy::by_name`]).
    pub policy: String,
    /// Shard servers per job.
    pub shards: u32,
    /// The least time between two resizes of one job.
    pub resize_interval: Duration,
    /// The most of a job's time its growths may cost: after a growth that took `c` to
    /// complete, the job is not resized again for `c / resize_overhead` from its start.
    pub resize_overhead: f64,
    /// Tiresias: the slot-time after which a job drops to the second queue.
    pub tiresias_threshold: Duration,
    /// Admin certificate names that may cancel any job.
    pub operators: Vec<String>,
    /// Where workers read Fashion-MNIST when a job names no data.
    pub data_dir: PathBuf,
    /// Extra arguments for every worker.
    pub worker_args: Vec<String>,
    /// The slots.
    pub slots: Vec<Slot>,
}

impl Cluster {
    /// Reads and checks a cluster file.
    pub fn load(path: &Path) -> anyhow::Result<Cluster> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Cluster::parse(&text).with_context(|| format!("cluster file {}", path.display()))
    }

    /// Parses and checks a cluster file's text.
    pub fn parse(text: &str) -> anyhow::Result<Cluster> {
        let raw: Raw = toml::from_str(text)?;
        let policy = raw.policy.unwrap_or_else(|| "elastic".into());
        if crate::policy::by_name(&policy).is_none() {
            bail!("policy: unknown policy {policy:?} (fifo, tiresias, elastic or goodput)");
        }
        let shards = raw.shards.unwrap_or(1);
        if !(1..=MAX_SHARDS).contains(&shards) {
            bail!("shards: {shards} is not in 1..={MAX_SHARDS}");
        }
        let duration = |field: &str, v: Option<String>, default: Duration| match v {
            Some(s) => humantime::parse_duration(&s)
                .with_context(|| format!("{field}: {s:?} is not a duration such as 5s or 1h")),
            None => Ok(default),
        };
        let resize_overhead = raw.resize_overhead.unwrap_or(0.25);
        if !(resize_overhead > 0.0 && resize_overhead <= 1.0) {
            bail!("resize_overhead: {resize_overhead} is not in (0, 1]");
        }
        let slots = match (raw.slots, raw.slot) {
            (Some(_), Some(_)) => bail!("give either slots = N or [[slot]] tables, not both"),
            (None, None) => bail!("no slots: give slots = N or [[slot]] tables"),
            (Some(n), None) => {
                if !(1..=MAX_SLOTS).contains(&n) {
                    bail!("slots: {n} is not in 1..={MAX_SLOTS}");
                }
                (0..n)
                    .map(|i| Slot {
                        name: format!("slot{i}"),
                        host: LOCAL_HOST.into(),
                        devices: None,
                    })
                    .collect()
            }
            (None, Some(list)) => {
                if list.is_empty() || list.len() > MAX_SLOTS as usize {
                    bail!("slot: give 1..={MAX_SLOTS} slots");
                }
                let mut out: Vec<Slot> = Vec::new();
                for s in list {
                    edl_shared::pki::check_label("slot name", &s.name)
                        .map_err(|e| anyhow::anyhow!("slot: {e}"))?;
                    if out.iter().any(|o| o.name == s.name) {
                        bail!("slot: {:?} is declared twice", s.name);
                    }
                    out.push(Slot {
                        name: s.name,
                        host: s.host.unwrap_or_else(|| LOCAL_HOST.into()),
                        devices: s.gpu.map(|g| vec![g]),
                    });
                }
                out
            }
        };
        Ok(Cluster {
            policy,
            shards,
            resize_interval: duration(
                "resize_interval",
                raw.resize_interval,
                Duration::from_secs(5),
            )?,
            resize_overhead,
            tiresias_threshold: duration(
                "tiresias_threshold",
                raw.tiresias_threshold,
                Duration::from_secs(3600),
            )?,
            operators: raw.operators.unwrap_or_default(),
            data_dir: raw
                .data_dir
                .unwrap_or_else(|| PathBuf::from("/usr/share/datasets/fashion-mnist")),
            worker_args: raw.worker_args.unwrap_or_default(),
            slots,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_and_named_slots() {
        let c = Cluster::parse("slots = 3").expect("parse");
        assert_eq!(c.slots.len(), 3);
        assert_eq!(c.slots[2].name, "slot2");
        assert_eq!(c.policy, "elastic");
        let c = Cluster::parse(
            "policy = \"fifo\"\n[[slot]]\nname = \"gpu0\"\nhost = \"a\"\n[[slot]]\nname = \"gpu1\"",
        )
        .expect("parse");
        assert_eq!(c.slots[0].host, "a");
        assert_eq!(c.slots[1].host, LOCAL_HOST);
    }

    #[test]
    fn mistakes_are_named() {
        for (text, says) in [
            ("", "no slots"),
            ("slots = 0", "slots: 0"),
            ("slots = 2\npolicy = \"lifo\"", "unknown policy"),
            ("slots = 2\nshards = 0", "shards"),
            ("slots = 2\nresize_interval = \"soon\"", "resize_interval"),
            ("slots = 2\nresize_overhead = 0", "resize_overhead"),
            ("slots = 2\nslotz = 3", "slotz"),
            ("[[slot]]\nname = \"a\"\n[[slot]]\nname = \"a\"", "twice"),
            ("[[slot]]\nname = \"a b\"", "slot"),
        ] {
            let err = format!("{:#}", Cluster::parse(text).expect_err(text));
            assert!(err.contains(says), "{text:?}: {err}");
        }
    }
}
