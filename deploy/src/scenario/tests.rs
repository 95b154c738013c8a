//! Unit tests of scenario parsing and checking.

use super::*;

fn err(text: &str, workers: u32) -> String {
    Scenario::parse(text, workers, 2)
        .expect_err("should be refused")
        .to_string()
}

#[test]
fn a_churn_scenario_parses_with_continued_names() {
    let s = Scenario::parse(
        r#"
        [[event]]
        at_s = 3
        action = "add"
        count = 2
        [[event]]
        at_s = 7.5
        action = "drain"
        worker = "w0"
        [[event]]
        at_s = 9.0
        action = "kill"
        worker = "w3"
        [[event]]
        at_s = 9.0
        action = "add"
        count = 1
        [[event]]
        at_s = 12.0
        action = "term"
        worker = "w4"
        "#,
        2,
        2,
    )
    .expect("valid");
    let actions: Vec<String> = s.events.iter().map(|e| e.action.to_string()).collect();
    assert_eq!(
        actions,
        ["add w2, w3", "drain w0", "kill -9 w3", "add w4", "term w4"]
    );
    assert_eq!(s.events[0].at, Duration::from_secs(3));
    assert_eq!(s.events[1].at, Duration::from_millis(7500));
    assert_eq!(s.events[2].action.target(), Some("w3"));
    assert_eq!(s.final_workers(2), 2);
}

#[test]
fn bad_fields_are_named() {
    let e = err("[[event]]\nat_s = 1\naction = \"explode\"\n", 2);
    assert!(
        e.contains("event 1") && e.contains("unknown action \"explode\""),
        "{e}"
    );
    let e = err("[[event]]\naction = \"add\"\ncount = 1\n", 2);
    assert!(e.contains("missing field `at_s`"), "{e}");
    let e = err("[[event]]\nat_s = 1\ncount = 1\n", 2);
    assert!(e.contains("missing field `action`"), "{e}");
    let e = err("[[event]]\nat_s = 1\naction = \"drain\"\n", 2);
    assert!(e.contains("missing field `worker`"), "{e}");
    let e = err("[[event]]\nat_s = 1\naction = \"add\"\n", 2);
    assert!(e.contains("missing field `count`"), "{e}");
    let e = err("[[event]]\nat_s = 1\naction = \"add\"\ncount = 0\n", 2);
    assert!(e.contains("count = 0"), "{e}");
    let e = err(
        "[[event]]\nat_s = 1\naction = \"kill\"\nworker = \"w0\"\ncount = 2\n",
        2,
    );
    assert!(e.contains("`count` applies to add only"), "{e}");
    let e = err("[[event]]\nat_s = -1\naction = \"add\"\ncount = 1\n", 2);
    assert!(e.contains("not a time"), "{e}");
    // Typos in keys are not silently ignored.
    let e = err("[[event]]\nat_s = 1\naction = \"add\"\ncuont = 1\n", 2);
    assert!(e.contains("cuont"), "{e}");
    assert!(matches!(
        Scenario::parse("", 2, 2),
        Err(ScenarioError::Empty)
    ));
}

#[test]
fn times_must_be_in_order() {
    let e = err(
        "[[event]]\nat_s = 5\naction = \"add\"\ncount = 1\n\
         [[event]]\nat_s = 4\naction = \"add\"\ncount = 1\n",
        2,
    );
    assert!(e.contains("event 2") && e.contains("time order"), "{e}");
}

#[test]
fn worker_names_are_checked_against_the_membership_at_that_point() {
    let e = err(
        "[[event]]\nat_s = 1\naction = \"drain\"\nworker = \"w2\"\n",
        2,
    );
    assert!(e.contains("no worker is named \"w2\""), "{e}");
    assert!(e.contains("running: w0, w1"), "{e}");
    let e = err(
        "[[event]]\nat_s = 1\naction = \"kill\"\nworker = \"w1\"\n\
         [[event]]\nat_s = 2\naction = \"drain\"\nworker = \"w1\"\n",
        3,
    );
    assert!(
        e.contains("event 2") && e.contains("w1 was killed by event 1"),
        "{e}"
    );
    let e = err(
        "[[event]]\nat_s = 1\naction = \"term\"\nworker = \"w0\"\n",
        1,
    );
    assert!(e.contains("no worker running"), "{e}");
    // An added worker can be targeted once it exists.
    Scenario::parse(
        "[[event]]\nat_s = 1\naction = \"add\"\ncount = 1\n\
         [[event]]\nat_s = 2\naction = \"drain\"\nworker = \"w1\"\n",
        1,
        1,
    )
    .expect("w1 exists by then");
}

