//! The book's reference pages (`docs/src/reference/`) are generated from the code that defines
//! what they describe: a binary's `--help` (every subcommand's too), the wire's error codes, a
//! server's budget flags. A test of the defining package renders each page and [`check`]s it
//! against the committed file, so a flag or code changed without its page fails the tests;
//! `EDL_BLESS=1` writes the page instead.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The book's reference folder, from a package's manifest folder (`CARGO_MANIFEST_DIR`; the
/// workspace root is found by walking up to the folder holding `docs/`).
pub fn reference_dir(manifest_dir: &str) -> PathBuf {
    let mut dir = Path::new(manifest_dir);
    while !dir.join("docs/src").is_dir() {
        match dir.parent() {
            Some(up) => dir = up,
            None => return Path::new(manifest_dir).join("docs/src/reference"),
        }
    }
    dir.join("docs/src/reference")
}

/// The book's reference chapter (`docs/src/reference.md`), which holds the hand-written tables
/// the tests check.
pub fn reference_chapter(manifest_dir: &str) -> PathBuf {
    reference_dir(manifest_dir).with_extension("md")
}

/// The section of markdown `text` under the `## ` heading `heading` (the heading's text
/// without `## `), up to the next `## ` heading.
pub fn section<'t>(text: &'t str, heading: &str) -> Option<&'t str> {
    let start = text.find(&format!("## {heading}\n"))?;
    let rest = &text[start..];
    Some(&rest[..rest[3..].find("\n## ").map_or(rest.len(), |i| i + 3)])
}

/// A generated page's title and the comment that says where it comes from.
fn header(title: &str, source: &str) -> String {
    format!(
        "# {title}\n\n<!-- Generated from {source} by the tests (edl_shared::docgen); \
         EDL_BLESS=1 rewrites it. -->\n\n"
    )
}

