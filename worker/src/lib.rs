//! The EDL worker: the client library ([`client`]), the training loop ([`trainer`]), the
//! built-in models ([`model`]), compute backends ([`backend`]) and the dataset reader ([`data`]).

pub mod backend;
pub mod client;
pub mod data;
pub mod model;
pub mod trainer;

pub use client::{ClientConfig, ClientError, Job, Session};
