//! Tables for the terminal, and `BENCHMARKS.md` with its plots.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use serde::Serialize;

use crate::{apply, control, elastic, load, scale, transport, tta};

pub use edl_shared::transport::LOOPBACK_DATAGRAM;

/// Everything `edl-bench all` measures.
#[derive(Debug, Serialize)]
pub struct All {
    /// The machine, in words.
    pub machine: String,
    /// Transport with the default datagrams (path-MTU discovery, safe on any network).
    pub transport_default: transport::Results,
    /// Transport with large datagrams (loopback, jumbo frames).
    pub transport_loopback: transport::Results,
    /// How long the whole run took, seconds.
    pub seconds: f64,
    /// Optimizer apply against memcpy.
    pub apply: Vec<apply::Row>,
    /// Synthetic scaling.
    pub scale: scale::Results,
    /// Membership changes, stop-free and with restarts.
    pub elastic: elastic::Results,
    /// Time to accuracy.
    pub tta: tta::Results,
}

/// CPU model, core count and kernel, read from /proc.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or("unknown CPU", str::trim)
        .to_string();
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{model}, {cores} cores, Linux {}", kernel.trim())
}

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY).set_header(header.to_vec());
    t
}

/// A byte count as KiB/MiB.
pub fn size(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{} MiB", n >> 20)
    } else {
        format!("{} KiB", n >> 10)
    }
}

/// Gbit/s from GB/s.
fn gbit(gbps: f64) -> f64 {
    gbps * 8.0
}

/// The transport results, one row per point, the systems side by side.
pub fn transport_table(r: &transport::Results) -> String {
    let mut t = table(&[
        "size",
        "clients×shards",
        "EDL Gbit/s",
        "no-opt Gbit/s",
        "quinn Gbit/s",
        "TCP Gbit/s",
        "EDL/quinn",
        "EDL/TCP",
        "EDL p50/p99 µs",
        "quinn p50 µs",
        "TCP p50 µs",
    ]);
    for ratio in &r.ratios {
        let get = |sys: &str| {
            r.rows.iter().find(|x| {
                x.system == sys
                    && x.size == ratio.size
                    && x.clients == ratio.clients
                    && x.shards == ratio.shards
            })
        };
        let (Some(e), Some(q), Some(c)) = (get("edl"), get("quinn"), get("tcp")) else {
            continue;
        };
        t.add_row(vec![
            size(ratio.size),
            format!("{}×{}", ratio.clients, ratio.shards),
            format!("{:.1}", gbit(e.gbps)),
            get("edl-noopt").map_or("-".into(), |n| format!("{:.1}", gbit(n.gbps))),
            format!("{:.1}", gbit(q.gbps)),
            format!("{:.1}", gbit(c.gbps)),
            format!("{:.2}", ratio.edl_over_quinn),
            format!("{:.2}", ratio.edl_over_tcp),
            format!("{:.0} / {:.0}", e.p50_us, e.p99_us),
            format!("{:.0}", q.p50_us),
            format!("{:.0}", c.p50_us),
        ]);
    }
    if r.ratios.is_empty() {
        for x in &r.rows {
            t.add_row(vec![
                size(x.size),
                format!("{}×{} {}", x.clients, x.shards, x.system),
                format!("{:.1}", gbit(x.gbps)),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                format!("{:.0} / {:.0}", x.p50_us, x.p99_us),
            ]);
        }
    }
    let found: Vec<u16> = r.rows.iter().filter_map(|x| x.datagram).collect();
    let dg = match (r.datagram, found.iter().min(), found.iter().max()) {
        (Some(n), _, _) => format!("{n}-byte datagrams"),
        (None, Some(lo), Some(hi)) if lo == hi => {
            format!("path-MTU discovery (settled at {lo}-byte datagrams)")
        }
        (None, Some(lo), Some(hi)) => {
            format!("path-MTU discovery (settled at {lo}-{hi}-byte datagrams)")
        }
        _ => "path-MTU discovery".to_string(),
    };
    let link = r.link.as_deref().unwrap_or("loopback");
    format!(
        "transport, push+pull pairs over {link}, {dg}, AES-GCM from {}:\n{t}",
        r.aead
    )
}

/// The apply results.
pub fn apply_table(rows: &[apply::Row]) -> String {
    let mut t = table(&["optimizer", "floats", "GB/s", "memcpy GB/s", "ratio"]);
    for r in rows {
        t.add_row(vec![
            r.optimizer.clone(),
            r.floats.to_string(),
            format!("{:.2}", r.gbps),
            format!("{:.2}", r.memcpy_gbps),
            format!("{:.2}", r.ratio),
        ]);
    }
    format!("optimizer apply (parameter + gradient bytes):\n{t}")
}

