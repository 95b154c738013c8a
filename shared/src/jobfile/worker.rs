//! A job file's `[worker]` table: the program the job's workers run, for the placers
//! (`edl-local`, `edl-sched`, its Kubernetes placer). The coordinator reads the same file and
//! ignores the table: what a worker runs is not its concern, only that it speaks the protocol.
//!
//! ```toml
//! [worker]
//! command = ["python3", "train.py", "--lr", "0.1"]  # argv, run in the job file's folder
//! env = { OMP_NUM_THREADS = "1" }                   # added to the placer's environment
//! image = "registry.example/edl-torch:1.0"          # the Kubernetes placer's container image
//! gpus = 1                                          # devices a worker asks for
//! ```
//!
//! Without a `command` the workers run `edl-worker`, which trains the built-in models; a
//! `custom` model needs one. The variables of the process contract (`EDL_COORDINATOR`,
//! `EDL_NAME`, ...; see [`crate::contract`]) and `CUDA_VISIBLE_DEVICES` belong to the
//! placer and cannot be set in `env`.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use serde::Deserialize;
use toml::Spanned;

use super::{Cx, JobFileError, toml_string};

/// The most devices one worker may ask for.
pub const MAX_GPUS: u32 = 16;

/// What a job's workers run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerSpec {
    /// The program and its arguments, run in the job file's folder; empty: `edl-worker`.
    pub command: Vec<String>,
    /// Variables added to the placer's environment.
    pub env: BTreeMap<String, String>,
    /// The container image (Kubernetes placer only); `None`: the cluster's image.
    pub image: Option<String>,
    /// The devices a worker asks for; `None`: one on GPU slots, none on CPU stand-ins.
    pub gpus: Option<u32>,
}

impl WorkerSpec {
    /// Whether the workers run `edl-worker` (no `command`).
    pub fn is_builtin(&self) -> bool {
        self.command.is_empty()
    }

    /// What the workers run, in one line: `edl-worker (built-in model)` or the command as a
    /// shell would show it, with the image when one is set.
    pub fn describe(&self) -> String {
        let mut out = if self.is_builtin() {
            "edl-worker (built-in model)".to_string()
        } else {
            self.command
                .iter()
                .map(|a| shell_word(a))
                .collect::<Vec<_>>()
                .join(" ")
        };
        if let Some(image) = &self.image {
            let _ = write!(out, " [image {image}]");
        }
        out
    }

    /// Whether nothing is set (a job file without a `[worker]` table).
    fn is_empty(&self) -> bool {
        self == &WorkerSpec::default()
    }
}

/// `word` quoted for a shell when it needs to be.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWorker {
    command: Option<Spanned<Vec<Spanned<String>>>>,
    env: Option<Spanned<BTreeMap<String, Spanned<String>>>>,
    image: Option<Spanned<String>>,
    gpus: Option<Spanned<u32>>,
}

impl Cx<'_> {
    /// The job's `[worker]` table, checked; the default (`edl-worker`) without one.
    pub(super) fn worker_of(&self, raw: &super::RawJob) -> Result<WorkerSpec, JobFileError> {
        raw.worker
            .as_ref()
            .map_or_else(|| Ok(WorkerSpec::default()), |w| self.worker(w))
    }

    fn worker(&self, raw: &Spanned<RawWorker>) -> Result<WorkerSpec, JobFileError> {
        let w = raw.get_ref();
        let mut spec = WorkerSpec::default();
        if let Some(command) = &w.command {
            if command.get_ref().is_empty() {
                return Err(self.at(
                    command,
                    "worker.command",
                    "must name a program, e.g. [\"python3\", \"train.py\"]; leave it out to \
                     run edl-worker",
                ));
            }
            for (i, arg) in command.get_ref().iter().enumerate() {
                if arg.get_ref().contains('\0') {
                    return Err(self.at(arg, "worker.command", format!("argument {i} holds NUL")));
                }
            }
            if command.get_ref()[0].get_ref().is_empty() {
                return Err(self.at(&command.get_ref()[0], "worker.command", "empty program"));
            }
            spec.command = command
                .get_ref()
                .iter()
                .map(|a| a.get_ref().clone())
                .collect();
        }
        if let Some(env) = &w.env {
            for (key, value) in env.get_ref() {
                let field = format!("worker.env.{key}");
                let valid = key
                    .bytes()
                    .next()
                    .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
                    && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
                if !valid {
                    return Err(self.at(
                        value,
                        &field,
                        "not a variable name (letters, digits and _, not starting with a digit)",
                    ));
                }
                if crate::contract::RESERVED.contains(&key.as_str()) {
                    return Err(self.at(
                        value,
                        &field,
                        "set by the placer for every worker (the process contract); it cannot \
                         be set here",
                    ));
                }
                if value.get_ref().contains('\0') {
                    return Err(self.at(value, &field, "holds NUL"));
                }
                spec.env.insert(key.clone(), value.get_ref().clone());
            }
        }
        if let Some(image) = &w.image {
            if image.get_ref().trim().is_empty() || image.get_ref().contains(char::is_whitespace) {
                return Err(self.at(image, "worker.image", "not an image reference"));
            }
            spec.image = Some(image.get_ref().clone());
        }
        if let Some(gpus) = &w.gpus {
            if *gpus.get_ref() > MAX_GPUS {
                return Err(self.at(
                    gpus,
                    "worker.gpus",
                    format!("{} is over {MAX_GPUS}", gpus.get_ref()),
                ));
            }
            spec.gpus = Some(*gpus.get_ref());
        }
        Ok(spec)
    }
}

