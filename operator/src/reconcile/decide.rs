//! Decide: from a validated run and what was observed of its children to the children it should
//! have, the outcome so far and the counts its status shows. Pure and infallible: every error was
//! found by observe or validate.
//!
//! ```text
//!  no plan Job ─► plan ─► (summary: batches, done) ─► gen-1 ─► gen-2 … ─► merge ─► Succeeded
//!                  │ failed                           │ FailJob / too many failed   │ failed
//!                  ▼                                  ▼                             ▼
//!                Failed(PlanFailed)          Failed(WorkerConfigError |     Failed(MergeFailed)
//!                                                   TooManyFailedBatches)
//! ```
//!
//! A new attempt runs only the batches no attempt finished, up to [`MAX_ATTEMPTS`]; after that
//! the run merges what is done (the merge reports the missing batches) as long as no more than
//! `retry.maxFailedBatches` are missing.

use std::collections::BTreeSet;

use trajectory_worker::contract::{
    MergeSummary, PlanSummary, compact_ranges, format_ranges, parse_ranges,
};

use super::observe::{JobState, Observed, ObservedAttempt};
use super::status::{Merged, Outcome, Planned, Reason, Tally};
use super::validate::ValidatedRun;
use crate::api::{BatchCounts, OutputStatus, Phase, TrajectoryRunStatus};

/// Attempts of generation before the run merges what is done.
pub const MAX_ATTEMPTS: u32 = 3;

/// What the run should have now, before it is built into objects.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The children to apply (none once the run is finished).
    pub children: Vec<Child>,
    pub outcome: Outcome,
    pub tally: Tally,
}

impl Decision {
    /// A run whose spec breaks its own rules: it fails with reason `InvalidSpec`, and has no
    /// children.
    pub fn refused(message: String) -> Self {
        Self {
            children: Vec::new(),
            outcome: Outcome::Failed(Reason::InvalidSpec, message),
            tally: Tally::default(),
        }
    }
}

/// A child Job the run should have; a Job that does not exist yet comes with its plan `ConfigMap`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Child {
    Plan {
        exists: bool,
    },
    Generation {
        attempt: u32,
        pending: Pending,
        exists: bool,
    },
    Merge {
        exists: bool,
    },
}

/// The batches a generation attempt works, in index order (index *i* works batch `pending[i]`);
/// never empty, so that no Job without completions is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending(Vec<u32>);

impl Pending {
    /// `None` for an empty list.
    pub fn new(batches: Vec<u32>) -> Option<Self> {
        (!batches.is_empty()).then_some(Self(batches))
    }

    pub fn batches(&self) -> &[u32] {
        &self.0
    }

    /// The number of batches (the Job's completions).
    pub fn count(&self) -> u32 {
        u32::try_from(self.0.len()).unwrap_or(u32::MAX)
    }

    /// True when index *i* works batch *i*: the plan `ConfigMap` then needs no list.
    pub fn is_identity(&self) -> bool {
        self.0.iter().copied().eq(0..self.count())
    }
}

/// The decision: plan, then generation attempts, then merge.
pub fn decide(run: &ValidatedRun<'_>, observed: &Observed) -> Decision {
    let mut children = Vec::new();
    let mut tally = Tally::default();
    let outcome = stages(run, observed, &mut tally, &mut children);
    Decision {
        children,
        outcome,
        tally,
    }
}

/// Each stage either decides the outcome or hands the run on to the next.
fn stages(
    run: &ValidatedRun<'_>,
    observed: &Observed,
    tally: &mut Tally,
    children: &mut Vec<Child>,
) -> Outcome {
    if let Some(outcome) = plan(observed, children) {
        return outcome;
    }
    let Some(plan) = plan_summary(run, observed) else {
        return Outcome::Failed(
            Reason::PlanFailed,
            "the plan Job completed without a summary in its termination message".into(),
        );
    };
    if let Some(outcome) = generate(run, observed, &plan, tally, children) {
        return outcome;
    }
    merge(run, observed, tally, children)
}

/// The plan stage's outcome while it is not done; `None` once the plan Job completed.
fn plan(observed: &Observed, children: &mut Vec<Child>) -> Option<Outcome> {
    let planning = || {
        Some(Outcome::Working(
            Phase::Planning,
            "planning the dataset".into(),
        ))
    };
    let Some(plan_job) = &observed.plan_job else {
        children.push(Child::Plan { exists: false });
        return planning();
    };
    match JobState::of(plan_job) {
        JobState::Running => {
            children.push(Child::Plan { exists: true });
            planning()
        }
        JobState::Failed { message, .. } => Some(Outcome::Failed(
            Reason::PlanFailed,
            format!("the plan Job failed: {message}"),
        )),
        JobState::Complete => None,
    }
}

