//! The process contract between a placer and any worker program.
//!
//! A placer (`edl-local`, `edl-sched` with local processes or Kubernetes pods) starts every
//! worker, `edl-worker` or the program of a job file's `[worker]` table, the same way:
//!
//! | variable | what it holds |
//! |---|---|
//! | `EDL_COORDINATOR` | the coordinator's address (`host:port`); a comma-separated list once coordinators are replicated: try them in order |
//! | `EDL_CERT`, `EDL_KEY`, `EDL_CA` | the worker's certificate, key and the job's CA (PEM files), when the placer issued them |
//! | `EDL_STATE_DIR` | otherwise: a development state directory whose PKI issues `worker/EDL_NAME` on demand |
//! | `EDL_JOB` | the job's name (its certificates' job) |
//! | `EDL_NAME` | the worker's name, its certificate's name |
//! | `EDL_PLACEMENT` | the placement it was started for (a decimal id), if any: named when it registers, so that the coordinator counts the placement done and drains the worker it replaces |
//! | `CUDA_VISIBLE_DEVICES` | the devices of its slot, when the slot names them |
//!
//! It runs in the job file's folder, with the job file's `[worker] env` added. Signals:
//! SIGTERM asks it to drain (finish the step, commit, leave, exit 0; a second one may exit at
//! once); SIGUSR1 is a preemption notice (tell the coordinator, then leave as for SIGTERM,
//! within the notice). `edl_client::Job::from_env()` and Python's `edl.Job.from_env()` read
//! this environment, and their sessions honour the signals; `edl-worker` takes the same
//! settings as flags. Migration, replacement, preemption and profiling then work for any
//! program as for `edl-worker`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The coordinator's address, or a comma-separated list of them.
pub const COORDINATOR: &str = "EDL_COORDINATOR";
/// The worker's certificate (PEM file).
pub const CERT: &str = "EDL_CERT";
/// The worker's private key (PEM file).
pub const KEY: &str = "EDL_KEY";
/// The job's CA certificate (PEM file).
pub const CA: &str = "EDL_CA";
/// A development state directory (used without `EDL_CERT`).
pub const STATE_DIR: &str = "EDL_STATE_DIR";
/// The job's name.
pub const JOB: &str = "EDL_JOB";
/// The worker's name.
pub const NAME: &str = "EDL_NAME";
/// The placement the worker was started for.
pub const PLACEMENT: &str = "EDL_PLACEMENT";
/// The devices of the worker's slot.
pub const DEVICES: &str = "CUDA_VISIBLE_DEVICES";

/// Every variable the contract sets; a job file cannot set them.
pub const RESERVED: [&str; 9] = [
    COORDINATOR,
    CERT,
    KEY,
    CA,
    STATE_DIR,
    JOB,
    NAME,
    PLACEMENT,
    DEVICES,
];

/// How a worker proves who it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Credentials {
    /// Certificate, key and CA files issued by the placer.
    Files {
        /// The job's CA certificate.
        ca: PathBuf,
        /// The worker's certificate.
        cert: PathBuf,
        /// Its key.
        key: PathBuf,
    },
    /// A development state directory's PKI.
    StateDir(PathBuf),
}

/// What a placer tells a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerEnv {
    /// The coordinators' addresses, in the order to try them.
    pub coordinators: Vec<String>,
    /// How the worker proves who it is.
    pub credentials: Credentials,
    /// The job's name.
    pub job: String,
    /// The worker's name.
    pub name: String,
    /// The placement it was started for.
    pub placement: Option<u64>,
    /// The devices of its slot (`CUDA_VISIBLE_DEVICES`), if the slot names them.
    pub devices: Option<Vec<u32>>,
}

/// The contract's environment is missing or malformed.
#[derive(Debug, thiserror::Error)]
#[error("{var}: {message} (a placer sets it; see edl_shared::contract)")]
pub struct ContractError {
    /// The variable.
    pub var: &'static str,
    /// What is wrong with it.
    pub message: String,
}

impl WorkerEnv {
    /// The variables to set in the worker's environment.
    pub fn vars(&self) -> Vec<(&'static str, OsString)> {
        let mut out = vec![
            (COORDINATOR, self.coordinators.join(",").into()),
            (JOB, self.job.clone().into()),
            (NAME, self.name.clone().into()),
        ];
        match &self.credentials {
            Credentials::Files { ca, cert, key } => {
                out.push((CA, ca.clone().into_os_string()));
                out.push((CERT, cert.clone().into_os_string()));
                out.push((KEY, key.clone().into_os_string()));
            }
            Credentials::StateDir(dir) => out.push((STATE_DIR, dir.clone().into_os_string())),
        }
        if let Some(p) = self.placement {
            out.push((PLACEMENT, p.to_string().into()));
        }
        if let Some(d) = &self.devices {
            let list: Vec<String> = d.iter().map(u32::to_string).collect();
            out.push((DEVICES, list.join(",").into()));
        }
        out
    }

    /// Reads the contract from this process's environment.
    pub fn from_env() -> Result<WorkerEnv, ContractError> {
        WorkerEnv::from_vars(|k| std::env::var_os(k))
    }

