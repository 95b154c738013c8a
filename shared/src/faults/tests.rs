//! Unit tests of the fault plan: decisions, rules, partitions and specs.

use super::*;

fn a(s: &str) -> SocketAddr {
    s.parse().expect("test address")
}

fn fates(f: &Faults, n: usize) -> Vec<Fate> {
    let mut d = f.dice(0);
    (0..n)
        .map(|i| {
            let at = Duration::from_millis(i as u64);
            d.fate_at(a("127.0.0.1:1000"), a("127.0.0.1:2000"), at)
        })
        .collect()
}

fn lossy(seed: u64) -> Faults {
    let f = Faults::new(seed);
    f.set_default(
        LinkFaults::clean()
            .with_loss(0.1)
            .with_delay(Duration::from_millis(20), Duration::from_millis(5))
            .with_duplicate(0.05),
    );
    f
}

#[test]
fn faults_same_seed_same_decisions() {
    let (x, y, z) = (
        fates(&lossy(7), 2000),
        fates(&lossy(7), 2000),
        fates(&lossy(8), 2000),
    );
    assert_eq!(x, y);
    assert_ne!(x, z);
    let lost = x.iter().filter(|f| **f == Fate::Lost).count();
    assert!((120..=280).contains(&lost), "10% of 2000 lost, got {lost}");
    for f in &x {
        if let Fate::Deliver { delay, copy, .. } = f {
            for d in std::iter::once(delay).chain(copy) {
                assert!(*d >= Duration::from_millis(15) && *d <= Duration::from_millis(25));
            }
        }
    }
    assert!(
        x.iter()
            .any(|f| matches!(f, Fate::Deliver { copy: Some(_), .. }))
    );
}

#[test]
fn faults_rule_changes_do_not_shift_later_decisions() {
    let f = lossy(3);
    let mut d = f.dice(0);
    let (s, t) = (a("127.0.0.1:1000"), a("127.0.0.1:2000"));
    let first: Vec<_> = (0..10).map(|_| d.fate_at(s, t, Duration::ZERO)).collect();
    f.partition(s, t);
    let cut: Vec<_> = (0..10).map(|_| d.fate_at(s, t, Duration::ZERO)).collect();
    assert!(cut.iter().all(|x| *x == Fate::Partitioned));
    f.heal_all();
    let after: Vec<_> = (0..10).map(|_| d.fate_at(s, t, Duration::ZERO)).collect();
    let all = fates(&lossy(3), 30);
    assert_eq!(first[..], all[..10]);
    assert_eq!(after[..], all[20..]);
}

#[test]
fn faults_partitions_by_address_name_and_schedule() {
    let f = Faults::new(1);
    let (s0, s1, w) = (a("127.0.0.1:7000"), a("127.0.0.1:7001"), a("0.0.0.0:9000"));
    let w_seen = a("127.0.0.1:9000");
    f.name("s0", s0);
    f.partition("s0", w);
    assert!(
        f.is_partitioned(s0, w_seen),
        "unspecified IP matches loopback"
    );
    assert!(f.is_partitioned(w, s0));
    assert!(!f.is_partitioned(s1, w_seen));
    f.heal("s0", w);
    assert!(!f.is_partitioned(s0, w_seen));
    f.isolate(s1);
    assert!(f.is_partitioned(w, s1) && f.is_partitioned(s1, s0));
    assert!(!f.is_partitioned(w, s0));
    f.heal(s1, "*");
    assert!(!f.is_partitioned(w, s1));
    f.partition_during(s0, s1, Duration::from_secs(1), Duration::from_secs(2));
    let mut d = f.dice(0);
    let at = |s| Duration::from_millis(s);
    assert_ne!(d.fate_at(s0, s1, at(999)), Fate::Partitioned);
    assert_eq!(d.fate_at(s1, s0, at(1000)), Fate::Partitioned);
    assert_ne!(d.fate_at(s0, s1, at(2000)), Fate::Partitioned);
    f.heal_all();
    assert_ne!(d.fate_at(s1, s0, at(1500)), Fate::Partitioned);
}

#[test]
fn faults_link_rules_latest_wins() {
    let f = Faults::new(1);
    let (x, y) = (a("127.0.0.1:1"), a("127.0.0.1:2"));
    f.set_default(LinkFaults::clean().with_loss(1.0));
    f.set_link(x, "*", LinkFaults::clean());
    let mut d = f.dice(0);
    assert_eq!(d.fate_at(y, x, Duration::ZERO), Fate::Lost);
    assert!(matches!(
        d.fate_at(x, y, Duration::ZERO),
        Fate::Deliver { .. }
    ));
    f.set_link("*", y, LinkFaults::clean().with_loss(1.0));
    assert_eq!(d.fate_at(x, y, Duration::ZERO), Fate::Lost);
    f.clear_links();
    assert!(matches!(
        d.fate_at(y, x, Duration::ZERO),
        Fate::Deliver { .. }
    ));
}

