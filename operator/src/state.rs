//! The reconcile decision: from a run and what was observed of its children to the children it
//! should have and the status it should show. Pure (the time is passed in); the controller does
//! the reading ([`crate::observe`]) and the writing ([`crate::apply`]).
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
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use trajectory_worker::contract::{MergeSummary, PlanSummary, compact_ranges, parse_ranges};

use crate::api::{
    ConditionType, OutputStatus, Phase, PromptCounts, TrajectoryRun, TrajectoryRunStatus,
};
use crate::desired::{
    self, AttemptOutcome, DesiredError, Reason, Settings, Stage, batch_counts, pending_batches,
    progress, set_condition,
};

/// Attempts of generation before the run merges what is done.
pub const MAX_ATTEMPTS: u32 = 3;

/// How a child Job ended, from its conditions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobState {
    Running,
    Complete,
    /// Failed, with the Job condition's reason (`PodFailurePolicy`, `MaxFailedIndexesExceeded`,
    /// `BackoffLimitExceeded`, ...) and message.
    Failed {
        reason: String,
        message: String,
    },
}

impl JobState {
    pub fn of(job: &Job) -> Self {
        let conditions = job.status.as_ref().and_then(|s| s.conditions.as_ref());
        let holds = |type_: &str| {
            conditions
                .into_iter()
                .flatten()
                .find(|c| c.type_ == type_ && c.status == "True")
        };
        if let Some(failed) = holds("Failed") {
            Self::Failed {
                reason: failed.reason.clone().unwrap_or_default(),
                message: failed.message.clone().unwrap_or_default(),
            }
        } else if holds("Complete").is_some() {
            Self::Complete
        } else {
            Self::Running
        }
    }
}

/// One generation attempt as observed: its Job and the batch each index works.
#[derive(Debug, Clone)]
pub struct ObservedAttempt {
    pub attempt: u32,
    pub job: Job,
    pub pending: Vec<u32>,
}

/// What the controller read about a run's children.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    pub plan_job: Option<Job>,
    /// The plan pod's termination message, once the plan Job completed.
    pub plan_summary: Option<PlanSummary>,
    /// Attempts in ascending order.
    pub attempts: Vec<ObservedAttempt>,
    pub merge_job: Option<Job>,
    pub merge_summary: Option<MergeSummary>,
}

/// Everything the run should have now.
#[derive(Debug, Clone, Default)]
pub struct Desired {
    pub config_maps: Vec<ConfigMap>,
    pub jobs: Vec<Job>,
    pub status: TrajectoryRunStatus,
}

