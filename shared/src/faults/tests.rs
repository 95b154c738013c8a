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
    ] {
        let e = Faults::parse(bad).expect_err(bad);
        assert!(e.to_string().contains(bad.split(',').next().unwrap_or(bad)));
    }
    Ok(())
}