    /// Reads the contract from `get` (a variable's value by name). Only `EDL_COORDINATOR`,
    /// `EDL_NAME` and the credentials are required; `EDL_JOB` defaults to the certificate's
    /// job, so an empty string.
    pub fn from_vars(get: impl Fn(&str) -> Option<OsString>) -> Result<WorkerEnv, ContractError> {
        let text = |var: &'static str| -> Result<Option<String>, ContractError> {
            get(var)
                .map(|v| {
                    v.into_string().map_err(|_| ContractError {
                        var,
                        message: "not valid UTF-8".into(),
                    })
                })
                .transpose()
        };
        let required = |var: &'static str| -> Result<String, ContractError> {
            text(var)?
                .filter(|v| !v.is_empty())
                .ok_or_else(|| ContractError {
                    var,
                    message: "not set".into(),
                })
        };
        let coordinators: Vec<String> = required(COORDINATOR)?
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        if coordinators.is_empty() {
            return Err(ContractError {
                var: COORDINATOR,
                message: "names no address".into(),
            });
        }
        let name = required(NAME)?;
        let path = |var| get(var).filter(|v| !v.is_empty()).map(PathBuf::from);
        let credentials = match (path(CA), path(CERT), path(KEY)) {
            (Some(ca), Some(cert), Some(key)) => Credentials::Files { ca, cert, key },
            (None, None, None) => match path(STATE_DIR) {
                Some(dir) => Credentials::StateDir(dir),
                None => {
                    return Err(ContractError {
                        var: CERT,
                        message: format!("not set, and neither is {STATE_DIR}"),
                    });
                }
            },
            _ => {
                return Err(ContractError {
                    var: CERT,
                    message: format!("{CA}, {CERT} and {KEY} go together: set all three"),
                });
            }
        };
        let placement = text(PLACEMENT)?
            .filter(|v| !v.is_empty())
            .map(|v| {
                v.parse().map_err(|_| ContractError {
                    var: PLACEMENT,
                    message: format!("{v:?} is not a placement id"),
                })
            })
            .transpose()?;
        let devices = text(DEVICES)?
            .filter(|v| !v.is_empty())
            .map(|v| {
                v.split(',')
                    .map(|d| d.trim().parse::<u32>())
                    .collect::<Result<Vec<u32>, _>>()
                    .map_err(|_| ContractError {
                        var: DEVICES,
                        message: format!("{v:?} is not a list of device numbers"),
                    })
            })
            .transpose()?;
        Ok(WorkerEnv {
            coordinators,
            credentials,
            job: text(JOB)?.unwrap_or_default(),
            name,
            placement,
            devices,
        })
    }
}

/// `program` as a placer runs it from `dir`: a path with a slash is taken relative to `dir`
/// (the job file's folder), a bare name is looked up on `PATH` when the process starts.
pub fn resolve_program(program: &str, dir: &Path) -> PathBuf {
    let p = Path::new(program);
    if p.is_absolute() || !program.contains('/') {
        p.to_path_buf()
    } else {
        dir.join(p)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn read(vars: &[(&str, &str)]) -> Result<WorkerEnv, ContractError> {
        let map: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        WorkerEnv::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn the_environment_round_trips() {
        for credentials in [
            Credentials::Files {
                ca: "/j/pki/ca.pem".into(),
                cert: "/j/pki/w.pem".into(),
                key: "/j/pki/w.key".into(),
            },
            Credentials::StateDir("/tmp/edl-state".into()),
        ] {
            let env = WorkerEnv {
                coordinators: vec!["10.0.0.1:7070".into(), "10.0.0.2:7070".into()],
                credentials,
                job: "j4".into(),
                name: "p3".into(),
                placement: Some(3),
                devices: Some(vec![2, 5]),
            };
            let vars: HashMap<&str, OsString> = env.vars().into_iter().collect();
            assert_eq!(vars[COORDINATOR], "10.0.0.1:7070,10.0.0.2:7070");
            assert_eq!(vars[DEVICES], "2,5");
            let back = WorkerEnv::from_vars(|k| vars.get(k).cloned()).expect("read back");
            assert_eq!(back, env);
        }
    }

    #[test]
    fn missing_or_malformed_variables_are_named() {
        let base = [(COORDINATOR, "127.0.0.1:1"), (NAME, "w"), (STATE_DIR, "s")];
        let ok = read(&base).expect("minimal");
        assert_eq!(ok.placement, None);
        assert_eq!(ok.job, "");
        let cases: [(&[(&str, &str)], &str); 6] = [
            (&[(NAME, "w"), (STATE_DIR, "s")], COORDINATOR),
            (
                &[(COORDINATOR, " , "), (NAME, "w"), (STATE_DIR, "s")],
                COORDINATOR,
            ),
            (&[(COORDINATOR, "a:1"), (STATE_DIR, "s")], NAME),
            (&[(COORDINATOR, "a:1"), (NAME, "w")], CERT),
            (&[(COORDINATOR, "a:1"), (NAME, "w"), (CERT, "c")], CERT),
            (
                &[
                    (COORDINATOR, "a:1"),
                    (NAME, "w"),
                    (STATE_DIR, "s"),
                    (PLACEMENT, "x"),
                ],
                PLACEMENT,
            ),
        ];
        for (vars, var) in cases {
            let e = read(vars).expect_err("must fail");
            assert_eq!(e.var, var, "{vars:?}: {e}");
        }
        let e = read(&[
            (COORDINATOR, "a:1"),
            (NAME, "w"),
            (STATE_DIR, "s"),
            (DEVICES, "0,x"),
        ])
        .expect_err("devices");
        assert_eq!(e.var, DEVICES);
    }

    #[test]
    fn programs_resolve_against_the_job_folder() {
        let dir = Path::new("/jobs/cnn");
        assert_eq!(resolve_program("python3", dir), Path::new("python3"));
        assert_eq!(
            resolve_program("./train", dir),
            Path::new("/jobs/cnn/./train")
        );
        assert_eq!(
            resolve_program("bin/train", dir),
            Path::new("/jobs/cnn/bin/train")
        );
        assert_eq!(
            resolve_program("/usr/bin/env", dir),
            Path::new("/usr/bin/env")
        );
    }
}