/// The decision. Errors are about the run itself (a bad spec, an unreadable Job status).
pub fn desired_state(
    run: &TrajectoryRun,
    observed: &Observed,
    settings: &Settings,
    now: &Time,
) -> Result<Desired, DesiredError> {
    let generation = run.metadata.generation;
    let mut status = run.status.clone().unwrap_or_default();
    status.observed_generation = generation;
    if status.start_time.is_none() {
        status.start_time = Some(now.clone());
    }
    let mut out = Desired::default();
    let spec = &run.spec.run;
    let mut conditions = std::mem::take(&mut status.conditions);
    let had_failed = conditions
        .iter()
        .any(|c| c.type_ == ConditionType::Failed.as_str());
    let mut set = |type_, value, reason: Reason, message: &str| {
        set_condition(
            &mut conditions,
            type_,
            value,
            reason,
            message,
            generation,
            now,
        );
    };
    set(
        ConditionType::Suspended,
        spec.suspend,
        if spec.suspend {
            Reason::Suspended
        } else {
            Reason::Resumed
        },
        if spec.suspend {
            "spec.suspend is set"
        } else {
            "running"
        },
    );
    let outcome = decide(run, observed, settings, &mut out, &mut status)?;
    match &outcome {
        Outcome::Working(phase, message) => {
            status.phase = Some(*phase);
            let reason = match phase {
                Phase::Planning => Reason::Planning,
                Phase::Merging => Reason::Merging,
                _ => Reason::Generating,
            };
            // kstatus: InProgress while work is under way (like a running Job); Current while
            // suspended, which is what the spec asks for.
            let working = !spec.suspend;
            let (reconciling_reason, reconciling_message) = if working {
                (reason, message.as_str())
            } else {
                (Reason::Suspended, "spec.suspend is set")
            };
            set(ConditionType::Progressing, working, reason, message);
            set(
                ConditionType::Reconciling,
                working,
                reconciling_reason,
                reconciling_message,
            );
            set(ConditionType::Ready, false, reason, message);
            set(ConditionType::Stalled, false, reason, message);
            // A run stalled on a bad spec works again once the spec is fixed.
            status.completion_time = None;
            if had_failed {
                set(ConditionType::Failed, false, reason, message);
            }
        }
        Outcome::Succeeded(message) => {
            status.phase = Some(Phase::Succeeded);
            status.completion_time.get_or_insert_with(|| now.clone());
            set(
                ConditionType::Progressing,
                false,
                Reason::Succeeded,
                message,
            );
            set(
                ConditionType::Reconciling,
                false,
                Reason::Succeeded,
                message,
            );
            set(ConditionType::Succeeded, true, Reason::Succeeded, message);
            set(ConditionType::Ready, true, Reason::Succeeded, message);
            set(ConditionType::Stalled, false, Reason::Succeeded, message);
        }
        Outcome::Failed(reason, message) => {
            status.phase = Some(Phase::Failed);
            status.completion_time.get_or_insert_with(|| now.clone());
            set(ConditionType::Progressing, false, *reason, message);
            set(ConditionType::Reconciling, false, *reason, message);
            set(ConditionType::Failed, true, *reason, message);
            set(ConditionType::Ready, false, *reason, message);
            set(ConditionType::Stalled, true, *reason, message);
        }
    }
    status.conditions = conditions;
    out.status = status;
    Ok(out)
}

enum Outcome {
    Working(Phase, String),
    Succeeded(String),
    Failed(Reason, String),
}