/// The plan's summary: read from the plan pod's termination message; that pod goes when its node
/// does (a scaled-down node, hours into a run), so what the status recorded from it stands in.
fn plan_summary(run: &ValidatedRun<'_>, observed: &Observed) -> Option<PlanSummary> {
    observed
        .plan_summary
        .clone()
        .or_else(|| recorded_plan(run.status()))
}

/// The generation stage's outcome while batches are pending and attempts remain; `None` when the
/// run goes on to merge.
fn generate(
    run: &ValidatedRun<'_>,
    observed: &Observed,
    plan: &PlanSummary,
    tally: &mut Tally,
    children: &mut Vec<Child>,
) -> Option<Outcome> {
    let total = plan.batches;
    let mut done: BTreeSet<u32> = plan
        .done
        .iter()
        .flat_map(|range| range.first..=range.last)
        .collect();
    let mut failed = BTreeSet::new();
    for attempt in &observed.attempts {
        done.extend(attempt.batches.completed.iter().copied());
        failed.extend(attempt.batches.failed.iter().copied());
    }
    tally.batches = Some(batch_counts(total, &done, &failed));
    tally.progress = Some(progress(&done, total));
    tally.planned = Some(Planned {
        total: plan.prompts,
        invalid: plan.invalid,
    });

    let pending = Pending::new(pending_batches(total, &done))?;
    let next = match observed.attempts.last() {
        None => 1,
        Some(current) => match JobState::of(&current.job) {
            JobState::Running => {
                tally.attempt = Some(current.attempt);
                if let Some(pending) = Pending::new(current.pending.clone()) {
                    children.push(Child::Generation {
                        attempt: current.attempt,
                        pending,
                        exists: true,
                    });
                }
                let message = format!(
                    "attempt {}: {} of {total} batches done",
                    current.attempt,
                    done.len()
                );
                return Some(Outcome::Working(Phase::Running, message));
            }
            state => match after_attempt(run, current, &state, &pending) {
                AfterAttempt::Fail(outcome) => return Some(outcome),
                AfterAttempt::Next(attempt) => attempt,
                AfterAttempt::Merge => return None,
            },
        },
    };
    Some(start_attempt(next, pending, tally, children))
}

/// What follows an attempt that ended with batches still pending.
enum AfterAttempt {
    Fail(Outcome),
    Next(u32),
    /// No attempt is left, and few enough batches are missing: merge what is done.
    Merge,
}

fn after_attempt(
    run: &ValidatedRun<'_>,
    current: &ObservedAttempt,
    state: &JobState,
    pending: &Pending,
) -> AfterAttempt {
    let retry = &run.spec.retry;
    match state {
        JobState::Failed { reason, message } if reason == "PodFailurePolicy" => {
            AfterAttempt::Fail(Outcome::Failed(
                Reason::WorkerConfigError,
                format!("a worker stopped on a configuration error no retry can fix: {message}"),
            ))
        }
        JobState::Failed { reason, .. } if reason == "MaxFailedIndexesExceeded" => {
            AfterAttempt::Fail(Outcome::Failed(
                Reason::TooManyFailedBatches,
                format!(
                    "more than {} batches failed after {} retries each",
                    retry.max_failed_batches, retry.per_batch
                ),
            ))
        }
        _ if pending.count() > retry.max_failed_batches && current.attempt >= MAX_ATTEMPTS => {
            AfterAttempt::Fail(Outcome::Failed(
                Reason::TooManyFailedBatches,
                format!(
                    "{} batches are not done after {MAX_ATTEMPTS} attempts; at most {} may be missing",
                    pending.count(),
                    retry.max_failed_batches
                ),
            ))
        }
        _ if current.attempt < MAX_ATTEMPTS => AfterAttempt::Next(current.attempt + 1),
        _ => AfterAttempt::Merge,
    }
}

/// A new generation attempt over the pending batches.
fn start_attempt(
    attempt: u32,
    pending: Pending,
    tally: &mut Tally,
    children: &mut Vec<Child>,
) -> Outcome {
    tally.attempt = Some(attempt);
    let message = format!("attempt {attempt}: {} batches to generate", pending.count());
    children.push(Child::Generation {
        attempt,
        pending,
        exists: false,
    });
    Outcome::Working(Phase::Running, message)
}

