//! The commands the cluster scheduler answers: `job submit|list|show|cancel` and `slots`.

use super::*;

pub(super) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What `edlctl job` asks the scheduler, a submitted job file read and checked.
pub(super) enum JobAsk {
    Submit(edl_shared::proto::sched::Submission),
    List,
    Show(String),
    Cancel(String),
}

impl JobAsk {
    /// Reads and checks a submitted job file, so that a mistake is reported with its line
    /// (`file:line: field: message`) before anything is asked; the scheduler checks it again.
    pub(super) fn new(cmd: JobCmd) -> anyhow::Result<JobAsk> {
        Ok(match cmd {
            JobCmd::Submit {
                file,
                job,
                workers,
                min,
                max,
                priority,
            } => {
                let text = std::fs::read_to_string(&file)
                    .with_context(|| format!("reading {}", file.display()))?;
                edl_shared::jobfile::parse(&text, &file)?;
                let abs = std::path::absolute(&file).unwrap_or_else(|_| file.clone());
                let dir = abs
                    .parent()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default();
                JobAsk::Submit(edl_shared::proto::sched::Submission {
                    name: job.unwrap_or_default(),
                    job_file: text,
                    file_dir: dir,
                    workers,
                    min_workers: min.unwrap_or(workers.div_ceil(4).max(1)),
                    max_workers: max.unwrap_or(workers.saturating_mul(2)),
                    priority,
                })
            }
            JobCmd::List => JobAsk::List,
            JobCmd::Show { job } => JobAsk::Show(job),
            JobCmd::Cancel { job } => JobAsk::Cancel(job),
        })
    }
}

pub(super) async fn job_cmd(sched: &Admin, ask: JobAsk, json: bool) -> anyhow::Result<()> {
    let record = match ask {
        JobAsk::Submit(submission) => sched.submit_job(submission).await?,
        JobAsk::Show(job) => sched.show_job(&job).await?,
        JobAsk::Cancel(job) => sched.cancel_job(&job).await?,
        JobAsk::List => {
            let rows: Vec<JobRow> = sched
                .jobs()
                .await?
                .iter()
                .map(|j| JobRow::new(j, now_ms()))
                .collect();
            if json {
                return print_json(&rows);
            }
            let mut t = table(&[
                "job", "owner", "state", "workers", "slots", "samples", "queued", "jct",
            ]);
            for r in &rows {
                t.add_row(vec![
                    r.name.clone(),
                    r.owner.clone(),
                    r.state.clone(),
                    format!("{} ({}..{})", r.workers, r.min_workers, r.max_workers),
                    format!("{} ({} running)", r.alloc, r.running),
                    format!("{}/{}", r.samples, r.samples_total),
                    format!("{:.1} s", r.queued_s),
                    opt_s(r.jct_s),
                ]);
            }
            println!("{t}");
            return Ok(());
        }
    };
    let row = JobRow::new(&record, now_ms());
    if json {
        return print_json(&row);
    }
    let mut t = table(&["", ""]);
    t.add_row(vec!["job".into(), row.name.clone()]);
    t.add_row(vec!["owner".into(), row.owner.clone()]);
    t.add_row(vec!["state".into(), row.state.clone()]);
    t.add_row(vec![
        "workers (min..max)".into(),
        format!("{} ({}..{})", row.workers, row.min_workers, row.max_workers),
    ]);
    t.add_row(vec!["priority".into(), row.priority.to_string()]);
    if !row.runs.is_empty() {
        t.add_row(vec!["workers run".into(), row.runs.clone()]);
    }
    t.add_row(vec!["last growth took".into(), opt_s(row.resize_cost_s)]);
    t.add_row(vec![
        "slots".into(),
        format!(
            "{} ({} workers running, {} resizes)",
            row.alloc, row.running, row.resizes
        ),
    ]);
    t.add_row(vec![
        "samples".into(),
        format!("{}/{}", row.samples, row.samples_total),
    ]);
    t.add_row(vec!["queued".into(), format!("{:.1} s", row.queued_s)]);
    t.add_row(vec!["completion time".into(), opt_s(row.jct_s)]);
    t.add_row(vec![
        "slot-seconds".into(),
        format!("{:.1}", row.attained_s),
    ]);
    if let Some(l) = &row.ledger {
        t.add_row(vec![
            "ledger".into(),
            format!(
                "{} applied, {} duplicates, {} missing",
                l.applied, l.duplicates, l.missing
            ),
        ]);
    }
    t.add_row(vec!["directory".into(), row.dir.clone()]);
    println!("{t}");
    // Below the table, wrapped: a failure's message runs to hundreds of columns and lines of
    // a log, which would stretch every row of the table.
    if !row.message.is_empty() {
        println!("message:\n{}", wrap(&row.message, "  ", MESSAGE_WIDTH));
    }
    if let Some(c) = &row.coordinator {
        let pki = edl_shared::pki::PkiDir::new(std::path::Path::new(&row.dir));
        println!(
            "reach its coordinator with your certificate for this job:\n  edlctl --coordinator {c} \\\n    --ca {} --cert {} --key {} status",
            pki.ca_cert().display(),
            pki.node_cert(Role::Admin, &row.owner).display(),
            pki.node_key(Role::Admin, &row.owner).display(),
        );
    }
    Ok(())
}

/// The columns a job's message is wrapped to.
pub(super) const MESSAGE_WIDTH: usize = 100;

/// `text` wrapped at spaces to `width` columns, each line indented by `indent`. A line keeps
/// its own leading spaces (a log's quoted lines stay indented), also on the lines it wraps to;
/// a word longer than a line is left whole, so that a path can still be copied.
pub(super) fn wrap(text: &str, indent: &str, width: usize) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let body = line.trim_start();
        let lead = format!("{indent}{}", &line[..line.len() - body.len()]);
        let mut col = 0;
        for word in body.split_whitespace() {
            let n = word.chars().count();
            if col > 0 && col + 1 + n > width {
                out.push('\n');
                col = 0;
            }
            if col == 0 {
                out.push_str(&lead);
                col = lead.chars().count();
            } else {
                out.push(' ');
                col += 1;
            }
            out.push_str(word);
            col += n;
        }
        out.push('\n');
    }
    out.truncate(out.trim_end().len());
    out
}

pub(super) async fn slots_cmd(sched: &Admin, json: bool) -> anyhow::Result<()> {
    let rows: Vec<SlotRow> = sched.slots().await?.iter().map(SlotRow::from).collect();
    if json {
        return print_json(&rows);
    }
    let mut t = table(&["slot", "host", "job", "worker"]);
    for r in &rows {
        t.add_row(vec![
            r.slot.clone(),
            r.host.clone(),
            r.job.clone().unwrap_or_else(|| "-".into()),
            r.worker.clone().unwrap_or_else(|| "-".into()),
        ]);
    }
    println!("{t}");
    Ok(())
}
