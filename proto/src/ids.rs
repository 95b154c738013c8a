//! Newtype identifiers that cross the wire: workers, shards, keys, shard-map epochs and clocks.

use std::fmt;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(
            Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default,
            rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
        )]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl From<&rkyv::Archived<$name>> for $name {
            fn from(a: &rkyv::Archived<$name>) -> Self {
                $name(a.0.into())
            }
        }
    };
}

id_type!(
    /// A worker's identity within one job, assigned by the coordinator at registration.
    WorkerId(u64), "worker#"
);
id_type!(
    /// A shard server's identity, assigned by the coordinator when the shard joins.
    ShardId(u32), "s"
);
id_type!(
    /// A parameter key: one fixed-size chunk of one tensor (see [`crate::KeyLayout`]).
    Key(u64), "k"
);
id_type!(
    /// The version of the shard map. Requests routed with an older epoch are refused.
    MapEpoch(u64), "e"
);
id_type!(
    /// A worker's logical clock: the number of training steps it has completed.
    Clock(u64), "c"
);

/// A 32-byte secret or MAC: the coordinator's token key, and the token it issues to a worker
/// (a MAC of the job, the worker id and the worker's certificate name under that key).
#[derive(
    Clone, Copy, PartialEq, Eq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct Token(pub [u8; 32]);

impl fmt::Debug for Token {
    /// Never prints the bytes: tokens and keys are secrets.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}