#[test]
fn the_shipped_scenarios_are_valid_for_their_worker_counts() {
    for (text, workers, end) in [
        (include_str!("../../scenarios/grow.toml"), 2, 4),
        (include_str!("../../scenarios/shrink.toml"), 4, 2),
        (include_str!("../../scenarios/kill.toml"), 3, 2),
        (include_str!("../../scenarios/churn.toml"), 2, 3),
        (include_str!("../../scenarios/reshard.toml"), 2, 2),
        (include_str!("../../scenarios/straggler.toml"), 4, 4),
        // The preempted worker counts as gone: its substitute depends on the policy.
        (include_str!("../../scenarios/spot.toml"), 3, 2),
        (include_str!("../../scenarios/coordinator.toml"), 3, 3),
    ] {
        let s = Scenario::parse(text, workers, 2).expect("valid");
        assert_eq!(s.final_workers(workers), end, "{text}");
    }
}

/// A valid resharding scenario from two shards: add s2, move keys to it, kill and
/// restart s0, remove s1.
const RESHARD: &str = r#"
    [[event]]
    at_s = 1
    action = "shard_add"
    [[event]]
    at_s = 2
    action = "move"
    range = "k3..6"
    to = "s2"
    [[event]]
    at_s = 3
    action = "kill_shard"
    shard = "s0"
    [[event]]
    at_s = 4
    action = "restart_shard"
    shard = "s0"
    [[event]]
    at_s = 5
    action = "shard_remove"
    shard = "s1"
"#;

#[test]
fn shard_events_parse_with_continued_names() {
    let s = Scenario::parse(RESHARD, 2, 2).expect("valid");
    let actions: Vec<String> = s.events.iter().map(|e| e.action.to_string()).collect();
    assert_eq!(
        actions,
        [
            "shard add s2",
            "move keys 3..6 to s2",
            "kill -9 shard s0",
            "restart shard s0",
            "shard remove s1"
        ]
    );
    assert!(s.events.iter().all(|e| e.action.is_shard_event()));
    assert!(s.events.iter().all(|e| e.action.target().is_none()));
    assert_eq!(s.events[1].action.kind(), "move");
    assert!(s.has_shard_events());
    assert_eq!(s.final_workers(2), 2);
    // Keys are checked once the job's layout is known.
    s.check_keys(6).expect("6 keys hold 3..6");
    let e = s.check_keys(5).expect_err("5 keys").to_string();
    assert!(e.contains("event 2") && e.contains("5 keys"), "{e}");
}

