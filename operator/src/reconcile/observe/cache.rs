//! What observe keeps between a run's reconciles of what cannot change once read, so that a
//! reconcile asks the API server only for what can: each generation Job's pending list (its plan
//! `ConfigMap` is made with the Job and never changed; by the Job's uid) and the round's image
//! groups (the `ConfigMap` the operator writes once a round's plan is read; by round). At 2,000
//! images every reconcile read them again: 19 `ConfigMap` reads a batch.
//!
//! Each reconcile of a run takes the run's entry and puts back only what it saw again, so the
//! Jobs deleted meanwhile leave it; the entries of runs not reconciled for a while (deleted runs)
//! are dropped as others are put back.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use trajectory_worker::contract::ImageGroup;

/// How long a run's entry outlives its last reconcile.
const UNUSED_FOR: Duration = Duration::from_secs(600);

/// The runs' entries, by run uid.
#[derive(Debug, Default)]
pub struct ObserveCache {
    runs: Mutex<HashMap<String, RunEntry>>,
}

/// What is kept of one run.
#[derive(Debug, Default)]
pub struct RunEntry {
    used: Option<Instant>,
    /// By Job uid: the batch each index works, and the plan's pending list on storage.
    pending: HashMap<String, (Vec<u32>, Option<String>)>,
    /// The round, and its image groups.
    image_index: Option<(u32, Vec<ImageGroup>)>,
}

impl ObserveCache {
    /// Takes what is kept of run `uid` (nothing for a run without one).
    pub fn take(&self, uid: Option<&str>) -> RunEntry {
        uid.and_then(|uid| {
            self.runs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(uid)
        })
        .unwrap_or_default()
    }

    /// Keeps `entry` for run `uid`'s next reconcile.
    pub fn put(&self, uid: Option<&str>, mut entry: RunEntry) {
        let Some(uid) = uid else {
            return;
        };
        entry.used = Some(Instant::now());
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        runs.retain(|_, kept| kept.used.is_some_and(|at| at.elapsed() < UNUSED_FOR));
        runs.insert(uid.to_owned(), entry);
    }
}

impl RunEntry {
    /// Job `uid`'s pending list, when it was read before.
    pub fn pending(&self, uid: &str) -> Option<&(Vec<u32>, Option<String>)> {
        self.pending.get(uid)
    }

    /// Keeps Job `uid`'s pending list, read from its plan `ConfigMap`.
    pub fn keep_pending(&mut self, uid: String, pending: (Vec<u32>, Option<String>)) {
        self.pending.insert(uid, pending);
    }

    /// `round`'s image groups, when they were read before.
    pub fn image_index(&self, round: u32) -> Option<&Vec<ImageGroup>> {
        self.image_index
            .as_ref()
            .filter(|(kept, _)| *kept == round)
            .map(|(_, groups)| groups)
    }

    /// Keeps `round`'s image groups.
    pub fn keep_image_index(&mut self, round: u32, groups: Vec<ImageGroup>) {
        self.image_index = Some((round, groups));
    }
}
