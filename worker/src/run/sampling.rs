//! The order a batch starts its pending (prompt, sample)s in, and sampling until enough passed.
//!
//! Without `spec.verifier.passesPerPrompt`, every pending key runs, in dataset order. With it
//! (k), a prompt is sampled only until k of its samples passed their verifier: a sample starts
//! only while the prompt's passed samples and those in flight are fewer than k (so no more
//! samples run at once than could still be needed), and once k passed, the prompt's remaining
//! samples are not run but recorded as discarded (`enough_passed`), so that every key of the
//! batch still has its record and merge proves the batch complete as ever. A sample that must
//! wait for its prompt's samples in flight lets the next prompt's start meanwhile.
//!
//! The passed counts start from the records on storage, so a resumed batch stops where the
//! interrupted one would have.

use std::collections::{HashMap, VecDeque};

/// The filter of a sample that was not run because enough samples of its prompt passed.
pub const ENOUGH_PASSED: &str = "enough_passed";

/// What the batch does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Start this (prompt, sample).
    Run(u64, u32),
    /// Record this (prompt, sample) as not run: its prompt has enough passed samples.
    Skip(u64, u32),
    /// Nothing can start until a sample in flight finishes.
    Wait,
    /// Every pending key was handed out.
    Done,
}

/// The pending keys of a batch and, when sampling stops at enough passes, each prompt's count.
#[derive(Debug)]
pub struct Schedule {
    pending: VecDeque<(u64, u32)>,
    /// Passes that end a prompt's sampling (`None`: every sample runs).
    enough: Option<u32>,
    passed: HashMap<u64, u32>,
    in_flight: HashMap<u64, u32>,
}

impl Schedule {
    /// `pending` in dataset order; `passed` are the passed samples on storage, by prompt.
    pub fn new(pending: Vec<(u64, u32)>, enough: Option<u32>, passed: HashMap<u64, u32>) -> Self {
        Self {
            pending: pending.into(),
            enough,
            passed,
            in_flight: HashMap::new(),
        }
    }

    /// Keys not handed out yet.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// The next key to start or skip, taken off the pending ones.
    pub fn take_next(&mut self) -> Next {
        let Some(enough) = self.enough else {
            return self
                .pending
                .pop_front()
                .map_or(Next::Done, |(prompt, sample)| Next::Run(prompt, sample));
        };
        if self.pending.is_empty() {
            return Next::Done;
        }
        for at in 0..self.pending.len() {
            let (prompt, sample) = self.pending[at];
            let passed = self.passed.get(&prompt).copied().unwrap_or(0);
            if passed >= enough {
                self.pending.remove(at);
                return Next::Skip(prompt, sample);
            }
            let in_flight = self.in_flight.entry(prompt).or_default();
            if passed + *in_flight < enough {
                *in_flight += 1;
                self.pending.remove(at);
                return Next::Run(prompt, sample);
            }
        }
        Next::Wait
    }

    /// A started sample of `prompt` finished (or was abandoned), having `passed` or not.
    pub fn finished(&mut self, prompt: u64, passed: bool) {
        if let Some(in_flight) = self.in_flight.get_mut(&prompt) {
            *in_flight = in_flight.saturating_sub(1);
        }
        if passed {
            *self.passed.entry(prompt).or_default() += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(prompts: u64, samples: u32) -> Vec<(u64, u32)> {
        (0..prompts)
            .flat_map(|prompt| (0..samples).map(move |sample| (prompt, sample)))
            .collect()
    }

    #[test]
    fn without_a_target_every_key_runs_in_dataset_order() {
        let mut schedule = Schedule::new(keys(2, 2), None, HashMap::new());
        let order: Vec<Next> = std::iter::from_fn(|| match schedule.take_next() {
            Next::Done => None,
            next => Some(next),
        })
        .collect();
        assert_eq!(
            order,
            [
                Next::Run(0, 0),
                Next::Run(0, 1),
                Next::Run(1, 0),
                Next::Run(1, 1)
            ]
        );
    }

    #[test]
    fn a_prompt_runs_no_more_samples_at_once_than_could_be_needed_and_stops_at_enough() {
        let mut schedule = Schedule::new(keys(2, 4), Some(1), HashMap::new());
        // One sample of each prompt at a time: the second prompt's first sample goes ahead.
        assert_eq!(schedule.take_next(), Next::Run(0, 0));
        assert_eq!(schedule.take_next(), Next::Run(1, 0));
        assert_eq!(schedule.take_next(), Next::Wait);
        schedule.finished(0, true);
        schedule.finished(1, false);
        // Prompt 0 passed: its other samples are skipped; prompt 1 samples on.
        assert_eq!(schedule.take_next(), Next::Skip(0, 1));
        assert_eq!(schedule.take_next(), Next::Skip(0, 2));
        assert_eq!(schedule.take_next(), Next::Skip(0, 3));
        assert_eq!(schedule.take_next(), Next::Run(1, 1));
        assert_eq!(schedule.take_next(), Next::Wait);
        schedule.finished(1, true);
        assert_eq!(schedule.take_next(), Next::Skip(1, 2));
        assert_eq!(schedule.take_next(), Next::Skip(1, 3));
        assert_eq!(schedule.take_next(), Next::Done);
    }

    #[test]
    fn passes_on_storage_count_and_a_target_of_two_runs_two_at_once() {
        let resumed = HashMap::from([(0, 1)]);
        let pending: Vec<(u64, u32)> = keys(2, 4)
            .into_iter()
            .filter(|key| *key != (0, 0))
            .collect();
        let mut schedule = Schedule::new(pending, Some(2), resumed);
        assert_eq!(schedule.take_next(), Next::Run(0, 1));
        assert_eq!(schedule.take_next(), Next::Run(1, 0));
        assert_eq!(schedule.take_next(), Next::Run(1, 1));
        assert_eq!(schedule.take_next(), Next::Wait);
        schedule.finished(0, true);
        assert_eq!(schedule.take_next(), Next::Skip(0, 2));
        assert_eq!(schedule.take_next(), Next::Skip(0, 3));
        assert_eq!(schedule.take_next(), Next::Wait);
        assert_eq!(schedule.len(), 2);
    }
}