#[test]
fn shard_names_and_states_are_checked_at_each_point() {
    let ev = |at: u32, body: &str| format!("[[event]]\nat_s = {at}\n{body}\n");
    let kill = |s: &str| format!("action = \"kill_shard\"\nshard = \"{s}\"");
    let restart = |s: &str| format!("action = \"restart_shard\"\nshard = \"{s}\"");
    let remove = |s: &str| format!("action = \"shard_remove\"\nshard = \"{s}\"");
    let mv = |r: &str, to: &str| format!("action = \"move\"\nrange = \"{r}\"\nto = \"{to}\"");
    let check = |text: String, want: &[&str]| {
        let e = Scenario::parse(&text, 2, 2)
            .expect_err("should be refused")
            .to_string();
        for w in want {
            assert!(e.contains(w), "{w:?} not in {e}");
        }
    };
    check(
        ev(1, &kill("s2")),
        &["event 1", "no shard is named \"s2\"", "running: s0, s1"],
    );
    check(
        ev(1, &restart("s0")),
        &["cannot restart s0", "only a killed shard"],
    );
    check(
        ev(1, &kill("s0")),
        &["event 1", "s0 is killed and never restarted"],
    );
    check(
        ev(1, &kill("s0")) + &ev(2, &kill("s0")) + &ev(3, &restart("s0")),
        &["event 2", "s0 is down (killed by event 1)"],
    );
    check(
        ev(1, &kill("s0")) + &ev(2, &mv("0..2", "s1")) + &ev(3, &restart("s0")),
        &[
            "event 2",
            "while s0 is down (killed by event 1)",
            "restart it first",
        ],
    );
    check(
        ev(1, &kill("s1")) + &ev(2, "action = \"shard_add\"") + &ev(3, &restart("s1")),
        &["event 2", "cannot add a shard while s1 is down"],
    );
    check(
        ev(1, &remove("s0")) + &ev(2, &remove("s1")),
        &["event 2", "last shard holding keys"],
    );
    check(
        ev(1, &remove("s0")) + &ev(2, &mv("0..2", "s0")),
        &["event 2", "s0 was removed by event 1"],
    );
    check(
        ev(1, &remove("s0")) + &ev(2, &restart("s0")),
        &["event 2", "s0 was removed by event 1"],
    );
    check(
        ev(1, &mv("5..2", "s1")),
        &["event 1", "range = \"5..2\"", "empty"],
    );
    check(
        ev(1, &mv("a..b", "s1")),
        &["range = \"a..b\"", "not a key number"],
    );
    check(
        ev(1, "action = \"move\"\nto = \"s1\""),
        &["missing field `range`"],
    );
    check(
        ev(1, "action = \"move\"\nrange = \"0..1\""),
        &["missing field `to`"],
    );
    check(ev(1, "action = \"kill_shard\""), &["missing field `shard`"]);
    check(
        ev(1, "action = \"shard_add\"\nshard = \"s5\""),
        &["`shard` does not apply to shard_add"],
    );
    check(
        ev(1, "action = \"drain\"\nworker = \"w0\"\nshard = \"s0\""),
        &["`shard` does not apply to drain"],
    );
    check(
        ev(1, &format!("{}\nworker = \"w0\"", kill("s0"))) + &ev(2, &restart("s0")),
        &["`worker` does not apply to kill_shard"],
    );
    // An added shard can be named once it exists, and a restarted one serves again.
    Scenario::parse(
        &(ev(1, "action = \"shard_add\"")
            + &ev(2, &kill("s2"))
            + &ev(3, &restart("s2"))
            + &ev(4, &remove("s2"))
            + &ev(5, &remove("s0"))),
        2,
        2,
    )
    .expect("valid");
}

#[test]
fn elastic_events_parse_and_are_checked() {
    let s = Scenario::parse(
        r#"
        [[event]]
        at_s = 1
        action = "slow"
        worker = "w1"
        factor = 3.0
        [[event]]
        at_s = 2
        action = "migrate"
        worker = "w1"
        to = "slot4"
        [[event]]
        at_s = 3
        action = "migrate"
        worker = "w1"
        [[event]]
        at_s = 4
        action = "preempt"
        worker = "w0"
        "#,
        2,
        2,
    )
    .expect("valid");
    let actions: Vec<String> = s.events.iter().map(|e| e.action.to_string()).collect();
    assert_eq!(
        actions,
        [
            "slow w1 3x",
            "migrate w1 to slot4",
            "migrate w1",
            "preempt w0 (SIGUSR1)"
        ]
    );
    assert!(s.events.iter().all(|e| e.action.is_elastic_event()));
    // A migrated worker keeps its name (it stands for the new one); a preempted one is gone.
    assert_eq!(s.final_workers(2), 1);
    let slow = |factor: &str| {
        format!("[[event]]\nat_s = 1\naction = \"slow\"\nworker = \"w0\"\nfactor = {factor}\n")
    };
    assert!(err(&slow("0.5"), 2).contains("must be 1 to 1000"));
    assert!(err(&slow("nan"), 2).contains("must be 1 to 1000"));
    let e = err(
        "[[event]]\nat_s = 1\naction = \"slow\"\nworker = \"w0\"\n",
        2,
    );
    assert!(e.contains("missing field `factor`"), "{e}");
    let e = err(
        "[[event]]\nat_s = 1\naction = \"preempt\"\nworker = \"w0\"\nto = \"slot1\"\n",
        2,
    );
    assert!(e.contains("`to` does not apply to preempt"), "{e}");
    let e = err(
        "[[event]]\nat_s = 1\naction = \"migrate\"\nworker = \"w7\"\n",
        2,
    );
    assert!(e.contains("cannot migrate w7"), "{e}");
    let e = err(
        "[[event]]\nat_s = 1\naction = \"preempt\"\nworker = \"w0\"\n",
        1,
    );
    assert!(e.contains("no worker running"), "{e}");
}

