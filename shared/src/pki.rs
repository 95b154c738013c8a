//! The cluster PKI: a CA, node certificates that carry a role, and loading them from disk.
//!
//! Every node certificate is signed by the cluster CA and names its holder in the subject's
//! common name as `ROLE/NAME` (for example `worker/w3`), and the job it belongs to in the
//! subject's organizational unit as `job:JOB` (certificates without one belong to
//! [`DEFAULT_JOB`]). Servers require a client certificate signed by the CA, refuse peers of
//! another job, and read the role and name from it, so identities are checked, not assumed.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use thiserror::Error;

/// The server name every EDL server certificate carries; clients verify against it, so the
/// identity that matters is the CA's signature, not the host name.
pub const CLUSTER_SERVER_NAME: &str = "edl-cluster";

/// The job of certificates issued without one (single-job clusters).
pub const DEFAULT_JOB: &str = "default";

/// The prefix of the organizational unit that names a certificate's job.
const JOB_OU_PREFIX: &str = "job:";

/// What a node may do, read from its certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The coordinator.
    Coordinator,
    /// A shard server.
    Shard,
    /// A training worker (also used by evaluation clients).
    Worker,
    /// An operator tool or launcher.
    Admin,
}

impl Role {
    /// The name used in certificates and file names.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Coordinator => "coordinator",
            Role::Shard => "shard",
            Role::Worker => "worker",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = PkiError;

    fn from_str(s: &str) -> Result<Self, PkiError> {
        Ok(match s {
            "coordinator" => Role::Coordinator,
            "shard" => Role::Shard,
            "worker" => Role::Worker,
            "admin" => Role::Admin,
            _ => return Err(PkiError::BadSubject(format!("unknown role {s:?}"))),
        })
    }
}

/// Why a PKI operation failed.
#[derive(Debug, Error)]
pub enum PkiError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A PEM file held no usable certificate or key.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        what: String,
    },
    /// Certificate generation failed.
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
    /// The CA files are missing.
    #[error(
        "no cluster CA at {0}: run `edl-ps ca init --state-dir DIR` (or let edl-local create a dev CA)"
    )]
    NoCa(PathBuf),
    /// A client's state directory holds no cluster CA (clients never create one).
    #[error(
        "no cluster CA at {0}: a client joins an existing cluster; give the cluster's state \
         directory (--state-dir, the one its coordinator uses) or the cluster CA with a \
         certificate and key it issued (--ca --cert --key; `edl-ps ca issue` makes them)"
    )]
    NoClusterCa(PathBuf),
    /// The CA certificate is here without its key, and the certificate asked for is not.
    #[error(
        "{} is not issued and the cluster CA's key is not in {dir}: issue it where the key is \
         (`edl-ps ca issue --role ROLE --name NAME`) and copy it here, or give --ca --cert --key",
        cert.display()
    )]
    NotIssued {
        /// The certificate that is missing.
        cert: PathBuf,
        /// The PKI directory.
        dir: PathBuf,
    },
    /// A certificate given with a CA that did not issue it (`--ca` of one cluster, `--cert`
    /// of another).
    #[error(
        "{} was not issued by the CA in {} ({why}): give the certificate and key that CA \
         issued (`edl-ps ca issue --state-dir DIR` where its key is), or the CA that issued \
         this certificate",
        cert.display(),
        ca.display()
    )]
    OtherCa {
        /// The certificate.
        cert: PathBuf,
        /// The CA certificate given with it.
        ca: PathBuf,
        /// What the check found.
        why: String,
    },
    /// A CA certificate without its key would have been replaced by a new CA.
    #[error(
        "{0} holds a CA certificate without its key (ca.key): refusing to replace it with a \
         new CA; put the key beside it, or give --ca --cert --key"
    )]
    NoCaKey(PathBuf),
    /// A peer certificate's subject is not `ROLE/NAME`.
    #[error("certificate subject: {0}")]
    BadSubject(String),
    /// TLS configuration failed.
    #[error("TLS configuration: {0}")]
    Tls(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A node's credentials: its certificate chain and key, and the CA it trusts.
#[derive(Debug)]
pub struct Identity {
    /// The role in the certificate.
    pub role: Role,
    /// The name in the certificate.
    pub name: String,
    /// The job in the certificate.
    pub job: String,
    /// The node certificate.
    pub cert: CertificateDer<'static>,
    /// The node's private key.
    pub key: PrivateKeyDer<'static>,
    /// The cluster CA certificate.
    pub ca: CertificateDer<'static>,
}

impl Identity {
    /// An identity without a certificate, for in-process connections (the deterministic
    /// simulation's [`crate::transport::Dialer::Local`]), which carry no TLS: no peer over
    /// QUIC accepts it.
    pub fn unsigned(role: Role, name: &str, job: &str) -> Identity {
        Identity {
            role,
            name: name.to_string(),
            job: job.to_string(),
            cert: CertificateDer::from(Vec::new()),
            key: PrivateKeyDer::Pkcs8(Vec::new().into()),
            ca: CertificateDer::from(Vec::new()),
        }
    }
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Identity {
            role: self.role,
            name: self.name.clone(),
            job: self.job.clone(),
            cert: self.cert.clone(),
            key: self.key.clone_key(),
            ca: self.ca.clone(),
        }
    }
}

