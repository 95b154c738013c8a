//! Gradient buffers that a push sends as they lie, without a copy into a wire buffer.

use std::ops::Deref;
use std::sync::Arc;

use bytes::Bytes;

/// A gradient vector that a push sends without copying it: the pushed bytes are the buffer
/// itself, shared with the transport until the shards have acknowledged them (QUIC keeps sent
/// bytes until then, to send them again if a packet is lost). NaN and infinity are refused
/// with nothing applied: the values are checked while QUIC sends them, and the shards act on
/// the push only once every part passed (with one shard, that shard checks them).
///
/// Write the next gradient through [`Gradients::as_mut_slice`]: a buffer still held by the
/// transport is first copied into one of its own, so a push never sends values written after
/// it (normally the acknowledgements have arrived before the push returns, and nothing is
/// copied).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Gradients {
    values: Arc<Vec<f32>>,
}

impl Gradients {
    /// `len` zeros.
    pub fn zeros(len: usize) -> Self {
        Gradients::from(vec![0.0; len])
    }

    /// The values to write the next gradient into.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        Arc::make_mut(&mut self.values).as_mut_slice()
    }

    /// Whether a push still holds the buffer (writing through [`Gradients::as_mut_slice`]
    /// now would copy it).
    pub fn in_flight(&self) -> bool {
        Arc::strong_count(&self.values) > 1
    }

    /// `len` values from `offset` as little-endian wire bytes: the buffer itself on
    /// little-endian machines, shared; elsewhere a converted copy.
    pub(crate) fn wire(&self, offset: usize, len: usize) -> Bytes {
        /// Holds the buffer while the transport sends it.
        struct Held(Arc<Vec<f32>>);
        impl AsRef<[u8]> for Held {
            fn as_ref(&self) -> &[u8] {
                bytemuck::cast_slice(self.0.as_slice())
            }
        }
        if cfg!(target_endian = "little") {
            Bytes::from_owner(Held(self.values.clone())).slice(offset * 4..(offset + len) * 4)
        } else {
            edl_shared::proto::frame::f32s_to_bytes(&self.values[offset..offset + len])
        }
    }
}

impl From<Vec<f32>> for Gradients {
    fn from(values: Vec<f32>) -> Self {
        Gradients {
            values: Arc::new(values),
        }
    }
}

impl Deref for Gradients {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        self.values.as_slice()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_bytes_share_the_buffer_and_writing_while_held_copies_it() {
        let mut g = Gradients::from(vec![1.0, 2.0, 3.0, 4.0]);
        let wire = g.wire(1, 2);
        let want: Vec<u8> = [2.0f32, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(&wire[..], &want[..]);
        assert!(g.in_flight());
        // Written while the transport holds it: the sent bytes keep the old values.
        g.as_mut_slice()[1] = 9.0;
        assert_eq!(&wire[..], &want[..]);
        assert_eq!(&g[..], &[1.0, 9.0, 3.0, 4.0]);
        drop(wire);
        assert!(!g.in_flight());
        let before = g.as_ptr();
        g.as_mut_slice()[0] = 5.0;
        assert_eq!(g.as_ptr(), before, "a free buffer is written in place");
    }
}
