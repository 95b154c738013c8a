//! End-to-end run of the local launcher with real `edl-ps` and `edl-worker` processes.
//!
//! `cargo test --workspace` builds `edl-ps` and `edl-worker` next to `edl-local` (their own
//! integration tests need them), so this test finds them there; `EDL_BIN_DIR` points elsewhere
//! (an absolute path, e.g. `$PWD/target/release`). Without the dataset the test says it was
//! skipped, unless `EDL_REQUIRE_DATA=1` (set by CI) makes that a failure.

mod common;

use std::time::Duration;

use edl_deploy::LocalConfig;
use edl_shared::proto::Consistency;
use edl_shared::shutdown::CancellationToken;
use edl_worker::data::DEFAULT_DATA_DIR;

/// A small job (2 shards, 2 workers, 4,096 samples of one epoch, MLP 784-64-10, ASP, Adam)
/// with its state in `dir`.
fn small_job(dir: &std::path::Path) -> LocalConfig {
    LocalConfig {
        shards: 2,
        workers: 2,
        epochs: 1,
        consistency: Consistency::Asp,
        optimizer: "adam:0.001".parse().expect("optimizer"),
        schedule: Default::default(),
        batch_size: 64,
        train_samples: 4096,
        lease_ms: 3000,
        replicas: None,
        wire: None,
        layers: vec![784, 64, 10],
        seed: 7,
        data_dir: DEFAULT_DATA_DIR.into(),
        report: None,
        trace: None,
        state_dir: Some(dir.join("state")),
        bin_dir: Some(common::bin_dir()),
        progress_bar: false,
        stall_timeout: Some(Duration::from_secs(60)),
        scenario: None,
        restart_on_change: false,
        elastic: Default::default(),
        observe: Default::default(),
        job: None,
    }
}

#[tokio::test]
async fn small_job_trains_evaluates_and_reports() {
    if !common::have_dataset() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let report_path = dir.path().join("report.json");
    let cfg = LocalConfig {
        report: Some(report_path.clone()),
        ..small_job(dir.path())
    };
    let report = edl_deploy::run(&cfg, CancellationToken::new())
        .await
        .expect("the run succeeds");

    assert!(report.finished);
    assert_eq!(report.samples, 4096);
    assert_eq!(report.epochs.len(), 1);
    assert_eq!(report.epochs[0].samples, 4096);
    assert!(report.epochs[0].train_loss > 0.0 && report.epochs[0].train_loss < 2.5);
    assert_eq!(report.test_samples, 10_000);
    // Ten classes: chance is 0.1, and even 4,096 samples get a small MLP far past it.
    assert!(report.test_accuracy > 0.5, "{}", report.test_accuracy);
    assert!(report.throughput_samples_per_s > 0.0);
    // Every step pushes the whole gradient once (a push refused under an old map and sent
    // again would be the only excess) and pulls the parameters: 50,890 floats of 4 bytes per
    // 64 samples.
    let model = (784 * 64 + 64 + 64 * 10 + 10) * 4;
    let per_sample = model as f64 / 64.0;
    let t = report.traffic;
    assert_eq!(t.bytes_pushed, report.epochs[0].bytes_pushed);
    assert!(
        (per_sample..per_sample * 1.1).contains(&t.pushed_per_sample),
        "{t:?}, {per_sample} per sample expected"
    );
    assert!(
        (per_sample * 0.9..per_sample * 1.5).contains(&t.pulled_per_sample),
        "{t:?}, about {per_sample} per sample expected"
    );
    assert!(report.wall_s >= report.train_wall_s);
    assert!(
        report.shutdown_problems.is_empty(),
        "{:?}",
        report.shutdown_problems
    );

    let written: edl_deploy::Report =
        serde_json::from_str(&std::fs::read_to_string(&report_path).expect("report file"))
            .expect("report JSON");
    assert_eq!(written, report);
    for name in ["coordinator", "s0", "s1", "w0", "w1", "eval"] {
        let log = dir.path().join("state/logs").join(format!("{name}.log"));
        assert!(log.is_file(), "missing {}", log.display());
    }
}