/// File locations of a cluster PKI in a state directory.
#[derive(Clone, Debug)]
pub struct PkiDir {
    dir: PathBuf,
}

impl PkiDir {
    /// The PKI under `state_dir/pki`.
    pub fn new(state_dir: &Path) -> Self {
        PkiDir {
            dir: state_dir.join("pki"),
        }
    }

    /// The CA certificate path.
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    fn ca_key(&self) -> PathBuf {
        self.dir.join("ca.key")
    }

    /// The certificate path of a node.
    pub fn node_cert(&self, role: Role, name: &str) -> PathBuf {
        self.dir.join(format!("{role}-{name}.pem"))
    }

    /// The key path of a node.
    pub fn node_key(&self, role: Role, name: &str) -> PathBuf {
        self.dir.join(format!("{role}-{name}.key"))
    }

    /// Creates a new CA unless one exists. Returns true when it created one. A CA certificate
    /// without its key is never replaced (it is a cluster's CA whose key lives elsewhere).
    pub fn init_ca(&self) -> Result<bool, PkiError> {
        if self.ca_cert().exists() && self.ca_key().exists() {
            return Ok(false);
        }
        if self.ca_cert().exists() {
            return Err(PkiError::NoCaKey(self.dir.clone()));
        }
        fs::create_dir_all(&self.dir).map_err(io_err(&self.dir))?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "EDL cluster CA");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key)?;
        write_private(&self.ca_key(), key.serialize_pem().as_bytes())?;
        write_atomic(&self.ca_cert(), cert.pem().as_bytes())?;
        Ok(true)
    }

    /// Issues a certificate for `role/name` of job `job`, signed by the CA, valid for the
    /// cluster server name, `localhost`, loopback and any extra `hosts` (DNS names or IP
    /// addresses).
    pub fn issue(
        &self,
        role: Role,
        name: &str,
        job: &str,
        hosts: &[String],
    ) -> Result<(), PkiError> {
        self.issue_to(
            role,
            name,
            job,
            hosts,
            &self.node_cert(role, name),
            &self.node_key(role, name),
        )
    }

    /// Like [`PkiDir::issue`], but writes the certificate and key to `cert` and `key` (for
    /// nodes of many jobs signed by one CA, each job's files in a directory of its own).
    pub fn issue_to(
        &self,
        role: Role,
        name: &str,
        job: &str,
        hosts: &[String],
        cert: &Path,
        key: &Path,
    ) -> Result<(), PkiError> {
        check_label("name", name)?;
        check_label("job", job)?;
        let ca_pem = read_string(&self.ca_cert()).map_err(|e| match e {
            PkiError::Io { .. } => PkiError::NoCa(self.ca_cert()),
            e => e,
        })?;
        let ca_key = KeyPair::from_pem(&read_string(&self.ca_key())?)?;
        let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key)?;
        let mut names = vec![
            CLUSTER_SERVER_NAME.to_string(),
            "localhost".to_string(),
            "127.0.0.1".to_string(),
            "::1".to_string(),
        ];
        names.extend(hosts.iter().cloned());
        let mut params = CertificateParams::new(names)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("{role}/{name}"));
        dn.push(
            DnType::OrganizationalUnitName,
            format!("{JOB_OU_PREFIX}{job}"),
        );
        params.distinguished_name = dn;
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let pair = KeyPair::generate()?;
        let signed = params.signed_by(&pair, &issuer)?;
        for file in [cert, key] {
            if let Some(dir) = file.parent() {
                fs::create_dir_all(dir).map_err(io_err(dir))?;
            }
        }
        write_private(key, pair.serialize_pem().as_bytes())?;
        write_atomic(cert, signed.pem().as_bytes())?;
        Ok(())
    }

    /// Loads the identity of `role/name`, creating the CA and the certificate first if they do
    /// not exist yet (the dev-CA convenience for a server of a local run).
    pub fn ensure(&self, role: Role, name: &str) -> Result<Identity, PkiError> {
        if self.issued(role, name) {
            return self.load(role, name);
        }
        if self.init_ca()? {
            tracing::warn!(dir = %self.dir.display(), "created a new dev cluster CA");
        }
        if !self.node_cert(role, name).exists() || !self.node_key(role, name).exists() {
            self.issue(role, name, DEFAULT_JOB, &[])?;
        }
        self.load(role, name)
    }

    /// Loads the identity of `role/name` for a client joining an existing cluster (an
    /// administrator, a worker): its certificate, or one issued for job `job` by the cluster
    /// CA in this directory when the CA's key is here. It never creates a CA: a client with a
    /// CA of its own would only be refused by the cluster's servers.
    pub fn member(&self, role: Role, name: &str, job: &str) -> Result<Identity, PkiError> {
        if !self.issued(role, name) {
            if !self.ca_cert().exists() {
                return Err(PkiError::NoClusterCa(self.dir.clone()));
            }
            if !self.ca_key().exists() {
                return Err(PkiError::NotIssued {
                    cert: self.node_cert(role, name),
                    dir: self.dir.clone(),
                });
            }
            self.issue(role, name, job, &[])?;
            tracing::info!(
                dir = %self.dir.display(),
                "issued certificate {role}/{name} with the cluster CA"
            );
        }
        self.load(role, name)
    }

    /// True when the certificate, its key and the CA certificate of `role/name` are here.
    fn issued(&self, role: Role, name: &str) -> bool {
        self.ca_cert().exists()
            && self.node_cert(role, name).exists()
            && self.node_key(role, name).exists()
    }

    /// Loads the existing identity of `role/name`.
    pub fn load(&self, role: Role, name: &str) -> Result<Identity, PkiError> {
        load_identity(
            &self.ca_cert(),
            &self.node_cert(role, name),
            &self.node_key(role, name),
        )
    }
}

