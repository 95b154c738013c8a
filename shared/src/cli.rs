//! Command-line pieces shared by every EDL binary: where credentials and state live.

use std::path::PathBuf;

use crate::pki::{Identity, PkiDir, PkiError, Role, load_identity};

/// Credential and state flags.
#[derive(Clone, Debug, clap::Args)]
pub struct IdentityArgs {
    /// State directory. Holds the cluster PKI under `pki/` unless --ca/--cert/--key are given;
    /// if no CA exists there, a dev CA and this node's certificate are created (local runs).
    #[arg(long, env = "EDL_STATE_DIR", default_value = "edl-state")]
    pub state_dir: PathBuf,
    /// Cluster CA certificate (PEM). Peers must present certificates signed by it.
    #[arg(long, requires_all = ["cert", "key"])]
    pub ca: Option<PathBuf>,
    /// This node's certificate (PEM), signed by the cluster CA, subject CN `ROLE/NAME`.
    #[arg(long, requires_all = ["ca", "key"])]
    pub cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long, requires_all = ["ca", "cert"])]
    pub key: Option<PathBuf>,
}

impl IdentityArgs {
    /// Loads the explicit certificate files, or the state directory's certificate for
    /// `role/name` (issuing it, and a dev CA, if missing).
    pub fn identity(&self, role: Role, name: &str) -> Result<Identity, PkiError> {
        match (&self.ca, &self.cert, &self.key) {
            (Some(ca), Some(cert), Some(key)) => {
                let id = load_identity(ca, cert, key)?;
                if id.role != role {
                    return Err(PkiError::BadSubject(format!(
                        "certificate {} is for role {}, this process needs {role}",
                        cert.display(),
                        id.role
                    )));
                }
                Ok(id)
            }
            _ => PkiDir::new(&self.state_dir).ensure(role, name),
        }
    }
}
