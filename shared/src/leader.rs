//! A job's coordinators as a client reaches them: the addresses of `--coordinator A,B,C`
//! (`EDL_COORDINATOR` likewise), of which one leads and the others stand by. A call goes to
//! the address believed to lead; when that fails to connect it moves on to the next, and a
//! standby's answer ([`crate::transport::CallError::NotLeader`]) names the leader to move to.

use std::fmt;

/// The addresses of a job's coordinators and the one a client is using.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coordinators {
    addrs: Vec<String>,
    at: usize,
}

impl Coordinators {
    /// Parses a comma-separated list of `HOST:PORT` addresses (spaces around them ignored).
    pub fn parse(list: &str) -> Result<Coordinators, String> {
        let addrs: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_string)
            .collect();
        if addrs.is_empty() {
            return Err(format!(
                "no coordinator address in {list:?}: expected HOST:PORT, or several separated \
                 by commas"
            ));
        }
        if let Some(bad) = addrs.iter().find(|a| !a.contains(':')) {
            return Err(format!(
                "coordinator address {bad:?} has no port: expected HOST:PORT"
            ));
        }
        Ok(Coordinators { addrs, at: 0 })
    }

    /// The address in use.
    pub fn current(&self) -> &str {
        &self.addrs[self.at]
    }

    /// Every address, in the order given.
    pub fn all(&self) -> &[String] {
        &self.addrs
    }

    /// Moves on to the next address (after the one in use failed); returns it.
    pub fn advance(&mut self) -> &str {
        self.at = (self.at + 1) % self.addrs.len();
        self.current()
    }

    /// Moves on from `failed` if it is still the address in use (another caller sharing this
    /// list may have moved on already); returns the address now in use.
    pub fn move_past(&mut self, failed: &str) -> &str {
        if self.current() == failed {
            self.advance();
        }
        self.current()
    }

    /// Moves to the leader a standby named (added to the list if it was not in it), or to the
    /// next address if it named none (an election is under way); returns the address now in
    /// use.
    pub fn follow(&mut self, leader: Option<&str>) -> &str {
        match leader {
            Some(l) => {
                self.at = match self.addrs.iter().position(|a| a == l) {
                    Some(i) => i,
                    None => {
                        self.addrs.push(l.to_string());
                        self.addrs.len() - 1
                    }
                };
                self.current()
            }
            None => self.advance(),
        }
    }
}

/// One round of attempts to find the leader among a job's coordinators, during an outage: the
/// addresses tried since the round began. Within a round every address is tried once, a leader
/// a standby names first; a round that found no leader ends, and the caller pauses before the
/// next one. So a client that follows a standby's answer never loops on it: a standby that
/// still names a dead leader (its etcd lease has not run out) costs one attempt a round.
#[derive(Clone, Debug, Default)]
pub struct Round {
    tried: Vec<String>,
}

impl Round {
    /// True once `addr` was tried in this round.
    pub fn tried(&self, addr: &str) -> bool {
        self.tried.iter().any(|a| a == addr)
    }
}

impl Coordinators {
    /// After an attempt at `at` failed (`named`: the leader its answer named, if another),
    /// moves to the address to try next in this `round` and returns it: the leader named if
    /// it was not tried in this round, else the next address after `at` not tried in it.
    /// `None` once every address was tried: the round starts again (the caller pauses
    /// first), from the leader named if any, else from the address after `at`.
    pub fn next_in(&mut self, round: &mut Round, at: &str, named: Option<&str>) -> Option<&str> {
        if !round.tried(at) {
            round.tried.push(at.to_string());
        }
        if let Some(l) = named.filter(|l| !round.tried(l)) {
            return Some(self.follow(Some(l)));
        }
        let n = self.addrs.len();
        let from = self.addrs.iter().position(|a| a == at).unwrap_or(self.at);
        let untried = (1..=n)
            .map(|k| (from + k) % n)
            .find(|&i| !round.tried(&self.addrs[i]));
        match untried {
            Some(i) => {
                self.at = i;
                Some(self.current())
            }
            None => {
                round.tried.clear();
                match named {
                    Some(l) => {
                        self.follow(Some(l));
                    }
                    None => self.at = (from + 1) % n,
                }
                None
            }
        }
    }
}

impl fmt::Display for Coordinators {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.addrs.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_is_followed_round_and_to_the_leader_named() {
        let mut c =
            Coordinators::parse(" 10.0.0.1:7000, 10.0.0.2:7000,10.0.0.3:7000 ").expect("list");
        assert_eq!(c.current(), "10.0.0.1:7000");
        assert_eq!(c.advance(), "10.0.0.2:7000");
        assert_eq!(c.follow(Some("10.0.0.1:7000")), "10.0.0.1:7000");
        assert_eq!(c.follow(None), "10.0.0.2:7000");
        assert_eq!(c.advance(), "10.0.0.3:7000");
        assert_eq!(c.advance(), "10.0.0.1:7000");
        // Two callers that saw the same address fail move on once.
        assert_eq!(c.move_past("10.0.0.1:7000"), "10.0.0.2:7000");
        assert_eq!(c.move_past("10.0.0.1:7000"), "10.0.0.2:7000");
        // A leader not in the list is added to it.
        assert_eq!(c.follow(Some("10.0.0.9:7000")), "10.0.0.9:7000");
        assert_eq!(c.all().len(), 4);
        assert_eq!(
            c.to_string(),
            "10.0.0.1:7000,10.0.0.2:7000,10.0.0.3:7000,10.0.0.9:7000"
        );
    }

    /// A standby that names a dead leader costs one attempt a round: every address is tried
    /// in each round (the hang this prevents: a client that asked the standby, was sent to
    /// the dead leader, failed to reach it, and asked the standby again forever).
    #[test]
    fn a_round_tries_every_address_once_the_leader_named_first() {
        let (a, b, c) = ("a:1", "b:1", "c:1");
        let mut list = Coordinators::parse("a:1,b:1,c:1").expect("list");
        let mut round = Round::default();
        // A fails; B stands by and names A, which was tried: C is next, then the round ends.
        assert_eq!(list.next_in(&mut round, a, None), Some(b));
        assert_eq!(list.next_in(&mut round, b, Some(a)), Some(c));
        assert_eq!(list.next_in(&mut round, c, Some(a)), None);
        // The next round starts at the leader named.
        assert_eq!(list.current(), a);
        assert!(!round.tried(a));
        // A standby naming an untried leader is followed first.
        let mut round = Round::default();
        assert_eq!(list.next_in(&mut round, a, None), Some(b));
        assert_eq!(list.next_in(&mut round, b, Some(c)), Some(c));
        assert_eq!(list.next_in(&mut round, c, None), None);
        assert_eq!(list.current(), a);
        // One address: every failure ends the round.
        let mut one = Coordinators::parse("a:1").expect("list");
        let mut round = Round::default();
        assert_eq!(one.next_in(&mut round, a, None), None);
        assert_eq!(one.current(), a);
        // A leader named that is not in the list is added and tried.
        let mut round = Round::default();
        assert_eq!(one.next_in(&mut round, a, Some("d:1")), Some("d:1"));
        assert_eq!(one.next_in(&mut round, "d:1", Some("d:1")), None);
    }

    #[test]
    fn bad_lists_are_refused_with_what_was_expected() {
        assert!(
            Coordinators::parse(" , ")
                .expect_err("refused")
                .contains("HOST:PORT")
        );
        assert!(
            Coordinators::parse("a:1,b")
                .expect_err("refused")
                .contains("\"b\" has no port")
        );
    }
}
