//! A network link as a real network has one: a veth pair with a set MTU between this process's
//! namespace and a fresh network namespace (`edl-bench transport --netns --mtu M`). The
//! servers of a benchmark run on a runtime whose threads live in that namespace, so every
//! socket they open is behind the link; the clients stay outside and cross it.
//!
//! A veth device keeps the segmentation offloads a NIC has (TSO and GSO on, as the kernel
//! creates it): TCP hands it 64 KiB segments and QUIC its batches of datagrams, each held to
//! the MTU, as on a physical link with offloads. What it lacks is a wire: no serialization
//! delay and no loss, so the figures are the hosts' costs, which is what the transports differ in.
//!
//! Needs root (CAP_NET_ADMIN) and `ip` (iproute2). The namespace and the pair are removed
//! when the [`Link`] is dropped (deleting the namespace deletes the pair).

use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::Arc;

use anyhow::Context;

/// A veth pair between this namespace and a namespace of its own.
pub struct Link {
    /// The namespace's name (`ip netns list`).
    pub ns: String,
    /// The MTU of both ends.
    pub mtu: u32,
    /// The address of the end inside the namespace: servers listen here.
    pub server_ip: Ipv4Addr,
    /// The address of the end in this namespace.
    pub client_ip: Ipv4Addr,
    /// The end in this namespace.
    host: String,
    /// The namespace, held open for threads to enter.
    file: Arc<std::fs::File>,
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running `ip` (iproute2): install it (Debian: iproute2)")?;
    anyhow::ensure!(
        out.status.success(),
        "`ip {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

impl Link {
    /// Creates the namespace and the pair, with `mtu` on both ends, addresses on a /30 and
    /// both ends up. Fails with what to do where this process may not (not root).
    pub fn create(mtu: u32) -> anyhow::Result<Link> {
        anyhow::ensure!(
            (1280..=65535).contains(&mtu),
            "--mtu {mtu}: from 1280 to 65535"
        );
        let pid = std::process::id();
        let ns = format!("edlb{pid}");
        // Interface names are at most 15 bytes.
        let (host, peer) = (format!("edlb{pid}h"), format!("edlb{pid}n"));
        // A /30 of 10.213.0.0/16 picked by the process id, away from common networks.
        let net = (pid % 16_000) * 4;
        let octets = |host: u32| {
            let v = net + host;
            Ipv4Addr::new(10, 213, (v >> 8) as u8, (v & 0xff) as u8)
        };
        let (client_ip, server_ip) = (octets(1), octets(2));
        if let Err(e) = ip(&["netns", "add", &ns]) {
            return Err(e.context(
                "creating a network namespace needs root (CAP_NET_ADMIN); run without --netns \
                 for loopback figures",
            ));
        }
        // From here on, dropping the link removes what was made.
        let file = match std::fs::File::open(format!("/run/netns/{ns}")) {
            Ok(f) => Arc::new(f),
            Err(e) => {
                let _ = ip(&["netns", "del", &ns]);
                return Err(anyhow::anyhow!("opening /run/netns/{ns}: {e}"));
            }
        };
        let link = Link {
            ns: ns.clone(),
            mtu,
            server_ip,
            client_ip,
            host: host.clone(),
            file,
        };
        let mtu_s = mtu.to_string();
        let (client_cidr, server_cidr) = (format!("{client_ip}/30"), format!("{server_ip}/30"));
        ip(&[
            "link", "add", &host, "mtu", &mtu_s, "type", "veth", "peer", "name", &peer, "mtu",
            &mtu_s, "netns", &ns,
        ])?;
        ip(&["addr", "add", &client_cidr, "dev", &host])?;
        ip(&["link", "set", &host, "up"])?;
        ip(&["-n", &ns, "addr", "add", &server_cidr, "dev", &peer])?;
        ip(&["-n", &ns, "link", "set", &peer, "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        Ok(link)
    }

    /// Moves the calling thread into the namespace: sockets it opens from now on are behind
    /// the link.
    pub fn enter(&self) -> anyhow::Result<()> {
        nix::sched::setns(self.file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
            .with_context(|| format!("entering network namespace {}", self.ns))
    }

    /// A runtime of `threads` worker threads, each in the namespace (its blocking threads
    /// too): what runs on it binds behind the link.
    pub fn runtime(&self, threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
        // Checked once here, where it can be reported: a thread that cannot enter later
        // aborts the process.
        std::thread::scope(|s| s.spawn(|| self.enter()).join())
            .map_err(|_| anyhow::anyhow!("a thread entering {} panicked", self.ns))??;
        let file = self.file.clone();
        let ns = self.ns.clone();
        Ok(tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name(format!("{ns}-server"))
            .enable_all()
            .on_thread_start(move || {
                // A thread left outside would bind on the wrong side; nothing to recover.
                if let Err(e) =
                    nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                {
                    eprintln!("a server thread could not enter {ns}: {e}");
                    std::process::abort();
                }
            })
            .build()?)
    }

    /// One line for a report: the link and its MTU.
    pub fn describe(&self) -> String {
        format!(
            "veth pair, MTU {} ({} -> {} in namespace {})",
            self.mtu, self.client_ip, self.server_ip, self.ns
        )
    }

    /// Limits both directions of the link to `bits_per_s` with the kernel's token bucket
    /// (`tc qdisc ... tbf`): a 128 KiB bucket and packets that would wait more than 20 ms
    /// dropped, as the fault layer's rate does.
    pub fn limit(&self, bits_per_s: u64) -> anyhow::Result<()> {
        let rate = format!("{bits_per_s}bit");
        let tbf = [
            "root", "tbf", "rate", &rate, "burst", "128kb", "latency", "20ms",
        ];
        let peer = format!("{}n", self.host.trim_end_matches('h'));
        for (netns, dev) in [(None, self.host.as_str()), (Some(self.ns.as_str()), &peer)] {
            let mut args = vec![];
            if let Some(ns) = netns {
                args.extend(["-n", ns]);
            }
            args.extend(["qdisc", "add", "dev", dev]);
            args.extend(tbf);
            let out = Command::new("tc")
                .args(&args)
                .output()
                .context("running `tc` (iproute2): install it (Debian: iproute2)")?;
            anyhow::ensure!(
                out.status.success(),
                "`tc {}` failed: {} (the kernel needs sch_tbf)",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
}

/// A link and the runtime its servers run on. Dropped (an error, a panic), the runtime is shut
/// down without waiting, which is allowed inside another runtime, and the link removed.
pub struct Servers {
    rt: Option<tokio::runtime::Runtime>,
    link: Link,
}

impl Servers {
    /// A link of `mtu` and a runtime of `threads` threads behind it.
    pub fn start(mtu: u32, threads: usize) -> anyhow::Result<Servers> {
        let link = Link::create(mtu)?;
        let rt = link.runtime(threads)?;
        Ok(Servers { rt: Some(rt), link })
    }

    /// The link.
    pub fn link(&self) -> &Link {
        &self.link
    }

    /// The servers' runtime.
    pub fn runtime(&self) -> Option<&tokio::runtime::Runtime> {
        self.rt.as_ref()
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Deleting one end deletes the pair; the namespace goes once no thread is left in it.
        let _ = ip(&["link", "del", &self.host]);
        if let Err(e) = ip(&["netns", "del", &self.ns]) {
            eprintln!("removing network namespace {}: {e}", self.ns);
        }
    }
}