#[test]
fn faults_spec_parses_and_refuses() -> Result<(), FaultSpecError> {
    let f = Faults::parse(
        "seed=7, loss=0.02,delay=50ms,jitter=10ms,dup=0.01,reorder=0.1,reorder_delay=1.5s,\
         partition=127.0.0.1:7001@5..10,partition=127.0.0.1:1/[::1]:2@0.5..",
    )?
    .expect("faults");
    assert_eq!(f.seed(), 7);
    let r = f.rules();
    assert_eq!(
        r.default,
        LinkFaults {
            loss: 0.02,
            delay: Duration::from_millis(50),
            jitter: Duration::from_millis(10),
            reorder: 0.1,
            reorder_delay: Duration::from_millis(1500),
            duplicate: 0.01,
            rate: None,
        }
    );
    assert_eq!(r.cuts.len(), 2);
    assert_eq!(r.cuts[0].b, Peer::Any);
    assert_eq!(
        r.cuts[0].window,
        Some((Duration::from_secs(5), Duration::from_secs(10)))
    );
    assert_eq!(r.cuts[1].b, Peer::Addr(a("[::1]:2")));
    assert_eq!(r.cuts[1].window.map(|w| w.1), Some(Duration::MAX));
    drop(r);
    assert!(Faults::parse("")?.is_none());
    assert!(Faults::parse("off")?.is_none());
    for bad in [
        "loss=2",
        "loss=x",
        "delay=50",
        "delay=-1ms",
        "wat=1",
        "seed",
        "partition=s0",
        "partition=127.0.0.1:1@5..2",
        "partition=127.0.0.1:1@5",
        "rate=100",
        "rate=0.1kbit",
        "rate=fastgbit",
        "queue=5ms",
    ] {
        let e = Faults::parse(bad).expect_err(bad);
        assert!(e.to_string().contains(bad.split(',').next().unwrap_or(bad)));
    }
    Ok(())
}

#[test]
fn rates_parse_with_their_units_and_queues() -> Result<(), FaultSpecError> {
    for (spec, bits, queue) in [
        ("rate=1gbit", 1_000_000_000, 20),
        ("rate=100mbit,queue=5ms", 100_000_000, 5),
        ("queue=50ms,rate=2.5Mbit/s", 2_500_000, 50),
        ("rate=64kbps", 64_000, 20),
    ] {
        let f = Faults::parse(spec)?.expect("faults");
        let rate = f.rules().default.rate.expect(spec);
        assert_eq!(rate.bits_per_s, bits, "{spec}");
        assert_eq!(rate.queue, Duration::from_millis(queue), "{spec}");
    }
    let r = Rate {
        bits_per_s: 8_000_000,
        queue: Rate::DEFAULT_QUEUE,
    };
    assert_eq!(r.serialize(1000), Duration::from_millis(1));
    assert_eq!(r.to_string(), "8 Mbit/s, a 20 ms queue");
    Ok(())
}

/// A socket under `f`'s faults that sends a datagram of 1,000 bytes to `to` on each call.
fn kilobyte_sender(
    f: &Faults,
    to: std::net::SocketAddr,
) -> std::io::Result<impl Fn() -> std::io::Result<()>> {
    let tx = f.wrap(
        quinn::default_runtime()
            .expect("tokio")
            .wrap_udp_socket(std::net::UdpSocket::bind("127.0.0.1:0")?)?,
    )?;
    let data = [7u8; 1000];
    Ok(move || {
        tx.try_send(&quinn::udp::Transmit {
            destination: to,
            ecn: None,
            contents: &data,
            segment_size: None,
            src_ip: None,
        })
    })
}

/// On a fast link, datagrams whose last bit is out within a tick of the timer leave at once
/// (not on its next tick, a millisecond on); those queued further behind them are held.
#[tokio::test]
async fn a_fast_idle_link_sends_at_once_and_holds_a_backlog() -> std::io::Result<()> {
    let rx = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let f = Faults::new(1);
    // 1 Gbit/s: 8 µs per 1,000 bytes, 125 of them to a millisecond.
    f.set_default(LinkFaults::clean().with_rate(1_000_000_000));
    let send = kilobyte_sender(&f, rx.local_addr()?)?;
    // The reactor learns that the socket is writable (a send before it would block).
    tokio::time::sleep(Duration::from_millis(10)).await;
    for _ in 0..10 {
        send()?;
    }
    let stats = f.stats();
    assert_eq!((stats.sent, stats.delayed), (10, 0), "{stats:?}");
    // 1,000 more are 8 ms of the link: most of them wait.
    for _ in 0..1000 {
        send()?;
    }
    let stats = f.stats();
    assert_eq!(stats.overflowed, 0, "{stats:?}");
    assert!(stats.delayed > 500, "{stats:?}");
    Ok(())
}

/// A socket's datagrams leave at the link's rate, one after another, and those that would
/// wait longer than the queue are dropped.
#[tokio::test]
async fn a_rate_spaces_datagrams_and_a_full_queue_drops_them() -> std::io::Result<()> {
    let rx = std::net::UdpSocket::bind("127.0.0.1:0")?;
    rx.set_read_timeout(Some(Duration::from_secs(5)))?;
    let f = Faults::new(1);
    // 8 Mbit/s: 1 ms per 1,000 bytes; a queue of 30 ms holds about 30 of them.
    f.set_default(LinkFaults {
        rate: Some(Rate {
            bits_per_s: 8_000_000,
            queue: Duration::from_millis(30),
        }),
        ..LinkFaults::clean()
    });
    let send = kilobyte_sender(&f, rx.local_addr()?)?;
    let started = std::time::Instant::now();
    for _ in 0..100 {
        send()?;
    }
    // The queue drains while the loop runs: a slow loop fits one more per millisecond.
    let looped = started.elapsed().as_millis() as u64;
    let stats = f.stats();
    assert_eq!(stats.offered, 100);
    assert!(
        (30..=32 + looped).contains(&(100 - stats.overflowed)),
        "{stats:?}: about 31 datagrams fit 30 ms ({looped} ms sending)"
    );
    let kept = (100 - stats.overflowed) as usize;
    let got = tokio::task::spawn_blocking(move || {
        let mut buf = [0u8; 2000];
        (0..kept).try_for_each(|_| rx.recv(&mut buf).map(|_| ()))
    })
    .await
    .expect("receiver");
    got?;
    // The last one left after all the others crossed: about 1 ms each.
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(kept as u64 - 2),
        "{took:?} for {kept}"
    );
    assert_eq!(f.stats().dropped, stats.overflowed);
    Ok(())
}