/// The merge stage: started once generation is over, then finished or failed.
fn merge(
    run: &ValidatedRun<'_>,
    observed: &Observed,
    tally: &mut Tally,
    children: &mut Vec<Child>,
) -> Outcome {
    let merging = || Outcome::Working(Phase::Merging, "merging the batches".into());
    let Some(merge_job) = &observed.merge_job else {
        children.push(Child::Merge { exists: false });
        return merging();
    };
    match JobState::of(merge_job) {
        JobState::Running => {
            children.push(Child::Merge { exists: true });
            merging()
        }
        JobState::Failed { message, .. } => Outcome::Failed(
            Reason::MergeFailed,
            format!("the merge Job failed: {message}"),
        ),
        JobState::Complete => {
            // Without the merge pod (gone with its node), the counts recorded from it stand.
            let Some(merge) = &observed.merge_summary else {
                let message = match run.status().and_then(|status| status.output.as_ref()) {
                    Some(output) => format!("{} trajectories written", output.trajectories),
                    None => "trajectories written (the merge pod, and its counts, are gone)".into(),
                };
                return Outcome::Succeeded(message);
            };
            tally.merged = Some(merged(run, merge));
            Outcome::Succeeded(format!("{} trajectories written", merge.trajectories))
        }
    }
}

fn merged(run: &ValidatedRun<'_>, merge: &MergeSummary) -> Merged {
    Merged {
        succeeded: merge.trajectories,
        discarded: merge.discarded,
        failed: merge.failed,
        output: OutputStatus {
            path: run.output_path.clone(),
            trajectories: merge.trajectories,
            bytes: merge.bytes,
        },
    }
}

/// The plan's summary as far as the run's status recorded it (once the plan was observed, every
/// status write carries its batch total and prompt counts): the batches completed so far stand
/// for the plan's `done`, of which they are a superset. `None` before anything was recorded.
fn recorded_plan(status: Option<&TrajectoryRunStatus>) -> Option<PlanSummary> {
    let status = status?;
    let (batches, prompts) = (status.batches.as_ref()?, status.prompts.as_ref()?);
    let done = parse_ranges(&batches.completed).ok()?;
    Some(PlanSummary {
        prompts: prompts.total,
        invalid: prompts.invalid,
        batches: batches.total,
        done: compact_ranges(done),
        dataset_digest: String::new(),
        spec_hash: String::new(),
    })
}

/// The batches not yet done, in order: what the next attempt works.
pub fn pending_batches(total: u32, done: &BTreeSet<u32>) -> Vec<u32> {
    (0..total).filter(|batch| !done.contains(batch)).collect()
}

/// The status' batch counts: done batches (from the plan's recovery scan and every attempt) and the
/// batches that failed and are not done.
pub fn batch_counts(total: u32, done: &BTreeSet<u32>, failed: &BTreeSet<u32>) -> BatchCounts {
    let failed: Vec<u32> = failed.difference(done).copied().collect();
    BatchCounts {
        total,
        completed: format_ranges(&compact_ranges(done.iter().copied())),
        failed: format_ranges(&compact_ranges(failed)),
    }
}

/// `done/total`, the Progress printer column.
pub fn progress(done: &BTreeSet<u32>, total: u32) -> String {
    format!("{}/{total}", done.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_counts_use_compact_ranges_and_progress_counts_done_batches() {
        let done: BTreeSet<u32> = (0..=41).chain([44]).collect();
        let failed: BTreeSet<u32> = [42, 44, 50].into();
        let counts = batch_counts(120, &done, &failed);
        assert_eq!(counts.total, 120);
        assert_eq!(counts.completed, "0-41,44");
        // A batch that failed in one attempt and finished in a later one is not failed.
        assert_eq!(counts.failed, "42,50");
        assert_eq!(progress(&done, 120), "43/120");
        assert_eq!(
            batch_counts(3, &BTreeSet::new(), &BTreeSet::new()).completed,
            ""
        );
    }

    #[test]
    fn pending_batches_skip_the_done_ones() {
        let done: BTreeSet<u32> = [0, 1, 3].into();
        assert_eq!(pending_batches(6, &done), [2, 4, 5]);
        assert_eq!(pending_batches(2, &[0, 1].into()), Vec::<u32>::new());
        assert_eq!(pending_batches(3, &BTreeSet::new()), [0, 1, 2]);
    }
}