/// Compares the committed page at `path` with `generated`: `Err` says how to regenerate it if
/// they differ. With `EDL_BLESS=1`, writes `generated` there instead.
pub fn check(path: &Path, generated: &str) -> Result<(), String> {
    if std::env::var("EDL_BLESS").as_deref() == Ok("1") {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        return std::fs::write(path, generated).map_err(|e| format!("{}: {e}", path.display()));
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    if committed == generated {
        return Ok(());
    }
    let line = committed
        .lines()
        .zip(generated.lines())
        .position(|(a, b)| a != b)
        .unwrap_or_else(|| committed.lines().count().min(generated.lines().count()))
        + 1;
    Err(format!(
        "{} is not what the code generates (first difference at line {line}): run the test \
         again with EDL_BLESS=1 to write it, and commit it",
        path.display()
    ))
}

/// A page of the `--help` of binary `bin` (named `name`) and of each of its subcommands, in
/// order, each under its own heading.
pub fn cli_page(bin: &Path, name: &str, intro: &str) -> Result<String, String> {
    let mut out = header(&format!("`{name}`"), &format!("`{name} --help`")) + intro + "\n";
    let mut stack = vec![Vec::<String>::new()];
    while let Some(path) = stack.pop() {
        let help = help_of(bin, &path)?;
        let title = std::iter::once(name.to_string())
            .chain(path.iter().cloned())
            .collect::<Vec<_>>()
            .join(" ");
        out.push_str(&format!(
            "\n## `{title}`\n\n```text\n{}\n```\n",
            help.trim_end()
        ));
        // Depth first, in the order the help lists them.
        for sub in subcommands(&help).into_iter().rev() {
            let mut p = path.clone();
            p.push(sub);
            stack.push(p);
        }
    }
    Ok(out)
}

/// Checks the pages of programs `(binary, name, intro)` in the reference folder of the package
/// at `manifest_dir` (see [`cli_page`] and [`check`]).
pub fn check_cli_pages(manifest_dir: &str, programs: &[(&str, &str, &str)]) -> Result<(), String> {
    let dir = reference_dir(manifest_dir);
    for (bin, name, intro) in programs {
        let page = cli_page(Path::new(bin), name, intro)?;
        check(&dir.join(format!("{name}.md")), &page)?;
    }
    Ok(())
}

/// `bin SUB... --help`, with no EDL_ variable of the caller's shown as a value.
fn help_of(bin: &Path, path: &[String]) -> Result<String, String> {
    let mut cmd = Command::new(bin);
    cmd.args(path).arg("--help");
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("EDL_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} {} --help failed: {}",
            bin.display(),
            path.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The subcommands a clap help text lists under `Commands:` (but `help`).
fn subcommands(help: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in help.lines() {
        if line.trim_end() == "Commands:" {
            inside = true;
            continue;
        }
        if !inside {
            continue;
        }
        if line.trim().is_empty() || !line.starts_with("  ") {
            break;
        }
        // A listed command starts two spaces in; a wrapped description further.
        if line[2..].starts_with(' ') {
            continue;
        }
        if let Some(word) = line.split_whitespace().next()
            && word != "help"
        {
            out.push(word.to_string());
        }
    }
    out
}

/// The error-code page, from the `ErrorCode` enum's source (`proto/src/error.rs`: each
/// variant, its number and its doc comment).
pub fn error_codes_page(source: &str) -> Result<String, String> {
    let body = source
        .split_once("pub enum ErrorCode {")
        .and_then(|(_, rest)| rest.split_once("\n}"))
        .map(|(body, _)| body)
        .ok_or("no `pub enum ErrorCode {` in the source")?;
    let mut out = header("Error codes", "proto/src/error.rs")
        + "A request a server refuses gets one of these codes with a message; the numbers never \
         change meaning (new codes are only appended). The client library's errors carry it \
         (`code()`), the Python package's `edl.EdlError` has it in `.code`, and a server's \
         `errors_total{code}` counts them.\n\n\
         | code | name | meaning |\n|---|---|---|\n";
    let mut doc = Vec::new();
    for line in body.lines().map(str::trim) {
        if let Some(d) = line.strip_prefix("///") {
            doc.push(d.trim().to_string());
        } else if let Some((name, number)) = line.trim_end_matches(',').split_once(" = ") {
            let number: u16 = number
                .parse()
                .map_err(|_| format!("{name}: {number:?} is not a number"))?;
            out.push_str(&format!(
                "| {number} | `{name}` | {} |\n",
                doc.join(" ").replace('|', "\\|")
            ));
            doc.clear();
        }
    }
    Ok(out)
}

/// The process-contract page: the module documentation of `shared/src/contract.rs`.
pub fn contract_page(source: &str) -> String {
    let mut out = header(
        "The process contract",
        "the documentation of shared/src/contract.rs",
    );
    for line in source.lines().map_while(|l| l.strip_prefix("//!")) {
        out.push_str(line.strip_prefix(' ').unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subcommands_are_read_from_a_clap_help() {
        let help = "Usage: x <COMMAND>\n\nCommands:\n  coordinator  Run a coordinator\n  shard        \
                    Run a shard: a long\n               description\n  help         Print this\n\n\
                    Options:\n  -h, --help  Print help\n";
        assert_eq!(subcommands(help), ["coordinator", "shard"]);
    }

    /// The wire's error codes, as `proto/src/error.rs` defines them; every number read from
    /// the source decodes to the variant of that name.
    #[test]
    fn the_error_code_page_is_current() {
        let source = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../proto/src/error.rs"
        ))
        .expect("proto/src/error.rs");
        let page = error_codes_page(&source).expect("renders");
        let mut rows = 0;
        for row in page
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| code"))
        {
            let cells: Vec<&str> = row.split(" | ").collect();
            let number: u16 = cells[0].trim_start_matches("| ").parse().expect("a number");
            let code = edl_proto::ErrorCode::from_u16(number).expect("a known code");
            assert_eq!(format!("`{code:?}`"), cells[1], "{row}");
            rows += 1;
        }
        assert!(rows >= 21, "{page}");
        let path = reference_dir(env!("CARGO_MANIFEST_DIR")).join("error-codes.md");
        check(&path, &page).unwrap_or_else(|e| panic!("{e}"));
    }

    /// The contract between a placer and a worker program, as `shared/src/contract.rs`
    /// documents it.
    #[test]
    fn the_process_contract_page_is_current() {
        let page = contract_page(include_str!("contract.rs"));
        assert!(page.contains("| `EDL_COORDINATOR` |"), "{page}");
        let path = reference_dir(env!("CARGO_MANIFEST_DIR")).join("process-contract.md");
        check(&path, &page).unwrap_or_else(|e| panic!("{e}"));
    }

    /// The keys the job-file loader accepts, by table (and by kind where they depend on it),
    /// read from its own answer to an unknown key.
    fn loader_keys() -> Vec<(&'static str, Vec<String>)> {
        const MLP: &str = "[model]\nkind = \"mlp\"\nlayers = [4, 3]\n";
        let mut probes: Vec<(&str, String)> = vec![
            ("", "[zzz_unknown]\n".into()),
            ("[model]", format!("{MLP}zzz_unknown = 1\n")),
            (
                "[model]",
                "[model]\nkind = \"logreg\"\nfeatures = 3\nzzz_unknown = 1\n".into(),
            ),
            ("[training]", format!("{MLP}[training]\nzzz_unknown = 1\n")),
            ("[data]", format!("{MLP}[data]\nzzz_unknown = 1\n")),
            ("[worker]", format!("{MLP}[worker]\nzzz_unknown = 1\n")),
            (
                "[[tensor]]",
                "[model]\nkind = \"custom\"\n[[tensor]]\nname = \"w\"\nshape = [2]\n\
                 zzz_unknown = 1\n"
                    .into(),
            ),
        ];
        for kind in ["sgd", "adam", "adamw", "adagrad", "rmsprop", "adadelta"] {
            let optimizer = format!("{MLP}[optimizer]\nkind = \"{kind}\"\n");
            probes.push(("[optimizer]", format!("{optimizer}zzz_unknown = 1\n")));
            probes.push((
                "[[optimizer.group]]",
                format!("{optimizer}[[optimizer.group]]\ntensors = [\"*\"]\nzzz_unknown = 1\n"),
            ));
        }
        for kind in [
            "constant",
            "step",
            "multistep",
            "exponential",
            "cosine",
            "linear",
            "onecycle",
        ] {
            probes.push((
                "[schedule]",
                format!("{MLP}[schedule]\nkind = \"{kind}\"\nzzz_unknown = 1\n"),
            ));
        }
        let mut out: Vec<(&str, Vec<String>)> = Vec::new();
        for (table, text) in probes {
            let err = crate::jobfile::parse_file(&text, Path::new("job.toml"))
                .expect_err("an unknown key is refused")
                .to_string();
            let list = err
                .split_once("expected one of ")
                .or_else(|| err.split_once(" takes "))
                .map(|(_, l)| l)
                .unwrap_or_else(|| panic!("no key list in {err:?}"));
            let keys: Vec<String> = list
                .split(", ")
                .map(|k| k.trim().trim_matches('`').to_string())
                .collect();
            match out.iter_mut().find(|(t, _)| *t == table) {
                Some((_, all)) => all.extend(keys),
                None => out.push((table, keys)),
            }
        }
        // Keys the probes themselves use, which the answers take for granted: a group's
        // tensors, and the kind of a model, optimizer or schedule.
        for (table, key) in [
            ("[[optimizer.group]]", "tensors"),
            ("[model]", "kind"),
            ("[optimizer]", "kind"),
            ("[schedule]", "kind"),
        ] {
            if let Some((_, keys)) = out.iter_mut().find(|(t, _)| *t == table) {
                keys.push(key.into());
            }
        }
        out
    }

    /// The reference's job-file table names every key the loader accepts (the optimizer's and
    /// the schedules' by kind), and its key column names no key the loader refuses.
    #[test]
    fn the_job_file_table_names_every_key_the_loader_takes() {
        let reference = reference_chapter(env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&reference).expect("docs/src/reference.md");
        let section = section(&text, "Job files").expect("a Job files section");
        // Each table's rows, and the names its key column gives.
        let mut rows: Vec<(String, String, Vec<String>)> = Vec::new();
        for line in section.lines().filter(|l| l.starts_with("| ")).skip(1) {
            let cells: Vec<&str> = line.split(" | ").collect();
            let table = cells[0].trim_start_matches('|').trim().trim_matches('`');
            if !table.is_empty() {
                rows.push((table.to_string(), String::new(), Vec::new()));
            }
            let Some((_, all, named)) = rows.last_mut() else {
                continue;
            };
            all.push_str(line);
            named.extend(
                cells
                    .get(1)
                    .unwrap_or(&"")
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .map(String::from),
            );
        }
        let keys = loader_keys();
        let mut missing = Vec::new();
        for (table, accepted) in &keys {
            if table.is_empty() {
                // The top-level tables: each has rows.
                for t in accepted {
                    let wanted = if t == "tensor" {
                        "[[tensor]]".to_string()
                    } else {
                        format!("[{t}]")
                    };
                    if !rows.iter().any(|(r, _, _)| *r == wanted) {
                        missing.push(format!("table {wanted}"));
                    }
                }
                continue;
            }
            let Some((_, all, _)) = rows.iter().find(|(r, _, _)| r == table) else {
                missing.push(format!("table {table}"));
                continue;
            };
            for k in accepted {
                if !all.contains(&format!("`{k}`")) {
                    missing.push(format!("{table} {k}"));
                }
            }
        }
        assert!(
            missing.is_empty(),
            "{} lacks what the loader accepts: {missing:?}",
            reference.display()
        );
        for (table, _, named) in &rows {
            let accepted = keys
                .iter()
                .find(|(t, _)| t == table)
                .map(|(_, k)| k.clone())
                .unwrap_or_default();
            for k in named {
                assert!(
                    accepted.contains(k),
                    "{}: {table} names `{k}`, which the loader refuses (it takes {accepted:?})",
                    reference.display()
                );
            }
        }
    }

    /// The metric names the code registers (`metrics::counter("NAME", ...)` and the like,
    /// anywhere in the workspace's sources), read from the source.
    fn registered_metrics() -> Vec<(String, String)> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = Vec::new();
        let mut dirs: Vec<PathBuf> = ["ps", "shared/src", "worker", "deploy/src", "testkit/src"]
            .iter()
            .map(|d| root.join(d))
            .collect();
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("reads a source folder") {
                let path = entry.expect("an entry").path();
                if path.is_dir() && !path.ends_with("vendor") && !path.ends_with("tests") {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs")
                    && !path.ends_with("docgen.rs")
                {
                    files.push(path);
                }
            }
        }
        let mut out = Vec::new();
        for file in files {
            let text = std::fs::read_to_string(&file).expect("reads a source file");
            for call in [
                "counter(",
                "gauge(",
                "counters(",
                "gauges(",
                "histograms(",
                "register(",
            ] {
                for (at, _) in text.match_indices(&format!("metrics::{call}")) {
                    let rest = &text[at + "metrics::".len() + call.len()..];
                    // The name: the first string literal of the call.
                    let Some(open) = rest.find('"') else { continue };
                    if rest[..open].contains(')') {
                        continue;
                    }
                    let name = &rest[open + 1..];
                    let name = &name[..name.find('"').unwrap_or(0)];
                    if !name.is_empty() {
                        out.push((name.to_string(), file.display().to_string()));
                    }
                }
            }
        }
        out
    }

    /// The reference's metrics table names every metric the code registers.
    #[test]
    fn the_metrics_table_names_every_metric_the_code_registers() {
        let reference = reference_chapter(env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&reference).expect("docs/src/reference.md");
        let table = section(&text, "Prometheus metrics").expect("a metrics section");
        let metrics = registered_metrics();
        assert!(metrics.len() >= 30, "{metrics:?}");
        let missing: Vec<_> = metrics
            .iter()
            .filter(|(name, _)| {
                !["`", "{"].iter().any(|end| {
                    table.contains(&format!("`{name}{end}"))
                        || table.contains(&format!("`{name}_total{end}"))
                })
            })
            .collect();
        assert!(
            missing.is_empty(),
            "{} lacks metrics the code registers: {missing:?}",
            reference.display()
        );
    }

    /// Every server's budget flags (`BudgetArgs`): flag, variable, default and help.
    #[cfg(feature = "cli")]
    #[test]
    fn the_budget_page_is_current() {
        use clap::Args;
        let cmd = crate::cli::BudgetArgs::augment_args(clap::Command::new("budgets"));
        let mut page = header("Server budgets", "edl_shared::cli::BudgetArgs")
            + "What any one peer, and all of them together, may make a server (coordinator, \
             shard, scheduler) hold; each flag also reads its variable. See \
             [Limits](../limits.md).\n\n| flag | variable | default | what it bounds |\n\
             |---|---|---|---|\n";
        for arg in cmd.get_arguments() {
            let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
            page.push_str(&format!(
                "| `--{}` | `{}` | {} | {} |\n",
                arg.get_long().expect("a long flag"),
                arg.get_env()
                    .map(|e| e.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                arg.get_default_values()
                    .iter()
                    .map(|v| v.to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join(", "),
                help.replace('\n', " ").replace('|', "\\|"),
            ));
        }
        let path = reference_dir(env!("CARGO_MANIFEST_DIR")).join("budgets.md");
        check(&path, &page).unwrap_or_else(|e| panic!("{e}"));
    }
}
