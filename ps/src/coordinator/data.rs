//! The data-partition plan: each epoch's sample order is cut into fixed-size partitions that are
//! leased to workers on demand; a partition leased to a worker that leaves or dies goes back to
//! the pool and is handed out again from its start.
//!
//! Progress is tracked per partition here; the exactly-once, sample-offset ledger is a later
//! step (see ARCHITECTURE.md).

use std::collections::VecDeque;

use edl_shared::proto::msg::Partition;

/// Partitions of all epochs, handed out in epoch order.
#[derive(Debug)]
pub struct DataPlan {
    epochs: u32,
    samples: u32,
    partition_size: u32,
    /// The next fresh partition: (epoch, index).
    cursor: (u32, u32),
    /// Partitions returned by departed workers, handed out before fresh ones.
    returned: VecDeque<Partition>,
    /// Completed partitions per epoch.
    completed: Vec<u32>,
}

impl DataPlan {
    /// A plan of `epochs` passes over `samples` samples cut into partitions of `partition_size`.
    pub fn new(epochs: u32, samples: u32, partition_size: u32) -> Self {
        DataPlan {
            epochs,
            samples,
            partition_size: partition_size.max(1),
            cursor: (0, 0),
            returned: VecDeque::new(),
            completed: vec![0; epochs as usize],
        }
    }

    /// Partitions per epoch.
    pub fn per_epoch(&self) -> u32 {
        self.samples.div_ceil(self.partition_size)
    }

    /// The next partition to lease, if any is left to hand out.
    pub fn lease_next(&mut self) -> Option<Partition> {
        if let Some(p) = self.returned.pop_front() {
            return Some(p);
        }
        let (epoch, index) = self.cursor;
        if epoch >= self.epochs || self.per_epoch() == 0 {
            return None;
        }
        let start = index * self.partition_size;
        let len = self.partition_size.min(self.samples - start);
        self.cursor = if index + 1 >= self.per_epoch() {
            (epoch + 1, 0)
        } else {
            (epoch, index + 1)
        };
        Some(Partition {
            epoch,
            index,
            start,
            len,
        })
    }

    /// Puts a leased partition back in the pool.
    pub fn give_back(&mut self, p: Partition) {
        self.returned.push_back(p);
    }

    /// Records that a partition was fully processed.
    pub fn complete(&mut self, p: &Partition) {
        if let Some(c) = self.completed.get_mut(p.epoch as usize) {
            *c += 1;
        }
    }

    /// True when every partition of every epoch is complete.
    pub fn finished(&self) -> bool {
        self.completed.iter().all(|&c| c >= self.per_epoch())
    }

    /// The plan's progress, for persistence: the cursor, the returned partitions and the
    /// completed count per epoch.
    pub fn snapshot(&self) -> ((u32, u32), Vec<Partition>, Vec<u32>) {
        (
            self.cursor,
            self.returned.iter().copied().collect(),
            self.completed.clone(),
        )
    }

    /// A plan with restored progress.
    pub fn restore(
        epochs: u32,
        samples: u32,
        partition_size: u32,
        cursor: (u32, u32),
        returned: Vec<Partition>,
        completed: Vec<u32>,
    ) -> Result<Self, String> {
        let mut plan = DataPlan::new(epochs, samples, partition_size);
        if completed.len() != plan.completed.len() || cursor.0 > epochs {
            return Err("the saved data plan does not fit the job".into());
        }
        plan.cursor = cursor;
        plan.returned = returned.into();
        plan.completed = completed;
        Ok(plan)
    }

    /// Total samples over all epochs.
    pub fn samples_total(&self) -> u64 {
        u64::from(self.epochs) * u64::from(self.samples)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covers_each_epoch_once_and_reissues_returned() {
        let mut plan = DataPlan::new(2, 10, 4);
        assert_eq!(plan.per_epoch(), 3);
        let mut got = Vec::new();
        while let Some(p) = plan.lease_next() {
            got.push(p);
        }
        assert_eq!(got.len(), 6);
        assert_eq!(got[2].len, 2);
        assert_eq!(got[3].epoch, 1);
        let sum: u32 = got.iter().filter(|p| p.epoch == 0).map(|p| p.len).sum();
        assert_eq!(sum, 10);
        plan.give_back(got[1]);
        assert_eq!(plan.lease_next(), Some(got[1]));
        for p in &got {
            plan.complete(p);
        }
        assert!(plan.finished());
    }
}