/// Numbers of an epoch line: (the epoch's own time, the training time so far), in seconds.
fn epoch_times(line: &str) -> (f64, f64) {
    let num = |after: &str| -> f64 {
        let rest = &line[line.find(after).expect(after) + after.len()..];
        let end = rest.find(' ').expect("a number");
        rest[..end].parse().expect("a number")
    };
    (num(" done in "), num(" s ("))
}

/// `edl-local` as its user runs it: epochs are counted from 0 as `edlctl status` counts them,
/// and each epoch's line gives its own time (the times add up to the training time).
#[test]
fn edl_local_prints_each_epoch_with_its_own_time() {
    if !common::have_dataset() {
        return;
    }
    let bins = common::bin_dir();
    let dir = tempfile::tempdir().expect("tempdir");
    let report = dir.path().join("report.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edl-local"))
        .args([
            "--shards",
            "1",
            "--workers",
            "2",
            "--epochs",
            "2",
            "--consistency",
            "asp",
            "--train-samples",
            "2048",
            "--layers",
            "784,32,10",
            "--stall-timeout",
            "60",
            "--no-http",
            "--no-progress",
        ])
        .arg("--report")
        .arg(&report)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--bin-dir")
        .arg(&bins)
        .output()
        .expect("edl-local runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");

    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains(" done in ")).collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(lines[0].starts_with("epoch 1/2 done in "), "{stderr}");
    assert!(lines[1].starts_with("epoch 2/2 done in "), "{stderr}");
    let (first, so_far) = epoch_times(lines[0]);
    assert_eq!(first, so_far, "{stderr}");
    let (second, total) = epoch_times(lines[1]);
    // Each time is rounded to a tenth of a second.
    assert!((first + second - total).abs() < 0.16, "{stderr}");

    for e in 1..=2 {
        assert!(
            stdout.contains(&format!(
                "  epoch {e}/2: 2048 samples applied (0 duplicates, 0 missing"
            )),
            "{stdout}"
        );
    }
    let r: edl_deploy::Report =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("report file"))
            .expect("report JSON");
    let epochs: Vec<u32> = r.epochs.iter().map(|e| e.epoch).collect();
    assert_eq!(epochs, [0, 1]);
}

/// The same job with its pushes and pulls at f32, bf16 and fp16: the 16-bit runs train as
/// well (test accuracy within 0.01 of f32's) on about half the bytes.
#[tokio::test]
async fn sixteen_bit_wires_train_as_well_on_half_the_bytes() {
    if !common::have_dataset() {
        return;
    }
    let mut runs = Vec::new();
    for wire in edl_shared::proto::Wire::ALL {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = LocalConfig {
            // One worker: the same data order and the same steps in every run, so that the
            // runs differ by the wire's rounding alone.
            workers: 1,
            train_samples: 8192,
            wire: Some(wire.into()),
            ..small_job(dir.path())
        };
        let report = edl_deploy::run(&cfg, CancellationToken::new())
            .await
            .unwrap_or_else(|e| panic!("the {wire} run: {e:#}"));
        assert!(report.finished, "{wire}: {report}");
        assert_eq!(report.epochs[0].samples, 8192, "{wire}");
        eprintln!(
            "{wire}: test accuracy {:.4}, {:.0} bytes pushed and {:.0} pulled per sample",
            report.test_accuracy,
            report.traffic.pushed_per_sample,
            report.traffic.pulled_per_sample
        );
        runs.push((wire, report));
    }
    let (_, f32_run) = &runs[0];
    for (wire, r) in &runs[1..] {
        let gap = (r.test_accuracy - f32_run.test_accuracy).abs();
        assert!(
            gap <= 0.01,
            "{wire}: test accuracy {:.4} against f32's {:.4}",
            r.test_accuracy,
            f32_run.test_accuracy
        );
        for (what, cut) in [
            (
                "pushed",
                f32_run.traffic.pushed_per_sample / r.traffic.pushed_per_sample,
            ),
            (
                "pulled",
                f32_run.traffic.pulled_per_sample / r.traffic.pulled_per_sample,
            ),
        ] {
            assert!(
                cut >= 1.9,
                "{wire}: bytes {what} per sample cut only {cut:.2}x"
            );
        }
    }
}

