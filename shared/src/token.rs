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

fn message(job: &str, worker: WorkerId, name: &str) -> Vec<u8> {
    let mut m = Vec::with_capacity(64);
    m.extend_from_slice(b"edl worker token v1\0");
    m.extend_from_slice(&(job.len() as u64).to_le_bytes());
    m.extend_from_slice(job.as_bytes());
    m.extend_from_slice(&worker.0.to_le_bytes());
    m.extend_from_slice(name.as_bytes());
    m
}

/// The token of worker `worker` registered by certificate name `name` in job `job`.
pub fn issue(key: &Token, job: &str, worker: WorkerId, name: &str) -> Token {
    let tag = hmac::sign(
        &hmac::Key::new(hmac::HMAC_SHA256, &key.0),
        &message(job, worker, name),
    );
    let mut out = [0u8; 32];
    out.copy_from_slice(tag.as_ref());
    Token(out)
}

/// Whether `token` is the one issued to `worker` for `name` in `job` (in constant time).
pub fn verify(key: &Token, job: &str, worker: WorkerId, name: &str, token: &Token) -> bool {
    hmac::verify(
        &hmac::Key::new(hmac::HMAC_SHA256, &key.0),
        &message(job, worker, name),
        &token.0,
    )
    .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_bound_to_its_worker_name_job_and_key() {
        let key = new_key();
        let t = issue(&key, "default", WorkerId(3), "w1");
        assert!(verify(&key, "default", WorkerId(3), "w1", &t));
        assert!(!verify(&key, "default", WorkerId(4), "w1", &t));
        assert!(!verify(&key, "default", WorkerId(3), "w2", &t));
        assert!(!verify(&key, "other", WorkerId(3), "w1", &t));
        assert!(!verify(&new_key(), "default", WorkerId(3), "w1", &t));
        assert!(!verify(
            &key,
            "default",
            WorkerId(3),
            "w1",
            &Token::default()
        ));
    }
}