/// Loads an identity from explicit PEM files; the role and name come from the certificate.
pub fn load_identity(ca: &Path, cert: &Path, key: &Path) -> Result<Identity, PkiError> {
    let ca_der = CertificateDer::from_pem_file(ca).map_err(|e| PkiError::Pem {
        path: ca.to_path_buf(),
        what: e.to_string(),
    })?;
    let cert_der = CertificateDer::from_pem_file(cert).map_err(|e| PkiError::Pem {
        path: cert.to_path_buf(),
        what: e.to_string(),
    })?;
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| PkiError::Pem {
        path: key.to_path_buf(),
        what: e.to_string(),
    })?;
    issued_by(&cert_der, &ca_der).map_err(|why| PkiError::OtherCa {
        cert: cert.to_path_buf(),
        ca: ca.to_path_buf(),
        why,
    })?;
    let Subject { role, name, job } = subject_of(&cert_der)?;
    Ok(Identity {
        role,
        name,
        job,
        cert: cert_der,
        key: key_der,
        ca: ca_der,
    })
}

/// `Ok` if `ca` signed `cert` (its signature checks with the CA's public key): a peer would
/// refuse the pair otherwise, with a less telling error and only once connected.
fn issued_by(cert: &CertificateDer<'_>, ca: &CertificateDer<'_>) -> Result<(), String> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| format!("unparsable certificate: {e}"))?;
    let (_, ca) = x509_parser::parse_x509_certificate(ca.as_ref())
        .map_err(|e| format!("unparsable CA certificate: {e}"))?;
    cert.verify_signature(Some(ca.public_key()))
        .map_err(|e| format!("its signature does not check with the CA's key: {e}"))
}