/// The same job (plain SGD) pushing every value at f32, only the largest 1% of each chunk with
/// error feedback, and (from a job file) that for its large first weight alone, with bf16
/// values and pulls, the other tensors exact: top-k trains as well (test accuracy within 0.01
/// of f32's) on a tenth of the bytes pushed or less, and pulls the same; the job file's run
/// pulls its first weight at half the bytes and the rest at f32.
#[tokio::test]
async fn top_k_pushes_train_as_well_on_a_tenth_of_the_bytes() {
    if !common::have_dataset() {
        return;
    }
    let mut runs = Vec::new();
    for wire in ["f32", "topk:0.01", "per tensor"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("job.toml");
        std::fs::write(
            &file,
            "[model]\nkind = \"mlp\"\nlayers = [784, 64, 10]\n\n[optimizer]\nkind = \"sgd\"\n\
             lr = 0.1\n\n[training]\nconsistency = \"asp\"\nbatch_size = 64\nepochs = 2\n\
             samples = 8192\nlease_ms = 3000\nseed = 7\n\n[[tensor]]\nname = \"fc0.weight\"\n\
             wire = \"topk:0.01+bf16\"\n",
        )
        .expect("job file");
        let cfg = LocalConfig {
            // One worker, as above. Error feedback keeps the sum of what is applied that of
            // the gradients, which plain SGD turns into the same parameters, only later: with
            // the server's momentum or Adam, held-back values arrive as one large, late
            // gradient and top-k lags (BENCHMARKS, "Compression").
            workers: 1,
            epochs: 2,
            train_samples: 8192,
            optimizer: "sgd:0.1".parse().expect("optimizer"),
            wire: wire.parse().ok(),
            ..small_job(dir.path())
        };
        let cfg = match wire {
            "per tensor" => cfg.from_job_file(&file).expect("job file"),
            _ => cfg,
        };
        let report = edl_deploy::run(&cfg, CancellationToken::new())
            .await
            .unwrap_or_else(|e| panic!("the {wire} run: {e:#}"));
        assert!(report.finished, "{wire}: {report}");
        for e in &report.epochs {
            assert_eq!((e.samples, e.duplicates, e.missing), (8192, 0, 0), "{wire}");
        }
        eprintln!(
            "{wire}: test accuracy {:.4}, {:.1} bytes pushed and {:.0} pulled per sample",
            report.test_accuracy,
            report.traffic.pushed_per_sample,
            report.traffic.pulled_per_sample
        );
        runs.push(report);
    }
    let dense = &runs[0];
    for (name, topk) in [("top-k", &runs[1]), ("per tensor", &runs[2])] {
        assert!(
            (topk.test_accuracy - dense.test_accuracy).abs() <= 0.01,
            "{name}: test accuracy {:.4} against f32's {:.4}",
            topk.test_accuracy,
            dense.test_accuracy
        );
        let cut = dense.traffic.pushed_per_sample / topk.traffic.pushed_per_sample;
        assert!(
            cut >= 10.0,
            "{name}: bytes pushed per sample cut only {cut:.1}x"
        );
    }
    // Pulls are dense at f32 with top-k alone; with the first weight's at bf16, its 50,176
    // floats travel at half the bytes and the other 714 whole: 203,560 bytes a pull become
    // 103,208, a cut of 1.97x (not the 2x of every tensor at bf16).
    let pulled =
        |r: &edl_deploy::Report| r.traffic.pulled_per_sample / dense.traffic.pulled_per_sample;
    assert!(
        (0.99..1.01).contains(&pulled(&runs[1])),
        "pulls changed {:.3}x",
        pulled(&runs[1])
    );
    let want = 103_208.0 / 203_560.0;
    let got = pulled(&runs[2]);
    assert!(
        (got - want).abs() < 0.002,
        "pulls changed {got:.4}x, not {want:.4}x"
    );
}