/// The scaling results, one row per point, series by series, each with its transport
/// ceiling.
pub fn scale_table(r: &scale::Results) -> String {
    let mut t = table(&[
        "series",
        "workers",
        "steps/s",
        "samples/s",
        "Gbit/s",
        "step ms",
        "efficiency",
        "load",
        "",
    ]);
    for x in &r.rows {
        t.add_row(vec![
            x.series(),
            x.workers.to_string(),
            format!("{:.1}", x.steps_per_s),
            format!("{:.0}", x.samples_per_s),
            format!("{:.2}", x.gbit_s),
            format!("{:.1}", x.step_ms),
            format!("{:.0}%", x.efficiency * 100.0),
            format!("{:.0}%", x.load * 100.0),
            if x.saturated { "saturated" } else { "" }.to_string(),
        ]);
    }
    let mut c = table(&["series", "workers", "steps/s", "Gbit/s"]);
    for x in &r.ceilings {
        c.add_row(vec![
            format!(
                "{} shard{} {} {}",
                x.shards,
                if x.shards == 1 { "" } else { "s" },
                x.mode.name(),
                x.consistency
            ),
            x.workers.to_string(),
            format!("{:.1}", x.steps_per_s),
            format!("{:.2}", x.gbit_s),
        ]);
    }
    let mut h = table(&["series", "workers", "efficiency", "load"]);
    for x in r.last_unsaturated() {
        h.add_row(vec![
            x.series(),
            x.workers.to_string(),
            format!("{:.0}%", x.efficiency * 100.0),
            format!("{:.0}%", x.load * 100.0),
        ]);
    }
    format!(
        "scale, {} model in {} keys, {:.0} ms compute per step:\n{t}\n\
         transport ceiling (the same loop without compute):\n{c}\n\
         the most workers before saturation:\n{h}",
        size(r.model_bytes),
        r.keys,
        r.compute_ms,
    )
}

fn opt_ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.0}"))
}

/// The elastic results: per mode and kind of change, the stall and the join latency, with the
/// stall measure at moments without a change beside them.
pub fn elastic_table(r: &elastic::Results) -> String {
    let mut t = table(&[
        "membership",
        "change",
        "count",
        "stall ms (median / max)",
        "join latency ms",
        "step ms",
        "noise ms (median / p90)",
    ]);
    for run in &r.runs {
        for s in &run.summary {
            t.add_row(vec![
                run.membership.name().to_string(),
                s.kind.clone(),
                s.count.to_string(),
                format!("{} / {}", opt_ms(s.median_stall_ms), opt_ms(s.max_stall_ms)),
                opt_ms(s.median_join_ms),
                opt_ms(s.median_step_ms),
                run.noise.as_ref().map_or("-".into(), |n| {
                    format!("{:.0} / {:.0}", n.median_stall_ms, n.p90_stall_ms)
                }),
            ]);
        }
    }
    let mut e = table(&[
        "membership",
        "change",
        "worker",
        "stall ms",
        "join latency ms",
        "admitted → first step ms",
        "restart: checkpoint / stop / start ms",
    ]);
    for run in &r.runs {
        for x in &run.events {
            e.add_row(vec![
                run.membership.name().to_string(),
                x.kind.clone(),
                x.worker.clone(),
                opt_ms(x.stall_ms),
                opt_ms(x.join_ms),
                opt_ms(x.admitted_ms),
                x.restart
                    .map_or("-".into(), |[c, s, b]| format!("{c:.0} / {s:.0} / {b:.0}")),
            ]);
        }
    }
    format!(
        "elastic, {} workers of a {} model ({:.0} ms compute), {} shards, {}:\n{t}\n\
         every change:\n{e}",
        r.workers,
        size(r.model_bytes),
        r.compute_ms,
        r.shards,
        r.consistency
    )
}

/// The time-to-accuracy results, one row per consistency model, worker count and wire (a
/// wire column only when there are several, or one that is not f32).
pub fn tta_table(r: &tta::Results) -> String {
    let wires = r.summary.iter().any(|c| c.wire != "f32");
    let mut head = vec!["consistency", "workers"];
    if wires {
        head.push("wire");
    }
    head.extend([
        "reached",
        "time to target s (median, min–max)",
        "epochs to target",
        "samples/s",
    ]);
    if wires {
        head.extend(["bytes pushed/sample", "bytes pulled/sample"]);
    }
    let mut t = table(&head);
    for x in &r.summary {
        let mut row = vec![x.consistency.clone(), x.workers.to_string()];
        if wires {
            row.push(x.wire.clone());
        }
        row.extend([
            format!("{}/{}", x.reached, x.runs),
            match (x.median_tta_s, x.min_tta_s, x.max_tta_s) {
                // Tenths of a second, or hundredths for runs under a second.
                (Some(m), Some(lo), Some(hi)) if hi < 1.0 => {
                    format!("{m:.2} ({lo:.2}–{hi:.2})")
                }
                (Some(m), Some(lo), Some(hi)) => format!("{m:.1} ({lo:.1}–{hi:.1})"),
                _ => "not reached".into(),
            },
            x.median_epochs.map_or("-".into(), |v| format!("{v:.2}")),
            format!("{:.0}", x.samples_per_s),
        ]);
        if wires {
            row.extend([
                format!("{:.0}", x.pushed_per_sample),
                format!("{:.0}", x.pulled_per_sample),
            ]);
        }
        t.add_row(row);
    }
    let link = r.link.as_ref().map_or(String::new(), |l| format!(", {l}"));
    format!(
        "time to {} test accuracy, {}, {}, batches of {}, {} training samples, {} \
         shards{link}:\n{t}",
        r.target, r.model, r.optimizer, r.batch, r.train_samples, r.shards
    )
}