#[test]
fn coordinator_events_parse_and_are_checked() {
    let ev = |at: f64, action: &str| format!("[[event]]\nat_s = {at}\naction = \"{action}\"\n");
    let kill = |at: f64| ev(at, "kill_coordinator");
    let restart = |at: f64| ev(at, "restart_coordinator");
    let with = |at: f64, action: &str, field: &str| ev(at, action) + field + "\n";
    let s = Scenario::parse(
        &(kill(1.0) + &restart(1.4) + &kill(2.0) + &restart(2.0)),
        2,
        2,
    )
    .expect("valid");
    let actions: Vec<String> = s.events.iter().map(|e| e.action.to_string()).collect();
    assert_eq!(
        actions,
        [
            "kill -9 coordinator",
            "restart coordinator",
            "kill -9 coordinator",
            "restart coordinator"
        ]
    );
    assert_eq!(s.events[0].action, Action::KillCoordinator);
    assert_eq!(s.events[1].action, Action::RestartCoordinator);
    assert_eq!(
        (s.events[0].action.kind(), s.events[1].action.kind()),
        ("kill_coordinator", "restart_coordinator")
    );
    // Carried out like shard events with --restart-on-change: they change no worker.
    assert!(s.events.iter().all(|e| e.action.is_shard_event()));
    assert!(s.events.iter().all(|e| !e.action.is_elastic_event()));
    assert!(s.events.iter().all(|e| e.action.target().is_none()));
    assert!(s.has_shard_events());
    assert_eq!(s.final_workers(2), 2);

    let check = |text: String, want: &[&str]| {
        let e = Scenario::parse(&text, 2, 2)
            .expect_err("should be refused")
            .to_string();
        for w in want {
            assert!(e.contains(w), "{w:?} not in {e}");
        }
    };
    check(
        restart(1.0),
        &[
            "event 1",
            "cannot restart the coordinator",
            "only a killed coordinator restarts",
        ],
    );
    check(
        kill(1.0) + &restart(2.0) + &restart(3.0),
        &["event 3", "cannot restart the coordinator"],
    );
    check(
        kill(1.0),
        &[
            "event 1",
            "the coordinator is killed and never restarted",
            "add a restart_coordinator event",
        ],
    );
    check(
        kill(1.0) + &restart(2.0) + &kill(3.0),
        &["event 3", "killed and never restarted"],
    );
    check(
        kill(1.0) + &kill(2.0) + &restart(3.0),
        &[
            "event 2",
            "cannot kill_coordinator while the coordinator is down (killed by event 1)",
        ],
    );
    // Nothing may come between a kill and its restart, not even an event that needs no answer.
    for between in [
        "action = \"add\"\ncount = 1",
        "action = \"kill\"\nworker = \"w0\"",
        "action = \"slow\"\nworker = \"w0\"\nfactor = 2.0",
        "action = \"shard_add\"",
        "action = \"kill_shard\"\nshard = \"s0\"",
    ] {
        let text = kill(1.0) + &format!("[[event]]\nat_s = 1.5\n{between}\n") + &restart(2.0);
        let e = Scenario::parse(&text, 2, 2)
            .expect_err("should be refused")
            .to_string();
        assert!(
            e.contains("event 2")
                && e.contains("while the coordinator is down (killed by event 1)")
                && e.contains(
                    "no other event may come between a kill_coordinator and its \
                     restart_coordinator"
                ),
            "{between}: {e}"
        );
    }
    check(
        with(1.0, "kill_coordinator", "worker = \"w0\"") + &restart(2.0),
        &["event 1", "`worker` does not apply to kill_coordinator"],
    );
    check(
        kill(1.0) + &with(2.0, "restart_coordinator", "shard = \"s0\""),
        &["event 2", "`shard` does not apply to restart_coordinator"],
    );
    check(
        kill(1.0) + &with(2.0, "restart_coordinator", "count = 1"),
        &["event 2", "`count` does not apply to restart_coordinator"],
    );
    let e = err("[[event]]\nat_s = 1\naction = \"explode\"\n", 2);
    assert!(e.contains("kill_coordinator or restart_coordinator"), "{e}");
}

#[test]
fn a_missing_file_is_named() {
    let e = Scenario::load(Path::new("/nonexistent/churn.toml"), 2, 2)
        .expect_err("missing")
        .to_string();
    assert!(e.contains("/nonexistent/churn.toml"), "{e}");
}
