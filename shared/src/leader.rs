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
