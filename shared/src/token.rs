//! Worker tokens: the coordinator's proof, checked by shards, that a worker id belongs to the
//! certificate that pushes with it.
//!
//! At registration the coordinator issues `HMAC-SHA256(key, job ‖ worker id ‖ name)`, where
//! `name` is the name in the worker's certificate and `key` is the job's token key, which the
//! coordinator creates once, keeps in its durable state and hands to each shard when it joins
//! (over mutual TLS). A shard recomputes the MAC from the push's worker id and the name in the
//! pushing connection's certificate, so a token is worthless to any other certificate, and a
//! worker id without its token is worthless to anyone.

use aws_lc_rs::hmac;
use edl_proto::{Token, WorkerId};

/// A new random token key.
pub fn new_key() -> Token {
    let mut key = [0u8; 32];
    // The system's random source failing is not something to run a cluster on.
    if aws_lc_rs::rand::fill(&mut key).is_err() {
        panic!("the system random source failed");
    }
    Token(key)
}

/// Issues and checks the tokens of one job under one key. The HMAC key is set up once (a
/// shard keeps one for all its pushes), not per token.
pub struct Signer {
    key: hmac::Key,
    job: String,
}

impl std::fmt::Debug for Signer {
    /// Never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer").field("job", &self.job).finish()
    }
}

impl Signer {
    /// A signer for job `job` under `key`.
    pub fn new(key: &Token, job: &str) -> Self {
        Signer {
            key: hmac::Key::new(hmac::HMAC_SHA256, &key.0),
            job: job.to_string(),
        }
    }

    fn message(&self, worker: WorkerId, name: &str) -> Vec<u8> {
        let mut m = Vec::with_capacity(40 + self.job.len() + name.len());
        m.extend_from_slice(b"edl worker token v1\0");
        m.extend_from_slice(&(self.job.len() as u64).to_le_bytes());
        m.extend_from_slice(self.job.as_bytes());
        m.extend_from_slice(&worker.0.to_le_bytes());
        m.extend_from_slice(name.as_bytes());
        m
    }

    /// The token of worker `worker` registered by certificate name `name`.
    pub fn issue(&self, worker: WorkerId, name: &str) -> Token {
        let tag = hmac::sign(&self.key, &self.message(worker, name));
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        Token(out)
    }

    /// Whether `token` is the one issued to `worker` for `name` (in constant time).
    pub fn verify(&self, worker: WorkerId, name: &str, token: &Token) -> bool {
        hmac::verify(&self.key, &self.message(worker, name), &token.0).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_bound_to_its_worker_name_job_and_key() {
        let key = new_key();
        let s = Signer::new(&key, "default");
        let t = s.issue(WorkerId(3), "w1");
        assert!(s.verify(WorkerId(3), "w1", &t));
        assert!(!s.verify(WorkerId(4), "w1", &t));
        assert!(!s.verify(WorkerId(3), "w2", &t));
        assert!(!Signer::new(&key, "other").verify(WorkerId(3), "w1", &t));
        assert!(!Signer::new(&new_key(), "default").verify(WorkerId(3), "w1", &t));
        assert!(!s.verify(WorkerId(3), "w1", &Token::default()));
    }
}