fn decide(
    run: &TrajectoryRun,
    observed: &Observed,
    settings: &Settings,
    out: &mut Desired,
    status: &mut TrajectoryRunStatus,
) -> Result<Outcome, DesiredError> {
    let spec = &run.spec.run;
    let violations = spec.validate();
    if !violations.is_empty() {
        let message = violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        return Ok(Outcome::Failed(Reason::InvalidSpec, message));
    }

    // Plan.
    let Some(plan_job) = &observed.plan_job else {
        out.config_maps
            .push(desired::plan_config_map(run, Stage::Plan, None)?);
        out.jobs.push(desired::plan_job(run, settings, false)?);
        return Ok(Outcome::Working(
            Phase::Planning,
            "planning the dataset".into(),
        ));
    };
    match JobState::of(plan_job) {
        JobState::Running => {
            out.jobs.push(desired::plan_job(run, settings, true)?);
            return Ok(Outcome::Working(
                Phase::Planning,
                "planning the dataset".into(),
            ));
        }
        JobState::Failed { message, .. } => {
            return Ok(Outcome::Failed(
                Reason::PlanFailed,
                format!("the plan Job failed: {message}"),
            ));
        }
        JobState::Complete => {}
    }
    // The summary is read from the plan pod's termination message; that pod goes when its node
    // does (a scaled-down node, hours into a run), so what the status recorded from it stands in.
    let recorded = observed
        .plan_summary
        .is_none()
        .then(|| recorded_plan(run.status.as_ref()))
        .flatten();
    let Some(plan) = observed.plan_summary.as_ref().or(recorded.as_ref()) else {
        return Ok(Outcome::Failed(
            Reason::PlanFailed,
            "the plan Job completed without a summary in its termination message".into(),
        ));
    };
    let total = plan.batches;
    let mut done: BTreeSet<u32> = plan
        .done
        .iter()
        .flat_map(|range| range.first..=range.last)
        .collect();
    let mut failed = BTreeSet::new();
    for attempt in &observed.attempts {
        let AttemptOutcome {
            completed,
            failed: attempt_failed,
        } = desired::attempt_outcome(&attempt.job, &attempt.pending)?;
        done.extend(completed);
        failed.extend(attempt_failed);
    }
    status.batches = Some(batch_counts(total, &done, &failed));
    status.progress = Some(progress(&done, total));
    let prompts = status.prompts.get_or_insert_with(PromptCounts::default);
    prompts.total = plan.prompts;
    prompts.invalid = plan.invalid;

    // Generate.
    let pending = pending_batches(total, &done);
    if !pending.is_empty() {
        let current = observed.attempts.last();
        let next = match current {
            None => Some(1),
            Some(attempt) => match JobState::of(&attempt.job) {
                JobState::Running => {
                    status.attempt = Some(attempt.attempt);
                    out.jobs.push(desired::generation_job(
                        run,
                        settings,
                        attempt.attempt,
                        &attempt.pending,
                        true,
                    )?);
                    let message = format!(
                        "attempt {}: {} of {total} batches done",
                        attempt.attempt,
                        done.len()
                    );
                    return Ok(Outcome::Working(Phase::Running, message));
                }
                JobState::Failed { reason, message } if reason == "PodFailurePolicy" => {
                    return Ok(Outcome::Failed(
                        Reason::WorkerConfigError,
                        format!(
                            "a worker stopped on a configuration error no retry can fix: {message}"
                        ),
                    ));
                }
                JobState::Failed { reason, .. } if reason == "MaxFailedIndexesExceeded" => {
                    return Ok(Outcome::Failed(
                        Reason::TooManyFailedBatches,
                        format!(
                            "more than {} batches failed after {} retries each",
                            spec.retry.max_failed_batches, spec.retry.per_batch
                        ),
                    ));
                }
                _ if pending.len() > to_usize(spec.retry.max_failed_batches)
                    && attempt.attempt >= MAX_ATTEMPTS =>
                {
                    return Ok(Outcome::Failed(
                        Reason::TooManyFailedBatches,
                        format!(
                            "{} batches are not done after {MAX_ATTEMPTS} attempts; at most {} may be missing",
                            pending.len(),
                            spec.retry.max_failed_batches
                        ),
                    ));
                }
                _ => (attempt.attempt < MAX_ATTEMPTS).then_some(attempt.attempt + 1),
            },
        };
        if let Some(attempt) = next {
            status.attempt = Some(attempt);
            out.config_maps.push(desired::plan_config_map(
                run,
                Stage::Generate { attempt },
                Some(&pending),
            )?);
            out.jobs.push(desired::generation_job(
                run, settings, attempt, &pending, false,
            )?);
            let message = format!("attempt {attempt}: {} batches to generate", pending.len());
            return Ok(Outcome::Working(Phase::Running, message));
        }
    }

    // Merge.
    let Some(merge_job) = &observed.merge_job else {
        out.config_maps
            .push(desired::plan_config_map(run, Stage::Merge, None)?);
        out.jobs.push(desired::merge_job(run, settings, false)?);
        return Ok(Outcome::Working(
            Phase::Merging,
            "merging the batches".into(),
        ));
    };
    match JobState::of(merge_job) {
        JobState::Running => {
            out.jobs.push(desired::merge_job(run, settings, true)?);
            Ok(Outcome::Working(
                Phase::Merging,
                "merging the batches".into(),
            ))
        }
        JobState::Failed { message, .. } => Ok(Outcome::Failed(
            Reason::MergeFailed,
            format!("the merge Job failed: {message}"),
        )),
        JobState::Complete => {
            // Without the merge pod (gone with its node), the counts recorded from it stand.
            let Some(merge) = observed.merge_summary.clone() else {
                let message = match &status.output {
                    Some(output) => format!("{} trajectories written", output.trajectories),
                    None => "trajectories written (the merge pod, and its counts, are gone)".into(),
                };
                return Ok(Outcome::Succeeded(message));
            };
            let prompts = status.prompts.get_or_insert_with(PromptCounts::default);
            prompts.succeeded = merge.trajectories;
            prompts.discarded = merge.discarded;
            prompts.failed = merge.failed;
            status.output = Some(OutputStatus {
                path: spec.output_path(
                    run.metadata.namespace.as_deref().unwrap_or_default(),
                    run.metadata.name.as_deref().unwrap_or_default(),
                ),
                trajectories: merge.trajectories,
                bytes: merge.bytes,
            });
            Ok(Outcome::Succeeded(format!(
                "{} trajectories written",
                merge.trajectories
            )))
        }
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

/// Whether to write a run's status now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusWrite {
    /// The run already shows it.
    Unchanged,
    /// Write it now.
    Now,
    /// Only progress changed and the last write is recent: write it after this long (the caller
    /// requeues the run for then, so the last progress is never lost).
    After(Duration),
}

/// Decides when to write `desired` over the run's `current` status, `since_written` after this
/// process last wrote it (`None`: not in the last `interval`, or never).
///
/// Anything but progress — phase, attempt, a condition's status or reason, `observedGeneration`,
/// counts, output — is written at once, so that users, `kubectl wait`, kstatus and the phase-change
/// Events see it promptly. A change of progress alone (completed and failed batch ranges, the
/// progress column, and the condition messages that repeat it) is written at most once per
/// `interval`.
pub fn status_write(
    current: Option<&TrajectoryRunStatus>,
    desired: &TrajectoryRunStatus,
    since_written: Option<Duration>,
    interval: Duration,
) -> StatusWrite {
    let Some(current) = current else {
        return StatusWrite::Now;
    };
    if current == desired {
        return StatusWrite::Unchanged;
    }
    if without_progress(current) != without_progress(desired) {
        return StatusWrite::Now;
    }
    match since_written
        .and_then(|since| interval.checked_sub(since))
        .filter(|rest| !rest.is_zero())
    {
        Some(rest) => StatusWrite::After(rest),
        None => StatusWrite::Now,
    }
}

/// The status with everything that moves as batches finish blanked out.
fn without_progress(status: &TrajectoryRunStatus) -> TrajectoryRunStatus {
    let mut status = status.clone();
    status.batches = None;
    status.progress = None;
    for condition in &mut status.conditions {
        condition.message.clear();
    }
    status
}

fn to_usize(value: u32) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};
    use k8s_openapi::jiff::Timestamp;
    use serde_json::json;
    use trajectory_worker::contract::{BatchRange, RunPlan};
    use trajectory_worker::spec::RunSpec;

    use super::*;
    use crate::api::TrajectoryRunSpec;

    fn run() -> TrajectoryRun {
        let spec: RunSpec = serde_json::from_value(json!({
            "dataset": {"path": "d.jsonl"},
            "model": {"baseUrl": "http://m/v1", "name": "m"},
            "storage": {"volume": {"persistentVolumeClaim": {"claimName": "data"}}},
            "retry": {"perBatch": 2, "maxFailedBatches": 1},
        }))
        .unwrap();
        let mut run = TrajectoryRun::new("r", TrajectoryRunSpec::from(spec));
        run.metadata.namespace = Some("ns".into());
        run.metadata.uid = Some("uid-1".into());
        run.metadata.generation = Some(1);
        run
    }

    fn now() -> Time {
        Time(Timestamp::from_second(10_000).unwrap())
    }

    fn job(name: &str, state: &str, completed: &str, failed: &str) -> Job {
        let condition = |type_: &str, reason: &str| JobCondition {
            type_: type_.into(),
            status: "True".into(),
            reason: Some(reason.into()),
            message: Some(format!("{reason} happened")),
            ..JobCondition::default()
        };
        let conditions = match state {
            "complete" => vec![condition("Complete", "CompletionsReached")],
            "running" => vec![],
            reason => vec![condition("Failed", reason)],
        };
        Job {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: None,
            status: Some(JobStatus {
                conditions: Some(conditions),
                completed_indexes: Some(completed.into()),
                failed_indexes: Some(failed.into()),
                ..JobStatus::default()
            }),
        }
    }

    fn planned(batches: u32, done: &[(u32, u32)]) -> Observed {
        Observed {
            plan_job: Some(job("r-plan", "complete", "", "")),
            plan_summary: Some(PlanSummary {
                prompts: u64::from(batches) * 10,
                invalid: 2,
                batches,
                done: done
                    .iter()
                    .map(|&(first, last)| BatchRange { first, last })
                    .collect(),
                dataset_digest: "sha256:x".into(),
                spec_hash: "blake3:y".into(),
            }),
            ..Observed::default()
        }
    }

    /// A run of `batches` batches, all done, whose merge wrote `trajectories` (and one discarded
    /// record).
    fn merged(batches: u32, trajectories: u64) -> Observed {
        let mut observed = planned(batches, &[(0, batches - 1)]);
        observed.merge_job = Some(job("r-merge", "complete", "", ""));
        observed.merge_summary = Some(MergeSummary {
            trajectories,
            discarded: 1,
            failed: 0,
            bytes: 4096,
            skipped_lines: 0,
        });
        observed
    }

    fn attempt(
        attempt: u32,
        pending: &[u32],
        state: &str,
        completed: &str,
        failed: &str,
    ) -> ObservedAttempt {
        ObservedAttempt {
            attempt,
            job: job(&format!("r-gen-{attempt}"), state, completed, failed),
            pending: pending.to_vec(),
        }
    }

    fn decide(observed: &Observed) -> Desired {
        desired_state(&run(), observed, &Settings::default(), &now()).unwrap()
    }

    fn names(desired: &Desired) -> Vec<String> {
        desired
            .jobs
            .iter()
            .map(|j| j.metadata.name.clone().unwrap())
            .collect()
    }

    fn condition(desired: &Desired, type_: ConditionType) -> (&str, &str) {
        let c = desired
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == type_.as_str())
            .unwrap_or_else(|| panic!("no {} condition", type_.as_str()));
        (c.status.as_str(), c.reason.as_str())
    }

    fn plan_batches(desired: &Desired, name: &str) -> Option<Vec<u32>> {
        let map = desired
            .config_maps
            .iter()
            .find(|m| m.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no ConfigMap {name}"));
        let plan: RunPlan = serde_json::from_str(&map.data.as_ref().unwrap()["plan.json"]).unwrap();
        plan.batches
    }

    #[test]
    fn a_new_run_starts_planning() {
        let desired = decide(&Observed::default());
        assert_eq!(names(&desired), ["r-plan"]);
        assert_eq!(desired.status.phase, Some(Phase::Planning));
        assert_eq!(desired.status.observed_generation, Some(1));
        assert_eq!(desired.status.start_time, Some(now()));
        assert_eq!(
            condition(&desired, ConditionType::Progressing),
            ("True", "Planning")
        );
        assert_eq!(condition(&desired, ConditionType::Ready).0, "False");
    }

    #[test]
    fn a_finished_plan_starts_the_first_attempt_on_the_batches_not_done() {
        let desired = decide(&planned(5, &[(0, 1)]));
        assert_eq!(names(&desired), ["r-gen-1"]);
        assert_eq!(plan_batches(&desired, "r-gen-1"), Some(vec![2, 3, 4]));
        assert_eq!(desired.jobs[0].spec.as_ref().unwrap().completions, Some(3));
        assert_eq!(desired.status.progress.as_deref(), Some("2/5"));
        assert_eq!(desired.status.attempt, Some(1));
        let prompts = desired.status.prompts.as_ref().unwrap();
        assert_eq!((prompts.total, prompts.invalid), (50, 2));
    }

    #[test]
    fn a_running_attempt_reports_batches_through_its_pending_list() {
        let mut observed = planned(5, &[(0, 1)]);
        observed
            .attempts
            .push(attempt(1, &[2, 3, 4], "running", "0,2", ""));
        let desired = decide(&observed);
        assert_eq!(names(&desired), ["r-gen-1"]);
        assert!(desired.config_maps.is_empty());
        let batches = desired.status.batches.as_ref().unwrap();
        assert_eq!(batches.completed, "0-2,4");
        assert_eq!(desired.status.progress.as_deref(), Some("4/5"));
        assert_eq!(desired.status.phase, Some(Phase::Running));
    }

    #[test]
    fn an_attempt_that_left_batches_undone_is_followed_by_one_for_them_only() {
        let mut observed = planned(5, &[]);
        observed
            .attempts
            .push(attempt(1, &[0, 1, 2, 3, 4], "complete", "0-2,4", "3"));
        let desired = decide(&observed);
        assert_eq!(names(&desired), ["r-gen-2"]);
        assert_eq!(plan_batches(&desired, "r-gen-2"), Some(vec![3]));
        assert_eq!(desired.status.batches.as_ref().unwrap().failed, "3");
        assert_eq!(desired.status.attempt, Some(2));
    }

    #[test]
    fn after_the_last_attempt_the_run_merges_what_is_done_within_the_failure_budget() {
        let mut observed = planned(3, &[]);
        observed
            .attempts
            .push(attempt(1, &[0, 1, 2], "complete", "0-1", "2"));
        observed
            .attempts
            .push(attempt(2, &[2], "complete", "", "0"));
        observed
            .attempts
            .push(attempt(3, &[2], "complete", "", "0"));
        assert_eq!(names(&decide(&observed)), ["r-merge"]);
    }

    #[test]
    fn too_many_missing_batches_after_the_last_attempt_fail_the_run() {
        let mut observed = planned(3, &[]);
        observed
            .attempts
            .push(attempt(1, &[0, 1, 2], "complete", "0", "1-2"));
        observed
            .attempts
            .push(attempt(2, &[1, 2], "complete", "", "0-1"));
        observed
            .attempts
            .push(attempt(3, &[1, 2], "complete", "", "0-1"));
        let desired = decide(&observed);
        assert!(desired.jobs.is_empty());
        assert_eq!(desired.status.phase, Some(Phase::Failed));
        assert_eq!(
            condition(&desired, ConditionType::Failed),
            ("True", "TooManyFailedBatches")
        );
        assert_eq!(condition(&desired, ConditionType::Stalled).0, "True");
    }

    #[test]
    fn job_failures_map_to_run_failure_reasons() {
        let cases = [
            ("PodFailurePolicy", "WorkerConfigError"),
            ("MaxFailedIndexesExceeded", "TooManyFailedBatches"),
        ];
        for (job_reason, run_reason) in cases {
            let mut observed = planned(3, &[]);
            observed
                .attempts
                .push(attempt(1, &[0, 1, 2], job_reason, "", ""));
            let desired = decide(&observed);
            assert_eq!(desired.status.phase, Some(Phase::Failed), "{job_reason}");
            assert_eq!(
                condition(&desired, ConditionType::Failed),
                ("True", run_reason)
            );
            assert_eq!(desired.status.completion_time, Some(now()));
        }
        let observed = Observed {
            plan_job: Some(job("r-plan", "BackoffLimitExceeded", "", "")),
            ..Observed::default()
        };
        let desired = decide(&observed);
        assert_eq!(
            condition(&desired, ConditionType::Failed),
            ("True", "PlanFailed")
        );
    }

    #[test]
    fn a_finished_merge_succeeds_the_run_with_its_output() {
        let desired = decide(&merged(2, 19));
        assert!(desired.jobs.is_empty());
        assert_eq!(desired.status.phase, Some(Phase::Succeeded));
        let output = desired.status.output.as_ref().unwrap();
        assert_eq!(
            (output.path.as_str(), output.trajectories, output.bytes),
            ("runs/ns/r", 19, 4096)
        );
        assert_eq!(
            condition(&desired, ConditionType::Ready),
            ("True", "Succeeded")
        );
        assert_eq!(condition(&desired, ConditionType::Succeeded).0, "True");
        assert_eq!(desired.status.progress.as_deref(), Some("2/2"));
    }

    #[test]
    fn an_invalid_spec_stalls_the_run_naming_the_field() {
        let mut run = run();
        run.spec.run.batch_size = 0;
        let desired =
            desired_state(&run, &Observed::default(), &Settings::default(), &now()).unwrap();
        assert!(desired.jobs.is_empty());
        assert_eq!(
            condition(&desired, ConditionType::Failed),
            ("True", "InvalidSpec")
        );
        let failed = desired
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "Failed")
            .unwrap();
        assert!(
            failed.message.contains("spec.batchSize"),
            "{}",
            failed.message
        );
    }

    #[test]
    fn deciding_twice_changes_nothing() {
        let mut run = run();
        let observed = planned(5, &[(0, 1)]);
        let first = desired_state(&run, &observed, &Settings::default(), &now()).unwrap();
        run.status = Some(first.status.clone());
        let later = Time(Timestamp::from_second(20_000).unwrap());
        let second = desired_state(&run, &observed, &Settings::default(), &later).unwrap();
        assert_eq!(first.status, second.status);
    }

    #[test]
    fn progress_alone_is_written_at_most_once_per_interval_and_anything_else_at_once() {
        let interval = Duration::from_secs(3);
        let mut running = planned(5, &[]);
        running
            .attempts
            .push(attempt(1, &[0, 1, 2, 3, 4], "running", "", ""));
        let written = decide(&running).status;
        let mut moved = running.clone();
        moved.attempts[0] = attempt(1, &[0, 1, 2, 3, 4], "running", "0-1", "");
        let progressed = decide(&moved).status;
        assert_eq!(progressed.progress.as_deref(), Some("2/5"));
        let mut merging = planned(5, &[(0, 4)]);
        merging.attempts = moved.attempts.clone();
        let merged = decide(&merging).status;
        assert_eq!(merged.phase, Some(Phase::Merging));
        let mut regenerated = written.clone();
        regenerated.observed_generation = Some(2);

        let second = Duration::from_secs(1);
        let cases = [
            // (current, desired, since the last write, decision)
            (None, &written, Some(second), StatusWrite::Now),
            (Some(&written), &written, None, StatusWrite::Unchanged),
            (
                Some(&written),
                &progressed,
                Some(second),
                StatusWrite::After(2 * second),
            ),
            (
                Some(&written),
                &progressed,
                Some(interval),
                StatusWrite::Now,
            ),
            (Some(&written), &progressed, None, StatusWrite::Now),
            // A phase change is never held back, nor is a new generation of the spec.
            (
                Some(&written),
                &merged,
                Some(Duration::ZERO),
                StatusWrite::Now,
            ),
            (
                Some(&written),
                &regenerated,
                Some(Duration::ZERO),
                StatusWrite::Now,
            ),
        ];
        for (i, (current, desired, since, expected)) in cases.into_iter().enumerate() {
            assert_eq!(
                status_write(current, desired, since, interval),
                expected,
                "case {i}"
            );
        }
        // A wiped status is rebuilt at once.
        let wiped = TrajectoryRunStatus::default();
        assert_eq!(
            status_write(Some(&wiped), &progressed, Some(Duration::ZERO), interval),
            StatusWrite::Now
        );
    }

    /// The plan and merge summaries come from pods' termination messages, and a pod goes with its
    /// node (an autoscaler removing it mid-run): what the status recorded stands in for them, so
    /// the run neither fails nor loses its counts.
    #[test]
    fn a_run_whose_plan_and_merge_pods_are_gone_goes_on_from_its_recorded_status() {
        let decide_with = |status: Option<TrajectoryRunStatus>, observed: &Observed| {
            let mut run = run();
            run.status = status;
            desired_state(&run, observed, &Settings::default(), &now()).unwrap()
        };
        // Batches 0-1 were done before the run (the plan found them); attempt 1 completed 2.
        let mut observed = planned(5, &[(0, 1)]);
        observed
            .attempts
            .push(attempt(1, &[2, 3, 4], "running", "2", ""));
        let with_pod = decide_with(None, &observed);
        assert_eq!(with_pod.status.progress.as_deref(), Some("3/5"));

        observed.plan_summary = None;
        let without_pod = decide_with(Some(with_pod.status.clone()), &observed);
        assert_eq!(names(&without_pod), names(&with_pod));
        assert_eq!(without_pod.status, with_pod.status);

        // Nothing recorded yet: the run cannot know its batches.
        let unrecorded = decide_with(None, &observed);
        assert_eq!(
            condition(&unrecorded, ConditionType::Failed),
            ("True", "PlanFailed")
        );

        // A succeeded run keeps its counts when both pods are gone.
        let mut merged = merged(5, 48);
        let succeeded = decide_with(None, &merged).status;
        merged.plan_summary = None;
        merged.merge_summary = None;
        let later = decide_with(Some(succeeded.clone()), &merged).status;
        assert_eq!(later, succeeded);
        assert_eq!(later.output.as_ref().unwrap().trajectories, 48);
        assert_eq!(later.phase, Some(Phase::Succeeded));
    }

    /// kstatus (Flux, `kubectl wait`): `observedGeneration` always; `Reconciling` while work is under
    /// way, `Stalled` when the run failed, `Ready` and `Succeeded` when it succeeded.
    #[test]
    fn conditions_say_what_kstatus_and_kubectl_wait_read() {
        fn holds(status: &TrajectoryRunStatus) -> Vec<&str> {
            let mut types: Vec<&str> = status
                .conditions
                .iter()
                .filter(|c| c.status == "True")
                .map(|c| c.type_.as_str())
                .collect();
            types.sort_unstable();
            types
        }
        let planning = decide(&Observed::default()).status;
        assert_eq!(planning.observed_generation, Some(1));
        assert_eq!(holds(&planning), ["Progressing", "Reconciling"]);

        let mut done = planned(2, &[(0, 1)]);
        done.merge_job = Some(job("r-merge", "complete", "", ""));
        let succeeded = decide(&done).status;
        assert_eq!(holds(&succeeded), ["Ready", "Succeeded"]);

        let mut failed = planned(3, &[]);
        failed
            .attempts
            .push(attempt(1, &[0, 1, 2], "PodFailurePolicy", "", ""));
        let failed = decide(&failed).status;
        assert_eq!(holds(&failed), ["Failed", "Stalled"]);

        let mut suspended = run();
        suspended.spec.run.suspend = true;
        let mut observed = planned(3, &[]);
        observed
            .attempts
            .push(attempt(1, &[0, 1, 2], "running", "", ""));
        let status = desired_state(&suspended, &observed, &Settings::default(), &now())
            .unwrap()
            .status;
        assert_eq!(status.phase, Some(Phase::Running), "the phase names stay");
        assert_eq!(holds(&status), ["Suspended"]);
    }

    #[test]
    fn a_run_stalled_on_a_bad_spec_works_again_once_it_is_fixed() {
        let mut stalled = run();
        let mut failed = Vec::new();
        for type_ in [ConditionType::Failed, ConditionType::Stalled] {
            set_condition(
                &mut failed,
                type_,
                true,
                Reason::InvalidSpec,
                "bad",
                Some(1),
                &now(),
            );
        }
        stalled.metadata.generation = Some(2);
        stalled.status = Some(TrajectoryRunStatus {
            phase: Some(Phase::Failed),
            completion_time: Some(now()),
            conditions: failed,
            ..TrajectoryRunStatus::default()
        });
        let status = desired_state(&stalled, &Observed::default(), &Settings::default(), &now())
            .unwrap()
            .status;
        assert_eq!(status.phase, Some(Phase::Planning));
        assert_eq!(status.completion_time, None);
        let failed = status.conditions.iter().find(|c| c.type_ == "Failed");
        assert_eq!(failed.map(|c| c.status.as_str()), Some("False"));
        let stalled = status.conditions.iter().find(|c| c.type_ == "Stalled");
        assert_eq!(stalled.map(|c| c.status.as_str()), Some("False"));
    }
}