/// Writes `spec` as a `[worker]` table (nothing for the default).
pub(super) fn write_worker(out: &mut String, spec: &WorkerSpec) -> fmt::Result {
    if spec.is_empty() {
        return Ok(());
    }
    writeln!(out, "\n[worker]")?;
    if !spec.command.is_empty() {
        let args: Vec<String> = spec.command.iter().map(|a| toml_string(a)).collect();
        writeln!(out, "command = [{}]", args.join(", "))?;
    }
    if !spec.env.is_empty() {
        let vars: Vec<String> = spec
            .env
            .iter()
            .map(|(k, v)| format!("{k} = {}", toml_string(v)))
            .collect();
        writeln!(out, "env = {{ {} }}", vars.join(", "))?;
    }
    if let Some(image) = &spec.image {
        writeln!(out, "image = {}", toml_string(image))?;
    }
    if let Some(gpus) = spec.gpus {
        writeln!(out, "gpus = {gpus}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::{JobFile, parse_file};
    use super::*;

    const BASE: &str = "[model]\nkind = \"custom\"\n\n[[tensor]]\nname = \"w\"\nshape = [4]\n\
                        init = \"zeros\"\n";

    fn file(worker: &str) -> Result<JobFile, JobFileError> {
        parse_file(
            &format!("{BASE}\n[worker]\n{worker}"),
            Path::new("job.toml"),
        )
    }

    #[test]
    fn the_worker_table_parses_and_round_trips() {
        let f = file(
            "command = [\"python3\", \"train.py\", \"--lr\", \"0.1\"]\n\
             env = { OMP_NUM_THREADS = \"1\", B = \"two words\" }\n\
             image = \"registry.example/edl-torch:1.0\"\ngpus = 2\n",
        )
        .expect("parse");
        assert_eq!(f.worker.command, ["python3", "train.py", "--lr", "0.1"]);
        assert_eq!(f.worker.env["OMP_NUM_THREADS"], "1");
        assert_eq!(f.worker.env["B"], "two words");
        assert_eq!(
            f.worker.image.as_deref(),
            Some("registry.example/edl-torch:1.0")
        );
        assert_eq!(f.worker.gpus, Some(2));
        assert!(!f.worker.is_builtin());
        assert_eq!(
            f.worker.describe(),
            "python3 train.py --lr 0.1 [image registry.example/edl-torch:1.0]"
        );
        let again = parse_file(&f.to_toml(), Path::new("job.toml")).expect("reparse");
        assert_eq!(again, f);
    }

    #[test]
    fn without_a_table_the_workers_run_edl_worker() {
        let f = parse_file(BASE, Path::new("job.toml")).expect("parse");
        assert!(f.worker.is_builtin());
        assert_eq!(f.worker.describe(), "edl-worker (built-in model)");
        assert!(!f.to_toml().contains("[worker]"));
        // The coordinator's view of a file with a table is the same job.
        let with = file("command = [\"./train\"]\n").expect("parse");
        assert_eq!(with.job, f.job);
    }

    #[test]
    fn bad_worker_tables_are_named_with_their_line() {
        let cases: [(&str, &str); 7] = [
            ("command = []\n", "worker.command"),
            ("command = [\"\"]\n", "worker.command"),
            ("env = { EDL_NAME = \"x\" }\n", "worker.env.EDL_NAME"),
            (
                "env = { CUDA_VISIBLE_DEVICES = \"0\" }\n",
                "worker.env.CUDA_VISIBLE_DEVICES",
            ),
            ("env = { \"1X\" = \"x\" }\n", "worker.env.1X"),
            ("gpus = 17\n", "worker.gpus"),
            ("commands = [\"x\"]\n", "worker"),
        ];
        for (text, field) in cases {
            match file(text) {
                Err(JobFileError::Invalid { field: f, line, .. }) => {
                    assert!(f.starts_with(field), "{text:?}: field {f}, wanted {field}");
                    assert_eq!(line, Some(10), "{text:?}");
                }
                other => panic!("{text:?}: {other:?}"),
            }
        }
        let err = file("env = { EDL_COORDINATOR = \"x\" }\n").expect_err("reserved");
        assert!(err.to_string().contains("process contract"), "{err}");
    }

    #[test]
    fn words_are_quoted_for_the_shell_only_when_needed() {
        assert_eq!(shell_word("train.py"), "train.py");
        assert_eq!(shell_word("--lr=0.1"), "--lr=0.1");
        assert_eq!(shell_word("two words"), "'two words'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