/// Who a certificate names: role, name and job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subject {
    /// The role, from the common name `ROLE/NAME`.
    pub role: Role,
    /// The name, from the common name `ROLE/NAME`.
    pub name: String,
    /// The job, from the organizational unit `job:JOB` ([`DEFAULT_JOB`] without one).
    pub job: String,
}

/// Names and jobs go into certificate subjects, file names and logs: keep them plain.
pub fn check_label(what: &str, s: &str) -> Result<(), PkiError> {
    let ok = !s.is_empty()
        && s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(PkiError::BadSubject(format!(
            "{what} {s:?}: use 1 to 64 letters, digits, '-', '_' or '.'"
        )))
    }
}

/// Reads the role, name and job from a certificate's subject.
pub fn subject_of(cert: &CertificateDer<'_>) -> Result<Subject, PkiError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| PkiError::BadSubject(format!("unparsable certificate: {e}")))?;
    let cn = parsed
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .ok_or_else(|| PkiError::BadSubject("no common name".into()))?;
    let (role, name) = cn
        .split_once('/')
        .ok_or_else(|| PkiError::BadSubject(format!("common name {cn:?} is not ROLE/NAME")))?;
    let mut jobs = parsed
        .subject()
        .iter_organizational_unit()
        .filter_map(|ou| ou.as_str().ok())
        .filter_map(|ou| ou.strip_prefix(JOB_OU_PREFIX));
    let job = match (jobs.next(), jobs.next()) {
        (None, _) => DEFAULT_JOB.to_string(),
        (Some(job), None) => job.to_string(),
        (Some(_), Some(_)) => {
            return Err(PkiError::BadSubject(format!(
                "certificate of {cn:?} names more than one job"
            )));
        }
    };
    Ok(Subject {
        role: role.parse()?,
        name: name.to_string(),
        job,
    })
}

fn read_string(path: &Path) -> Result<String, PkiError> {
    fs::read_to_string(path).map_err(io_err(path))
}

/// Writes a file atomically and durably ([`crate::durable::replace`]).
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<(), PkiError> {
    write_with_mode(path, data, 0o644)
}

fn write_private(path: &Path, data: &[u8]) -> Result<(), PkiError> {
    write_with_mode(path, data, 0o600)
}

fn write_with_mode(path: &Path, data: &[u8], mode: u32) -> Result<(), PkiError> {
    crate::durable::replace(path, &[data], mode)
        .map_err(|(path, source)| PkiError::Io { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issue_and_load_carries_role_and_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = PkiDir::new(dir.path());
        assert!(pki.init_ca().expect("ca"));
        assert!(!pki.init_ca().expect("ca again"));
        let id = pki.ensure(Role::Shard, "s0").expect("identity");
        assert_eq!(id.role, Role::Shard);
        assert_eq!(id.name, "s0");
        let again = pki.load(Role::Shard, "s0").expect("load");
        assert_eq!(again.cert, id.cert);
        assert_eq!(again.job, DEFAULT_JOB);
    }

    #[test]
    fn the_job_travels_in_the_certificate() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = PkiDir::new(dir.path());
        pki.init_ca().expect("ca");
        pki.issue(Role::Worker, "w1", "mnist-7", &[])
            .expect("issue");
        let id = pki.load(Role::Worker, "w1").expect("load");
        assert_eq!((id.role, id.name.as_str()), (Role::Worker, "w1"));
        assert_eq!(id.job, "mnist-7");
        let err = pki
            .issue(Role::Worker, "w/2", DEFAULT_JOB, &[])
            .expect_err("a slash would change the subject's meaning");
        assert!(err.to_string().contains("w/2"), "{err}");
    }

    #[test]
    fn issue_without_ca_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = PkiDir::new(dir.path());
        let err = pki
            .issue(Role::Worker, "w", DEFAULT_JOB, &[])
            .expect_err("no CA");
        assert!(matches!(err, PkiError::NoCa(_)), "{err}");
    }
}