/// The load results: throughput and latency per operation, errors by kind, each server's
/// memory, the check of every float, and what the hostile client held.
pub fn load_table(r: &load::Results) -> String {
    let mut ops = table(&["op", "ok", "per s", "p50 µs", "p99 µs"]);
    for o in &r.ops {
        ops.add_row(vec![
            o.op.clone(),
            o.ok.to_string(),
            format!("{:.0}", o.per_s),
            format!("{:.0}", o.p50_us),
            format!("{:.0}", o.p99_us),
        ]);
    }
    let mut errors = table(&["error", "count"]);
    for (kind, n) in &r.errors {
        errors.add_row(vec![kind.clone(), n.to_string()]);
    }
    if r.errors.is_empty() {
        errors.add_row(vec!["none".to_string(), "0".to_string()]);
    }
    let mib = |kib: u64| format!("{:.1}", kib as f64 / 1024.0);
    let mut mem = table(&[
        "server",
        "RSS at start MiB",
        "peak RSS MiB",
        "RSS at end MiB",
    ]);
    for s in &r.servers {
        mem.add_row(vec![
            s.name.clone(),
            mib(s.rss_start_kib),
            mib(s.rss_peak_kib),
            mib(s.rss_end_kib),
        ]);
    }
    let c = &r.check;
    let verdict = if c.lost_updates == 0 && c.extra_updates == 0 {
        "every acknowledged push applied, none twice".to_string()
    } else {
        format!(
            "LOST {} acknowledged pushes ({} floats short), {} extra updates",
            c.lost_updates, c.floats_short, c.extra_updates
        )
    };
    let mut out = format!(
        "load, {} clients ({} ran) for {:.0} s, {} floats in {} keys over {} shards, asp:\n{ops}\n\
         errors:\n{errors}\n\
         server memory:\n{mem}\n\
         clients dropped by the coordinator and registered again: {}\n\
         check: {} acknowledged pushes, {} failed; floats read back {} to {}: {verdict}",
        r.clients,
        r.clients_running,
        r.seconds,
        r.floats,
        r.keys,
        r.shards,
        r.reregistered,
        c.acknowledged,
        c.failed,
        c.min,
        c.max,
    );
    if let Some(h) = &r.hostile {
        let mut t = table(&[
            "hostile",
            "asked",
            "sent/opened",
            "peak held",
            "held at end",
        ]);
        t.add_row(vec![
            "half-sent 1 GiB frames".to_string(),
            h.frames.to_string(),
            h.frames_sent.to_string(),
            h.frames_held_peak.to_string(),
            h.frames_held_at_end.to_string(),
        ]);
        t.add_row(vec![
            "idle connections (no Hello)".to_string(),
            h.idle.to_string(),
            h.idle_opened.to_string(),
            h.idle_held_peak.to_string(),
            h.idle_held_at_end.to_string(),
        ]);
        let mut ends = table(&["what the servers did", "count"]);
        let lists = [
            ("frame", &h.frame_outcomes),
            ("idle", &h.idle_outcomes),
            ("connect failed", &h.connect_failures),
        ];
        for (what, list) in lists {
            for (kind, n) in list {
                ends.add_row(vec![format!("{what}: {kind}"), n.to_string()]);
            }
        }
        let _ = write!(out, "\nhostile client:\n{t}\n{ends}");
    }
    out
}

/// The control-plane results: per worker count, each store's commits per second and a
/// commit's latency, against the coordinator without a store.
pub fn control_table(r: &control::Results) -> String {
    let mut t = table(&[
        "workers",
        "store",
        "commits/s",
        "rounds min–max",
        "vs none",
        "commit p50 µs",
        "commit p99 µs",
        "step p50 µs",
        "store writes/s",
        "commits/write",
    ]);
    let opt =
        |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |v| format!("{v:.digits$}"));
    for row in &r.rows {
        t.add_row(vec![
            row.workers.to_string(),
            row.store.name().to_string(),
            format!("{:.0}", row.commits_per_s),
            format!("{:.0}–{:.0}", row.round_min, row.round_max),
            opt(row.vs_none, 2),
            format!("{:.0}", row.commit_p50_us),
            format!("{:.0}", row.commit_p99_us),
            format!("{:.0}", row.step_p50_us),
            opt(row.writes_per_s, 0),
            opt(row.commits_per_write, 1),
        ]);
    }
    let p = &r.probe;
    let mut out = format!(
        "control plane, commits of a {}-float counter over {} shards, asp, {} samples per commit; \
         {} round{} of {:.1} s after {:.1} s of warm-up, stores alternating:\n{t}\n\
         state directory on {}: a bare append of {} bytes and fdatasync takes {:.0} µs p50, \
         {:.0} µs p99 ({} appends)",
        r.floats,
        r.shards,
        r.batch,
        r.rounds,
        if r.rounds == 1 { "" } else { "s" },
        r.window_s,
        r.warmup_s,
        p.disk,
        p.bytes,
        p.p50_us,
        p.p99_us,
        p.writes,
    );
    if let Some(e) = &r.etcd {
        let _ = write!(out, "\netcd: {e}");
    }
    for s in &r.skipped {
        let _ = write!(out, "\nnot measured: {s}");
    }
    out
}

