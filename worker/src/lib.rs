//! The EDL worker: the training loop ([`trainer`]) over the client library ([`client`], the
//! `edl-client` crate), the model and dataset seams ([`workload`]), the built-in models (the
//! MLP in [`model`], logistic regression in [`logreg`]), compute backends ([`backend`]) and
//! the idx image reader ([`data`]).

pub mod backend;
pub use edl_client as client;
pub mod data;
pub mod logreg;
pub mod model;
pub mod trainer;
pub mod workload;

pub use client::{ClientConfig, ClientError, Gradients, Job, Session};
