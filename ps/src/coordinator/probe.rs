//! Finding a dead worker before its lease runs out: a worker that has gone silent gets a
//! one-byte UDP datagram at the address its QUIC connection comes from, every sweep, from a
//! connected socket of the coordinator's. While the worker's process lives (even stopped by
//! SIGSTOP, or paused by a long GC or swap) its socket exists and the kernel queues the
//! datagram, which QUIC discards as garbage; once the process is gone the kernel of its host
//! answers "port unreachable" (ICMP), which a connected UDP socket reports as
//! `ECONNREFUSED`. That answer, and nothing else, declares the worker dead early; silence
//! alone (a partitioned network, a dead host, a filtered ICMP) is left to the lease.

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::time::Duration;

use edl_shared::proto::WorkerId;

/// A worker not heard from this long is probed. Working workers report every step and
/// heartbeat every quarter lease; this is short enough that a death is found within a second
/// of the last word, and probing a live worker costs it one ignored datagram per sweep.
pub const SILENT: Duration = Duration::from_millis(250);

/// The longest time between sweeps while probing: a death is found within about
/// `SILENT + 2 * TICK` on loopback (one tick sends, the next reads the answer).
pub const TICK: Duration = Duration::from_millis(100);

/// One worker's probe: the address probed and a socket connected to it.
#[derive(Debug)]
struct Probe {
    addr: SocketAddr,
    socket: UdpSocket,
}

/// The probes of the workers (or, with another `K`, the shard servers) now silent.
#[derive(Debug)]
pub struct Prober<K = WorkerId> {
    probes: HashMap<K, Probe>,
}

impl<K> Default for Prober<K> {
    fn default() -> Self {
        Prober {
            probes: HashMap::new(),
        }
    }
}

impl<K: Copy + Eq + std::hash::Hash + std::fmt::Display> Prober<K> {
    /// Probes each of the `silent` workers (id and the address it registered from) and
    /// returns those found gone. Workers no longer silent lose their probe; an address that
    /// does not parse, or a socket that cannot be made, is skipped (the lease still holds).
    pub fn check(&mut self, silent: &[(K, String)]) -> Vec<(K, SocketAddr)> {
        self.probes
            .retain(|id, _| silent.iter().any(|(s, _)| s == id));
        let mut gone = Vec::new();
        for (id, addr) in silent {
            let Ok(addr) = addr.parse::<SocketAddr>() else {
                continue;
            };
            if self.probes.get(id).is_some_and(|p| p.addr != addr) {
                self.probes.remove(id);
            }
            let probe = match self.probes.get(id) {
                Some(p) => p,
                None => match Probe::new(addr) {
                    Ok(p) => self.probes.entry(*id).or_insert(p),
                    Err(e) => {
                        tracing::debug!(%id, %addr, error = %e, "cannot probe");
                        continue;
                    }
                },
            };
            if probe.gone() {
                gone.push((*id, addr));
            }
        }
        for (id, _) in &gone {
            self.probes.remove(id);
        }
        gone
    }
}

impl Probe {
    fn new(addr: SocketAddr) -> std::io::Result<Probe> {
        let local: SocketAddr = match addr {
            SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let socket = UdpSocket::bind(local)?;
        socket.set_nonblocking(true)?;
        socket.connect(addr)?;
        Ok(Probe { addr, socket })
    }

    /// Whether an earlier datagram was answered "port unreachable"; sends the next one.
    fn gone(&self) -> bool {
        let refused = |e: &std::io::Error| e.kind() == ErrorKind::ConnectionRefused;
        // The kernel keeps the ICMP answer as the socket's pending error.
        if self
            .socket
            .take_error()
            .ok()
            .flatten()
            .is_some_and(|e| refused(&e))
        {
            return true;
        }
        // QUIC drops a one-byte datagram (no packet is that short) without answering.
        match self.socket.send(&[0]) {
            Err(e) => refused(&e),
            Ok(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits up to a second for `prober` to find worker 1 gone, probing every 20 ms.
    fn found_gone(prober: &mut Prober, silent: &[(WorkerId, String)]) -> bool {
        for _ in 0..50 {
            if !prober.check(silent).is_empty() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    #[test]
    fn a_live_socket_is_not_gone_and_a_closed_one_is() {
        let live = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let addr = live.local_addr().expect("addr");
        let silent = vec![(WorkerId(1), addr.to_string())];
        let mut prober = Prober::default();
        // A socket that exists but never reads (a stopped process) is never reported.
        for _ in 0..10 {
            assert!(prober.check(&silent).is_empty());
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(live);
        assert!(
            found_gone(&mut prober, &silent),
            "the closed socket was not found gone"
        );
        // An unparsable address is skipped, and a worker heard from again loses its probe.
        assert!(prober.check(&[(WorkerId(2), "nowhere".into())]).is_empty());
        assert!(prober.probes.is_empty());
    }
}