/// Writes `BENCHMARKS.md` (method, machine, tables) and its plots into `dir`.
pub fn write_markdown(all: &All, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("benches/plots"))
        .with_context(|| format!("creating {}", dir.join("benches/plots").display()))?;
    crate::plots::transport(
        &all.transport_loopback,
        &all.transport_default,
        &dir.join("benches/plots/transport.png"),
    )?;
    crate::plots::scale(&all.scale, &dir.join("benches/plots/scale.png"))?;
    crate::plots::tta(&all.tta, &dir.join("benches/plots/tta.png"))?;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Benchmarks\n\nGenerated by `cargo run --release -p edl-benches --bin edl-bench -- all` \
         (do not edit by hand; the text around the tables lives in `benches/src/report.rs`).\n\n\
         Machine: {}. The whole run took {:.1} minutes.\n",
        all.machine,
        all.seconds / 60.0
    );
    md.push_str(METHOD);
    let _ = writeln!(
        md,
        "\n## Transport\n\n![transport](benches/plots/transport.png)\n"
    );
    for r in [&all.transport_loopback, &all.transport_default] {
        let _ = writeln!(md, "```text\n{}\n```\n", transport_table(r));
    }
    // The profile breakdown is measured apart (under perf), and kept next to the plots.
    if let Ok(profile) = std::fs::read_to_string(dir.join(PROFILE)) {
        let _ = writeln!(md, "{PROFILE_METHOD}\n{}", profile.trim_end());
        md.push('\n');
    }
    let _ = writeln!(
        md,
        "## Optimizer apply\n\n```text\n{}\n```\n",
        apply_table(&all.apply)
    );
    let _ = writeln!(
        md,
        "## Scaling\n\n![scale](benches/plots/scale.png)\n\n```text\n{}\n```\n",
        scale_table(&all.scale)
    );
    let _ = writeln!(
        md,
        "## Elasticity\n\n```text\n{}\n```\n",
        elastic_table(&all.elastic)
    );
    let _ = writeln!(
        md,
        "## Time to accuracy\n\n![tta](benches/plots/tta.png)\n\n```text\n{}\n```",
        tta_table(&all.tta)
    );
    // `all` runs in one process; the load test starts server processes, so only its method
    // is written here.
    md.push('\n');
    md.push_str(LOAD_METHOD);
    md.push_str(&control_section(dir));
    md.push_str(&detect_section(dir));
    let path = dir.join("BENCHMARKS.md");
    std::fs::write(&path, md).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Where `benches/profile/run.sh` writes the breakdown of a pair's time.
const PROFILE: &str = "benches/profile/transport.md";

const PROFILE_METHOD: &str = "\
### Where a pair's time goes

From a profile of EDL's pairs alone (1 client, 1 shard, 65000-byte datagrams, release build),
recorded with `perf` and DWARF call graphs by `benches/profile/run.sh 1M:3000 16M:300 >
benches/profile/transport.md`: every sample is put in a category by the function it was in
and, for copies, by the caller whose copy it is (`benches/profile/breakdown.py`). Both
sides (client and shard) are in one process, so the shares are of the whole exchange. Most
page faults are quinn's: it copies every received datagram into freshly allocated memory, and
the allocator hands back pages the kernel must clear (letting mimalloc keep freed memory,
`MIMALLOC_PURGE_DELAY=-1`, removed most faults but did not change the pair times).
";

const METHOD: &str = "\
## Method

Every comparison is measured in one run, in one process, on loopback, so that the ratios hold
even on a noisy machine, where absolute figures move from run to run.