/// The book's reference page of `edl-local` is its `--help` (`EDL_BLESS=1` rewrites it).
#[test]
fn the_reference_page_of_edl_local_is_current() {
    let programs = [(
        env!("CARGO_BIN_EXE_edl-local"),
        "edl-local",
        "Runs a whole job on this machine: a coordinator, shards and workers as processes, with \
         a scenario of elastic events if given, and a report.",
    )];
    edl_shared::docgen::check_cli_pages(env!("CARGO_MANIFEST_DIR"), &programs)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// The README's five-minute tour as written (and Getting started's): every `$` command of their
/// console blocks, run from
/// the repository's root with `STATE` the state directory of a live local job, succeeds; so
/// does the job, stopped afterwards with SIGTERM.
#[test]
fn the_readme_tour_runs_as_written() {
    if !common::have_dataset() {
        return;
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let tour =
        edl_shared::docgen::section(&readme, "A five-minute tour").expect("the tour in README.md");
    // Getting started (docs/src/getting-started.md) walks the same tour: its commands too.
    let book = std::fs::read_to_string(root.join("docs/src/getting-started.md"))
        .expect("docs/src/getting-started.md");
    let mut commands: Vec<String> = Vec::new();
    let mut console = false;
    for line in tour.lines().chain(book.lines()) {
        match line.trim() {
            "```console" => console = true,
            "```" => console = false,
            l if console => {
                if let Some(c) = l.strip_prefix("$ ")
                    && !commands.iter().any(|have| have == c)
                {
                    commands.push(c.to_string());
                }
            }
            _ => {}
        }
    }
    assert!(
        commands.len() >= 4,
        "too few commands in the tour: {commands:?}"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let log = std::fs::File::create(dir.path().join("edl-local.log")).expect("log");
    // A long job (the README's, with more epochs), stopped once the tour is done.
    // Killed if the test fails before it stops the job.
    let mut job = edl_testkit::procs::Proc(
        std::process::Command::new(env!("CARGO_BIN_EXE_edl-local"))
            .args(["--shards", "2", "--workers", "3", "--epochs", "20"])
            .args(["--consistency", "ssp:2", "--no-http", "--no-progress"])
            .arg("--state-dir")
            .arg(&state)
            .arg("--bin-dir")
            .arg(common::bin_dir())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starts edl-local"),
    );
    let log_text = || std::fs::read_to_string(dir.path().join("edl-local.log")).unwrap_or_default();
    let started = std::time::Instant::now();
    let addr_file = state.join(edl_shared::cli::COORDINATOR_ADDR_FILE);
    assert!(
        edl_testkit::procs::wait_for_file(&addr_file, Duration::from_secs(60)).is_some(),
        "no coordinator address within 60 s:\n{}",
        log_text()
    );
    // The tour runs while the job trains: its three workers are in.
    loop {
        let out = std::process::Command::new(common::bin_dir().join("edlctl"))
            .arg("--state-dir")
            .arg(&state)
            .args(["--json", "workers"])
            .env_remove("EDL_COORDINATOR")
            .output()
            .expect("runs edlctl");
        let active = serde_json::from_slice::<Vec<serde_json::Value>>(&out.stdout)
            .map_or(0, |ws| ws.iter().filter(|w| w["state"] == "active").count());
        if active == 3 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "3 workers not active within 90 s ({active}):\n{}",
            log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for command in &commands {
        let words: Vec<String> = command
            .split_whitespace()
            .map(|w| w.replace("STATE", &state.display().to_string()))
            .collect();
        let out = std::process::Command::new(root.join(&words[0]))
            .args(&words[1..])
            .current_dir(&root)
            .env_remove("EDL_COORDINATOR")
            .output()
            .unwrap_or_else(|e| panic!("{command}: {e}"));
        assert!(
            out.status.success(),
            "{command}:\n{}\n{}\nthe job's log:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            log_text()
        );
    }
    assert_eq!(
        job.0.try_wait().expect("wait"),
        None,
        "the job ended early:\n{}",
        log_text()
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(job.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let stopping = std::time::Instant::now();
    let status = loop {
        if let Some(s) = job.0.try_wait().expect("wait") {
            break s;
        }
        if stopping.elapsed() > Duration::from_secs(60) {
            panic!(
                "edl-local did not stop within 60 s of SIGTERM:\n{}",
                log_text()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.code().is_some(),
        "edl-local was killed by a signal ({status}):\n{}",
        log_text()
    );
}