- **transport**: one *pair* is a push of one tensor and a pull of it. EDL goes through the
  client library and a shard server that applies SGD to every push: the client pushes
  `Gradients` (sent as they lie) and pulls into its parameter buffer, as a worker does. The
  *no-opt* column is the same with SGD at learning rate 0, which the shard skips: EDL's
  transport and bookkeeping without the update. Bare quinn sends the same bytes as
  request/response streams with the same TLS 1.3 and transport settings (no framing, no
  optimizer; each side receives what it is sent into one buffer, as a real client and server
  must); TCP sends them over one plain connection per client and server. Gbit/s counts both
  directions. The systems of a size are set up side by side and take turns, eight rounds
  of their pairs in an order rotating by round, so that a stretch where the machine is slow
  (another tenant, say) slows all of them alike. The AES-GCM in use is named with each
  table (aws-lc's or ring's, picked by the CPU's features). With several shards the tensor
  is split evenly and the parts travel in parallel, as EDL's client sends them. Tables are
  given for the default datagrams (path-MTU discovery from 1,200 bytes up to a 9,000-byte
  link's, safe on any network; loopback carries them all) and for a fixed large datagram
  (loopback). `edl-bench transport --netns --mtu 1500` (or `9000`) puts the servers in a
  network namespace behind a veth pair with that MTU, as root, so that every system crosses
  a link held to it; outside `all`. Whether striping a request over several streams or connections
  pays is measured with bare quinn (`--systems quinn,quinn-2streams,quinn-2conns`), outside
  `all`.
- **apply**: the server-side optimizer applied in place to 64 MiB of parameters, in GB/s of
  parameter plus gradient bytes, against a memcpy of the same bytes.
- **scale**: synthetic workers against an in-process cluster, each with its own connections,
  in a closed loop: pull, *compute*, push, report the step. Compute is a sleep of 20 ms: a GPU
  busy with a step leaves the CPU free, so every CPU cycle of the run goes to the system
  itself (QUIC, TLS, framing, the shards' optimizer, the coordinator) — and on this machine
  the workers, the shards and the coordinator share its cores, which is what saturates. The
  model is one 4 MiB tensor in 32 KiB keys, updated with SGD. A *dense* step pulls and pushes
  every key; a *sparse* step one key in eight (every eighth key, the offset moving by one
  each step, so the keys spread over the shards). Throughput is counted over 2.5 s after a
  0.4 s warm-up; samples/s counts 64 samples per step. *Efficiency* at n workers is the
  throughput over n times one worker's, in the same series. The series run under ASP, so
  that nobody waits for anybody and the figure is the system's; one dense series over 2
  shards under SSP(2) shows what waiting for the slowest adds. The *transport ceiling* of a
  series is the same loop without compute (8 workers), measured in the same run; a point's
  *load* is n times one worker's steps/s over that ceiling, and a point at 100% or more is
  *saturated*: the transport cannot carry what n workers ask of it, and efficiency must fall.
  The target (at least 90% efficiency up to saturation) is read at the most workers below
  saturation.
- **elastic**: 4 synthetic workers of the scale job (dense, 20 ms) over 2 shards under
  SSP(2); then, 2.5 s apart, a worker joins and the oldest leaves, six times each. *Stop-free*,
  a joiner connects and pulls the model while the others train, then asks to be admitted; a
  leaver finishes its step and leaves. With *restarts* (what `edl-local --restart-on-change`
  does with processes), every change checkpoints the model (a pull written to a file) while
  the old workers train, stops them all (each finishes its step and leaves), then starts the
  new membership as fresh clients. The costs are read from the coordinator's trace with
  `edl-local`'s own code (`deploy/src/costs.rs`): the *stall* of a change is how much longer
  than usual the others' step across it took, the worst of them; in a restart nobody trains
  across the change, so each old worker's gap runs from its last step to the new
  membership's first. *Join latency* runs from asking for the change to the joiner's first
  step (for a restart: checkpoint, stop and start). The *noise* column is the same stall
  measure at moments at least 1 s from any change: what the stall of a free change reads
  as on this machine. Synthetic restarts are a lower bound: a real one also starts processes,
  loads data and initializes the compute backend.
- **tta**: real training of `edl-local`'s default job (MLP 784-256-128-10, Adam at 0.001,
  batches of 64, 60,000 training samples) over 2 shards, each worker on its own thread and
  runtime with the CPU backend, until a snapshot reaches 0.85 test accuracy (at most 6
  epochs). The parameters are pulled every 100 ms while the workers train (the latest is
  checked every second to stop the run); afterwards every snapshot is evaluated on the 10,000
  test images, and the time to accuracy is that of the first snapshot at 0.85 or more,
  counted from starting the workers (cluster up, data in memory). Five seeds per cell
  (initialization and data order); the table gives the median and the range. With a CPU
  backend on 2 cores, more than 2 workers cannot compute faster: the figures show what each
  consistency model costs in samples to reach the target more than a speed-up.
";

/// Where `edl-bench control` keeps its table (BENCHMARKS.md includes it).
pub const CONTROL: &str = "benches/control.md";

/// What `edl-bench control` measures and how: the heading of its section in BENCHMARKS.md
/// (between the load and the detection sections), followed by the table of [`CONTROL`].
const CONTROL_METHOD: &str = "\
## Control plane: the cost of durability

`edl-bench all` does not run this one; it takes about 1.5 minutes.

```sh
cargo build -p edl-benches --bins
target/debug/edl-bench control [--workers 1,4,16] [--stores none,wal,etcd] \\
    [--etcd etcd://HOST:PORT] [--json control.json]
```

The coordinator answers a request that changed its state only once the change is durable,
and concurrent requests share a write (group commit; `Coordinator::durable`). This measures
what that costs a worker's commit (the `Clock` report of a data span, `commit_span`) with
each store, against the coordinator without one (`none`: its behaviour before durability,
answers waiting for no write). `wal` is the embedded store: a record of the whole state
appended to `coordinator/state.wal` and made durable with `fdatasync`. `etcd` keeps the state
in etcd through a conditional transaction, the coordinator elected (`run_elected`, a single
candidate); without `--etcd`, one member is started on loopback ports with its data on the
same disk, when `etcd` and `etcdctl` are installed. Each round starts a fresh in-process
cluster over QUIC on loopback (a coordinator, 2 shard servers and K workers, each with its own
certificate and connections) for a 4-float counter (2 keys, one per shard) under ASP, so that
no worker waits on another's clock. A worker leases a partition of 1024 samples and loops
push (`push_span`, to both shards) and commit (`commit_span`, 4 samples), leasing the next
partition when one is done. Commits are counted over a 2 s window after 0.5 s of warm-up,
three rounds per point, the stores taking turns in an order rotating by round; commits/s is
over all rounds (the range is the rounds'), latency is per call, p50 and p99 by nearest rank
over all rounds, and a *step* is a push and its commit. *Store writes* are counted from the
log's growth over its mean record, and from etcd's revision (one per transaction), so
*commits/write* is how many commits a write carried. The workers, the shards, the coordinator
(and etcd) share the machine's cores, and the figures are of the dev profile the tests use
(dependencies optimized, EDL's crates at `opt-level` 1). The line under the table gives the
floor of a durable commit on this disk: a bare append of about a record's size and
`fdatasync`.
";

/// The control-plane section of BENCHMARKS.md: its method and, if `edl-bench control` has
/// run, its table.
fn control_section(dir: &Path) -> String {
    let table = std::fs::read_to_string(dir.join(CONTROL)).unwrap_or_else(|_| {
        format!("\n(not measured yet: `edl-bench control` writes `{CONTROL}`)\n")
    });
    format!("\n{CONTROL_METHOD}\n{}\n", table.trim_end())
}

/// Writes `edl-bench control`'s `table` and `summary` (a sentence on what it means) to
/// `dir/`[`CONTROL`] and puts its section into `dir/BENCHMARKS.md` in place of the one there
/// (or before the detection section, or at the end), if the file exists.
pub fn write_control(r: &control::Results, dir: &Path) -> anyhow::Result<()> {
    let path = dir.join(CONTROL);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let text = format!(
        "Machine: {}. The run took {:.1} minutes.\n\n```text\n{}\n```\n\n{}\n",
        r.machine,
        r.seconds / 60.0,
        control_table(r).trim_end(),
        control_summary(r),
    );
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    let md_path = dir.join("BENCHMARKS.md");
    if let Ok(md) = std::fs::read_to_string(&md_path) {
        let heading = CONTROL_METHOD.lines().next().unwrap_or_default();
        let next = DETECT_METHOD.lines().next().unwrap_or_default();
        let section = control_section(dir);
        let updated = match md.find(heading) {
            Some(i) => {
                let rest = &md[i + heading.len()..];
                let end = rest
                    .find("\n## ")
                    .map_or(md.len(), |j| i + heading.len() + j);
                format!(
                    "{}\n{}\n{}",
                    md[..i].trim_end(),
                    section.trim_end(),
                    &md[end..]
                )
            }
            None => match md.find(next) {
                Some(i) => format!(
                    "{}\n{}\n\n{}",
                    md[..i].trim_end(),
                    section.trim_end(),
                    &md[i..]
                ),
                None => format!("{}\n{}", md.trim_end(), section),
            },
        };
        std::fs::write(&md_path, updated)
            .with_context(|| format!("writing {}", md_path.display()))?;
    }
    Ok(())
}

/// One sentence on what the control-plane table says: what a write of its own adds to a
/// commit at the fewest workers, and how many commits a write carries at the most (group
/// commit), with the share of the commits/s without a store each keeps. Empty without `none`
/// and a durable store.
pub fn control_summary(r: &control::Results) -> String {
    use control::Store;
    let least = r.rows.iter().map(|x| x.workers).min().unwrap_or(1);
    let most = r.rows.iter().map(|x| x.workers).max().unwrap_or(1);
    let find = |store: Store, k: usize| r.rows.iter().find(|x| x.store == store && x.workers == k);
    let (Some(none1), Some(none_k)) = (find(Store::None, least), find(Store::None, most)) else {
        return String::new();
    };
    let durable: Vec<(&control::Row, &control::Row)> = [Store::Wal, Store::Etcd]
        .into_iter()
        .filter_map(|s| Some((find(s, least)?, find(s, most)?)))
        .collect();
    if durable.is_empty() {
        return String::new();
    }
    let list = |f: &dyn Fn(&control::Row, &control::Row) -> String| {
        durable
            .iter()
            .map(|(one, many)| f(one, many))
            .collect::<Vec<_>>()
            .join(" and ")
    };
    let pct = |row: &control::Row| {
        row.vs_none
            .map_or("-".into(), |v| format!("{:.0}%", v * 100.0))
    };
    let per_write = |row: &control::Row| {
        row.commits_per_write
            .map_or("-".into(), |c| format!("{c:.1}"))
    };
    let workers = |k: usize| format!("{k} worker{}", if k == 1 { "" } else { "s" });
    let alone = if least == 1 {
        "a commit waits for a write of its own".to_string()
    } else {
        format!(
            "a write carries {} commits",
            list(&|one, _| format!("{} (`{}`)", per_write(one), one.store.name()))
        )
    };
    let mut sentence = format!(
        "At {} {alone}, which adds {} to a commit's p50 ({:.0} µs without a store; a bare append \
         and fdatasync on this disk takes {:.0} µs) and leaves {} of the commits/s without a \
         store",
        workers(least),
        list(&|one, _| format!(
            "{:.0} µs with `{}`",
            one.commit_p50_us - none1.commit_p50_us,
            one.store.name()
        )),
        none1.commit_p50_us,
        r.probe.p50_us,
        list(&|one, _| pct(one)),
    );
    if most > least {
        let _ = write!(
            sentence,
            "; at {} group commit shares a write among {} commits, so the durable stores keep \
             {} of the commits/s ({} against {:.0})",
            workers(most),
            list(&|_, many| format!("{} (`{}`)", per_write(many), many.store.name())),
            list(&|_, many| pct(many)),
            list(&|_, many| format!("{:.0}", many.commits_per_s)),
            none_k.commits_per_s,
        );
    }
    sentence.push('.');
    wrap(&sentence, 95)
}

/// `text` with its words wrapped into lines of at most `width` characters.
fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = 0;
    for word in text.split_whitespace() {
        let len = word.chars().count();
        if line > 0 && line + 1 + len > width {
            out.push('\n');
            line = 0;
        } else if line > 0 {
            out.push(' ');
            line += 1;
        }
        out.push_str(word);
        line += len;
    }
    out
}

/// Where `edl-bench detect` keeps its tables (BENCHMARKS.md includes them).
pub const DETECT: &str = "benches/detect.md";

/// What `edl-bench detect` measures and how: the heading BENCHMARKS.md's last section starts
/// with, followed by the tables of [`DETECT`].
const DETECT_METHOD: &str = "\
## Failure and straggler detection

`edl-bench all` does not run this one either: it starts whole jobs with `edl-local` (release
binaries next to `edl-bench`), 34 of them, and takes about 11 minutes.

```sh
cargo build --release -p edl-ps -p edl-worker -p edl-benches
target/release/edl-bench detect [--runs 20] [--json detect.json]
```

Every run is a real job on this machine: a coordinator, 2 shard servers and 3 workers as
processes, training the default MLP (784-256-128-10, batch 64) on Fashion-MNIST for 6 epochs
or the sparse logistic regression on agaricus for 60 (`deploy/data`), with the detector's
default settings. *False flags* are counted over runs of identical workers, rotating through
the MLP under ASP, SSP(2) and BSP and the logistic regression under ASP, every other round
beside 2 threads spinning on the CPU (other tenants): any straggler flag there is false.
*Slowdowns*: worker w1 is made 1.5, 2 or 3 times slower (`edl-worker --slowdown-file`, the
scenario's `slow`) 5 s into training, past the 2 s warm-up; the time is from the launcher's
write of the factor (in the coordinator's clock) to the flag, and includes up to 250 ms for
the worker to read it and the step it was in. *Deaths*: w1 is SIGKILLed 4 s into training
and w2 stopped with SIGSTOP for 2 s at 6 s (less than the 3 s lease); the time is from
SIGKILL to the coordinator's `dead` event, whose detail says how it was found (its socket
gone, or its lease), and a paused worker declared dead would be a false death.
";

/// The detection section of BENCHMARKS.md: its method and, if `edl-bench detect` has run,
/// its tables.
fn detect_section(dir: &Path) -> String {
    let tables = std::fs::read_to_string(dir.join(DETECT)).unwrap_or_else(|_| {
        format!("\n(not measured yet: `edl-bench detect` writes `{DETECT}`)\n")
    });
    format!("\n{DETECT_METHOD}\n{}\n", tables.trim_end())
}

/// Writes `edl-bench detect`'s `table` (measured in `seconds`) to `dir/`[`DETECT`] and puts
/// it into `dir/BENCHMARKS.md` in place of the section there, if the file exists.
pub fn write_detect(table: &str, seconds: f64, dir: &Path) -> anyhow::Result<()> {
    let path = dir.join(DETECT);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let text = format!(
        "Machine: {}. The run took {:.1} minutes.\n\n```text\n{}\n```\n",
        machine(),
        seconds / 60.0,
        table.trim_end()
    );
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    let md_path = dir.join("BENCHMARKS.md");
    if let Ok(md) = std::fs::read_to_string(&md_path) {
        let heading = DETECT_METHOD.lines().next().unwrap_or_default();
        let kept = match md.find(heading) {
            Some(i) => md[..i].trim_end().to_string(),
            None => md.trim_end().to_string(),
        };
        let updated = format!("{kept}\n{}", detect_section(dir));
        std::fs::write(&md_path, updated)
            .with_context(|| format!("writing {}", md_path.display()))?;
    }
    Ok(())
}

/// What `edl-bench load` measures and how; near the end of `BENCHMARKS.md`.
const LOAD_METHOD: &str = "\
## Load

`edl-bench all` does not run this one: it starts `edl-ps` server processes (from the release
build, next to `edl-bench`) and keeps them under load for a minute, so it runs on its own.

```sh
cargo build --release -p edl-ps -p edl-benches
target/release/edl-bench load --clients 64 --seconds 60 [--hostile] [--json load.json]
```

A coordinator and 2 shard servers run as separate `edl-ps` processes on loopback, as in a
deployment (the coordinator with `--counter FLOATS`). The N clients (default 64) run in the
benchmark's one tokio runtime (2 threads), each a registered worker with its own certificate
and connections, looping pull, push and advance (the clock report) through the client
library under ASP, so that nobody waits on anybody's clock and the figures are the servers'.
The model is a counter: one zero-initialized tensor of 64 Ki floats (4 keys, 2 per shard)
trained by SGD at learning rate 1, and every push is -1.0 in every float, so each float ends
equal to the number of pushes applied to it. Throughput counts the operations completed over
the run (`--seconds`, default 60); latency is per operation, p50 and p99 by nearest rank. A
failed operation is counted by kind (the error code the server answered, or what became of
the stream or connection) and its client starts its next step 20 ms later; a client the
coordinator dropped registers again. At the end every float is read back and compared with
the pushes acknowledged to the clients: a float below that count means *lost updates*, and
the run fails. A push that failed may or may not have been applied (on one shard and not the
other, even), so a float may exceed the count by at most the failed pushes; more would be an
update applied twice. Each server's peak memory is its `VmHWM` from `/proc/PID/status`.
With `--hostile`, one more client holds 256 *half-sent frames* (on an authenticated worker
connection to each shard, a push whose prefix announces a 1 GiB payload, its header and 4 KiB
of it, then nothing more) and 256 *idle connections* (TLS done, never a Hello) spread over
the three servers. Whatever a server does about one (an error answer, a reset, closing the
connection) is counted by kind, and the hostile client tries again 100 ms later, so that the
pressure lasts the whole run. Clients, hostile client and servers share the machine's cores.
";

#[cfg(test)]
mod tests {
    use super::*;

    fn results(commits_per_s: f64) -> control::Results {
        let row = |store, vs_none| control::Row {
            store,
            workers: 4,
            commits: 10,
            seconds: 1.0,
            commits_per_s,
            round_min: commits_per_s,
            round_max: commits_per_s,
            vs_none,
            commit_p50_us: 100.0,
            commit_p99_us: 200.0,
            step_p50_us: 300.0,
            step_p99_us: 400.0,
            writes_per_s: None,
            commits_per_write: None,
        };
        control::Results {
            machine: "test".into(),
            probe: control::DiskProbe {
                disk: "ext4 on /dev/test".into(),
                bytes: 2048,
                writes: 1,
                p50_us: 1.0,
                p99_us: 1.0,
            },
            etcd: None,
            skipped: Vec::new(),
            floats: 4,
            shards: 2,
            batch: 4,
            partition: 1024,
            rounds: 1,
            warmup_s: 0.1,
            window_s: 1.0,
            rows: vec![
                row(control::Store::None, Some(1.0)),
                row(control::Store::Wal, Some(0.5)),
            ],
            seconds: 60.0,
        }
    }

    #[test]
    fn the_control_summary_reads_the_cost_at_one_worker_and_the_sharing_at_the_most() {
        let mut r = results(1000.0);
        let mut more = r.rows.clone();
        for row in &mut r.rows {
            row.workers = 1;
        }
        r.rows[1].commit_p50_us = 400.0;
        r.rows[1].commits_per_write = Some(1.0);
        for row in &mut more {
            row.workers = 16;
        }
        more[1].commits_per_write = Some(5.55);
        more[1].vs_none = Some(0.48);
        r.rows.extend(more);
        let s = control_summary(&r);
        assert!(s.lines().all(|l| l.chars().count() <= 95), "{s}");
        let s = s.replace('\n', " ");
        assert!(
            s.starts_with("At 1 worker a commit waits for a write of its own"),
            "{s}"
        );
        assert!(s.contains("adds 300 µs with `wal`"), "{s}");
        assert!(
            s.contains("group commit shares a write among 5.5 (`wal`) commits"),
            "{s}"
        );
        assert!(s.contains("keep 48% of"), "{s}");
        r.rows.retain(|row| row.store == control::Store::None);
        assert_eq!(control_summary(&r), "");
    }

    #[test]
    fn the_control_section_goes_before_detection_and_is_replaced_in_place() {
        let dir = tempfile::tempdir().expect("temp dir");
        let md = dir.path().join("BENCHMARKS.md");
        let detect = DETECT_METHOD.lines().next().expect("heading");
        std::fs::write(
            &md,
            format!("# Benchmarks\n\n## Load\n\nload\n\n{detect}\n\nflags\n"),
        )
        .expect("write");
        for rate in [1234.0, 5678.0] {
            write_control(&results(rate), dir.path()).expect("written");
        }
        let text = std::fs::read_to_string(&md).expect("read");
        let control = CONTROL_METHOD.lines().next().expect("heading");
        assert_eq!(text.matches(control).count(), 1, "{text}");
        let (at, load, det) = (
            text.find(control).expect("control"),
            text.find("## Load").expect("load"),
            text.find(detect).expect("detect"),
        );
        assert!(load < at && at < det, "{text}");
        assert!(text.contains("5678") && !text.contains("1234"), "{text}");
        assert!(text.ends_with("flags\n"), "{text}");
    }
}
