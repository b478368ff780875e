//! Status: the vocabulary of a run's status and how it is computed, all pure.
//!
//! - [`Reason`]: every condition reason, `PascalCase`.
//! - [`Outcome`] and [`Tally`]: what a run's status can say (decide produces them).
//! - [`desired`]: the status an outcome shows, through one named condition set per outcome
//!   ([`working`], [`succeeded`], [`failed`]) and [`stalled`] for a run that cannot proceed.
//! - [`transition_event`]: the Event that announces a phase change.
//! - [`status_write`]: when to write (a change of progress alone at most once per interval).
//!
//! Conditions keep their `lastTransitionTime` while their status holds ([`set_condition`]).

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::runtime::events::{Event, EventType};

use trajectory_worker::contract::LandlockStatus;

use crate::api::{
    BatchCounts, BuildStatus, ConditionType, CostStatus, ImageStatus, OutputStatus, Phase,
    PromptCounts, PullStatus, SandboxStatus, TrajectoryRun, TrajectoryRunStatus, UnavailableImage,
    VerificationStatus,
};

/// Condition reasons (`PascalCase`, as Kubernetes conventions ask).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Pending,
    Planning,
    Generating,
    Merging,
    Suspended,
    Resumed,
    Succeeded,
    InvalidSpec,
    InvalidDataset,
    TooManyFailedBatches,
    /// A worker exited with the "permanent configuration error" code and did not say why (the
    /// reasons below are what it says when it does).
    WorkerConfigError,
    MergeFailed,
    PlanFailed,
    /// The model server refused the key (401, 403) or the account (402, no quota left).
    ModelUnauthorized,
    /// The model or its path does not exist on the server (404, an unknown model name).
    ModelNotFound,
    /// The storage volume is mounted read-only.
    StorageReadOnly,
    /// The pods' user may not write the output directory.
    StoragePermissionDenied,
    /// The storage volume is not mounted where the plan says.
    StorageMissing,
    /// The output directory holds a run of another dataset or spec.
    OutputMismatch,
    /// The run spent `spec.model.budget`: it is held (`Suspended`) until the budget is raised.
    BudgetExhausted,
    /// Kueue admitted the run's Jobs (condition `Admitted`).
    Admitted,
    /// A Job waits in its Kueue queue (for quota, or for its Workload).
    Queued,
    /// A Job was preempted by a workload of higher priority and waits to be admitted again.
    Preempted,
    /// A Job was evicted by Kueue for another reason (the message names it).
    Evicted,
    /// A Job's Workload is deactivated: by the run while it is stopped, or by someone else.
    Deactivated,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Planning => "Planning",
            Self::Generating => "Generating",
            Self::Merging => "Merging",
            Self::Suspended => "Suspended",
            Self::Resumed => "Resumed",
            Self::Succeeded => "Succeeded",
            Self::InvalidSpec => "InvalidSpec",
            Self::InvalidDataset => "InvalidDataset",
            Self::TooManyFailedBatches => "TooManyFailedBatches",
            Self::WorkerConfigError => "WorkerConfigError",
            Self::MergeFailed => "MergeFailed",
            Self::PlanFailed => "PlanFailed",
            Self::ModelUnauthorized => "ModelUnauthorized",
            Self::ModelNotFound => "ModelNotFound",
            Self::StorageReadOnly => "StorageReadOnly",
            Self::StoragePermissionDenied => "StoragePermissionDenied",
            Self::StorageMissing => "StorageMissing",
            Self::OutputMismatch => "OutputMismatch",
            Self::BudgetExhausted => "BudgetExhausted",
            Self::Admitted => "Admitted",
            Self::Queued => "Queued",
            Self::Preempted => "Preempted",
            Self::Evicted => "Evicted",
            Self::Deactivated => "Deactivated",
        }
    }

    /// The run's reason for a worker that stopped on a configuration error and said why, when the
    /// reason is one a run can fail with; `None` for any other (the caller's generic reason stands).
    pub fn of_worker(reason: &str) -> Option<Self> {
        [
            Self::ModelUnauthorized,
            Self::ModelNotFound,
            Self::StorageReadOnly,
            Self::StoragePermissionDenied,
            Self::StorageMissing,
            Self::OutputMismatch,
            Self::InvalidDataset,
            Self::InvalidSpec,
        ]
        .into_iter()
        .find(|known| known.as_str() == reason)
    }

    /// The `Progressing` reason of a run working in `phase`.
    fn working_in(phase: Phase) -> Self {
        match phase {
            Phase::Planning => Self::Planning,
            Phase::Merging => Self::Merging,
            _ => Self::Generating,
        }
    }
}

/// Where the run stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Work is under way in this phase (planning, running or merging); the message says what.
    Working(Phase, String),
    Succeeded(String),
    Failed(Reason, String),
}

/// What this reconcile learned of the run's counts; `None` keeps what the status shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    pub batches: Option<BatchCounts>,
    /// `done/total`, the Progress printer column.
    pub progress: Option<String>,
    /// Valid and invalid prompts, from the plan.
    pub planned: Option<Planned>,
    /// The generation attempt in progress.
    pub attempt: Option<u32>,
    /// The merge's counts and output.
    pub merged: Option<Merged>,
    /// Whether Landlock confined the commands (see [`crate::api::SandboxStatus`]).
    pub landlock: Option<LandlockStatus>,
    /// The rows' images, when they name any.
    pub images: Option<ImageTally>,
    /// Why the run is held at its budget, while it is (see `decide::hold_at_budget`).
    pub budget_exhausted: Option<String>,
    /// What the run spent so far and will at this rate, while its batches run.
    pub cost: Option<CostStatus>,
    /// Where a queued run's Jobs stand in Kueue (the `Admitted` condition); `None` keeps it.
    pub admission: Option<AdmissionTally>,
}

/// What a queued run's `Admitted` condition says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionTally {
    pub admitted: bool,
    pub reason: Reason,
    pub message: String,
}

impl AdmissionTally {
    /// Not admitted, for `reason`.
    pub fn waiting(reason: Reason, message: String) -> Self {
        Self {
            admitted: false,
            reason,
            message,
        }
    }
}

/// The rows' images as the generation stage found them (see [`crate::api::ImageStatus`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ImageTally {
    pub total: u32,
    pub pulled: u32,
    pub unavailable_count: u32,
    /// The first unavailable images with why, by image.
    pub unavailable: Vec<(String, String)>,
    /// How the builds went, for a run that built images.
    pub builds: Option<BuildStatus>,
    /// What the pods of the recorded batches waited for their images.
    pub pulls: Option<PullStatus>,
}

/// Prompt counts of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    pub total: u64,
    pub invalid: u64,
    /// The round of the plan.
    pub round: u32,
}

/// What the merge wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Merged {
    pub succeeded: u64,
    pub discarded: u64,
    pub failed: u64,
    /// What the rows' verifiers found, when any record was verified.
    pub verification: Option<VerificationStatus>,
    /// What the kept records' model calls cost, when any was priced or reported.
    pub cost: Option<CostStatus>,
    pub output: OutputStatus,
}

/// One condition to set: type, status, reason, message.
pub type ConditionSet<'a> = Vec<(ConditionType, bool, Reason, &'a str)>;

/// A run working in `phase`. kstatus: `Reconciling` (in progress) while work is under way, like a
/// running Job; while suspended `Reconciling` is false but so is `Ready`, which kstatus also reads
/// as in progress: a Flux health check waits on a suspended run until it resumes and finishes
/// (examples/gitops/README.md says how to read it as current instead). A run that failed before
/// (a bad spec, since fixed) no longer has.
pub fn working<'a>(
    phase: Phase,
    message: &'a str,
    suspended: Option<(Reason, &'a str)>,
    had_failed: bool,
) -> ConditionSet<'a> {
    let reason = Reason::working_in(phase);
    let working = suspended.is_none();
    let (reconciling_reason, reconciling_message) = suspended.unwrap_or((reason, message));
    let mut set = vec![
        (ConditionType::Progressing, working, reason, message),
        (
            ConditionType::Reconciling,
            working,
            reconciling_reason,
            reconciling_message,
        ),
        (ConditionType::Ready, false, reason, message),
        (ConditionType::Stalled, false, reason, message),
    ];
    if had_failed {
        set.push((ConditionType::Failed, false, reason, message));
    }
    set
}

/// A run whose output is complete: Ready and Succeeded.
pub fn succeeded(message: &str) -> ConditionSet<'_> {
    let reason = Reason::Succeeded;
    vec![
        (ConditionType::Progressing, false, reason, message),
        (ConditionType::Reconciling, false, reason, message),
        (ConditionType::Succeeded, true, reason, message),
        (ConditionType::Ready, true, reason, message),
        (ConditionType::Stalled, false, reason, message),
    ]
}

/// A run that failed for `reason`: Failed and Stalled.
pub fn failed(reason: Reason, message: &str) -> ConditionSet<'_> {
    vec![
        (ConditionType::Progressing, false, reason, message),
        (ConditionType::Reconciling, false, reason, message),
        (ConditionType::Failed, true, reason, message),
        (ConditionType::Ready, false, reason, message),
        (ConditionType::Stalled, true, reason, message),
    ]
}

/// The status a run shows at `outcome` with the counts of `tally`, over its current one.
pub fn desired(
    run: &TrajectoryRun,
    outcome: &Outcome,
    tally: &Tally,
    now: &Time,
) -> TrajectoryRunStatus {
    let generation = run.metadata.generation;
    // The user's suspension first: it holds whatever the budget does.
    let suspended = if run.spec.run.suspend {
        Some((Reason::Suspended, "spec.suspend is set"))
    } else {
        tally
            .budget_exhausted
            .as_deref()
            .map(|message| (Reason::BudgetExhausted, message))
    };
    let mut status = run.status.clone().unwrap_or_default();
    status.observed_generation = generation;
    if status.start_time.is_none() {
        status.start_time = Some(now.clone());
    }
    let mut conditions = std::mem::take(&mut status.conditions);
    let had_failed = conditions
        .iter()
        .any(|c| c.type_ == ConditionType::Failed.as_str());
    let (suspend_reason, suspend_message) = suspended.unwrap_or((Reason::Resumed, "running"));
    let mut set = vec![(
        ConditionType::Suspended,
        suspended.is_some(),
        suspend_reason,
        suspend_message,
    )];
    record_tally(&mut status, tally);
    if let Some(admission) = &tally.admission {
        set.push((
            ConditionType::Admitted,
            admission.admitted,
            admission.reason,
            &admission.message,
        ));
    }
    match outcome {
        Outcome::Working(phase, message) => {
            status.phase = Some(*phase);
            // A run stalled on a bad spec works again once the spec is fixed.
            status.completion_time = None;
            set.extend(working(*phase, message, suspended, had_failed));
        }
        Outcome::Succeeded(message) => {
            status.phase = Some(Phase::Succeeded);
            status.completion_time.get_or_insert_with(|| now.clone());
            set.extend(succeeded(message));
        }
        Outcome::Failed(reason, message) => {
            status.phase = Some(Phase::Failed);
            status.completion_time.get_or_insert_with(|| now.clone());
            set.extend(failed(*reason, message));
        }
    }
    set_conditions(&mut conditions, &set, generation, now);
    status.conditions = conditions;
    status
}

/// The counts of `tally` over the status; what it did not learn stays as recorded.
fn record_tally(status: &mut TrajectoryRunStatus, tally: &Tally) {
    if let Some(batches) = &tally.batches {
        status.batches = Some(batches.clone());
    }
    if let Some(progress) = &tally.progress {
        status.progress = Some(progress.clone());
    }
    if let Some(planned) = tally.planned {
        let prompts = status.prompts.get_or_insert_with(PromptCounts::default);
        prompts.total = planned.total;
        prompts.invalid = planned.invalid;
        // The first round's stays implicit: statuses written before rounds were recorded read the
        // same.
        status.plan_round = (planned.round > 1).then_some(planned.round);
    }
    if let Some(attempt) = tally.attempt {
        status.attempt = Some(attempt);
    }
    if let Some(images) = &tally.images {
        status.images = Some(ImageStatus {
            total: images.total,
            pulled: images.pulled,
            unavailable: images.unavailable_count,
            unavailable_images: images
                .unavailable
                .iter()
                .map(|(image, message)| UnavailableImage {
                    image: image.clone(),
                    message: message.clone(),
                })
                .collect(),
            builds: images.builds.clone(),
            pulls: images.pulls.clone(),
        });
    }
    if let Some(cost) = &tally.cost {
        status.cost = Some(cost.clone());
    }
    if let Some(landlock) = tally.landlock {
        status.sandbox = Some(SandboxStatus {
            landlock: landlock_status_name(landlock).to_owned(),
        });
    }
    if let Some(merged) = &tally.merged {
        let prompts = status.prompts.get_or_insert_with(PromptCounts::default);
        prompts.succeeded = merged.succeeded;
        prompts.discarded = merged.discarded;
        prompts.failed = merged.failed;
        status.output = Some(merged.output.clone());
        status.verification.clone_from(&merged.verification);
        status.cost.clone_from(&merged.cost);
    }
}

/// The status of a run that cannot proceed until it changes (a spec the operator cannot build
/// children from, or children the API server refuses): `Stalled` and `Failed` with reason
/// `InvalidSpec` and `message`, over what the status showed.
pub fn stalled(run: &TrajectoryRun, message: &str, now: &Time) -> TrajectoryRunStatus {
    let mut status = run.status.clone().unwrap_or_default();
    let generation = run.metadata.generation;
    status.observed_generation = generation;
    status.phase = Some(Phase::Failed);
    let reason = Reason::InvalidSpec;
    let set = [
        (ConditionType::Stalled, true, reason, message),
        (ConditionType::Failed, true, reason, message),
        (ConditionType::Progressing, false, reason, message),
        (ConditionType::Reconciling, false, reason, message),
        (ConditionType::Ready, false, reason, message),
    ];
    set_conditions(&mut status.conditions, &set, generation, now);
    status
}

fn set_conditions(
    conditions: &mut Vec<Condition>,
    set: &[(ConditionType, bool, Reason, &str)],
    generation: Option<i64>,
    now: &Time,
) {
    for &(type_, value, reason, message) in set {
        set_condition(conditions, type_, value, reason, message, generation, now);
    }
}

/// Sets a condition. `lastTransitionTime` changes only when the status flips; reason, message and
/// `observedGeneration` are updated in place. Returns true when anything changed.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: ConditionType,
    status: bool,
    reason: Reason,
    message: &str,
    generation: Option<i64>,
    now: &Time,
) -> bool {
    let status = if status { "True" } else { "False" };
    let wanted = Condition {
        type_: type_.as_str().to_owned(),
        status: status.to_owned(),
        reason: reason.as_str().to_owned(),
        message: message.to_owned(),
        observed_generation: generation,
        last_transition_time: now.clone(),
    };
    match conditions.iter_mut().find(|c| c.type_ == wanted.type_) {
        None => {
            conditions.push(wanted);
            true
        }
        Some(existing) => {
            let transition_time = if existing.status == wanted.status {
                existing.last_transition_time.clone()
            } else {
                wanted.last_transition_time.clone()
            };
            let updated = Condition {
                last_transition_time: transition_time,
                ..wanted
            };
            let changed = *existing != updated;
            *existing = updated;
            changed
        }
    }
}

/// Events cap notes at 1 kB.
const EVENT_NOTE_CHARS: usize = 1000;

/// The Event announcing that the run's phase changed from `before` to the phase of `status`, or
/// `None` when it did not. A failure is a Warning whose note is the `Failed` condition's message;
/// any other phase is Normal with the `Progressing` message.
pub fn transition_event(before: Option<Phase>, status: &TrajectoryRunStatus) -> Option<Event> {
    let phase = status.phase.filter(|phase| Some(*phase) != before)?;
    let note = status
        .conditions
        .iter()
        .find(|c| c.type_ == ConditionType::Failed.as_str() && c.status == "True")
        .or_else(|| {
            status
                .conditions
                .iter()
                .find(|c| c.type_ == ConditionType::Progressing.as_str())
        })
        .map(|c| c.message.chars().take(EVENT_NOTE_CHARS).collect());
    Some(Event {
        type_: if phase == Phase::Failed {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: phase.as_str().to_owned(),
        note,
        action: "Reconcile".to_owned(),
        secondary: None,
    })
}

fn landlock_status_name(landlock: LandlockStatus) -> &'static str {
    match landlock {
        LandlockStatus::Enforced => "Enforced",
        LandlockStatus::NotEnforced => "NotEnforced",
        LandlockStatus::Off => "Off",
    }
}

/// The Warning announcing that the run's commands are not confined by Landlock, when `status`
/// first shows it (`before` is the status the run had).
pub fn sandbox_event(
    before: Option<&TrajectoryRunStatus>,
    status: &TrajectoryRunStatus,
) -> Option<Event> {
    let shown = |status: Option<&TrajectoryRunStatus>| {
        status
            .and_then(|status| status.sandbox.as_ref())
            .map(|sandbox| sandbox.landlock.clone())
    };
    let landlock = shown(Some(status)).filter(|now| Some(now) != shown(before).as_ref())?;
    let note = match landlock.as_str() {
        "NotEnforced" => {
            "Landlock is not enforced where the generation pods run (the node's kernel or the \
             container runtime's seccomp profile): the model's commands are confined by the \
             sandbox container, dropped capabilities and the reaper only, and conversations of \
             a pod can reach each other's workspaces. Set spec.sandbox.landlock: required to \
             refuse to run so."
        }
        "Off" => "spec.sandbox.landlock is off: the model's commands are not confined by Landlock.",
        _ => return None,
    };
    Some(Event {
        type_: EventType::Warning,
        reason: format!("Landlock{landlock}"),
        note: Some(note.to_owned()),
        action: "Reconcile".to_owned(),
        secondary: None,
    })
}

/// The Warning naming the images that could not be pulled, when `status` first lists them
/// (`before` is the status the run had): once each.
pub fn image_event(
    before: Option<&TrajectoryRunStatus>,
    status: &TrajectoryRunStatus,
) -> Option<Event> {
    let listed = |status: Option<&TrajectoryRunStatus>| -> Vec<UnavailableImage> {
        status
            .and_then(|status| status.images.as_ref())
            .map(|images| images.unavailable_images.clone())
            .unwrap_or_default()
    };
    let known = listed(before);
    let new: Vec<String> = listed(Some(status))
        .into_iter()
        .filter(|image| !known.iter().any(|known| known.image == image.image))
        .map(|image| format!("{}: {}", image.image, image.message))
        .collect();
    if new.is_empty() {
        return None;
    }
    Some(Event {
        type_: EventType::Warning,
        reason: "ImageUnavailable".to_owned(),
        note: Some(truncate_note(&format!(
            "could not pull {}; their rows are recorded failed (image_unavailable)",
            new.join("; ")
        ))),
        action: "Reconcile".to_owned(),
        secondary: None,
    })
}

/// Kubernetes refuses an Event note over 1 KiB.
fn truncate_note(note: &str) -> String {
    const NOTE_LIMIT: usize = 1024;
    if note.len() <= NOTE_LIMIT {
        return note.to_owned();
    }
    let mut end = NOTE_LIMIT - 3;
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &note[..end])
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

/// The status with everything that moves as batches finish blanked out: the batch counts and
/// the progress column, the images pulled (an image counts once its first batch is done: with
/// thousands of images, written at once it was a status write an image), the money spent so far
/// and its projection, and the conditions' messages that repeat them.
fn without_progress(status: &TrajectoryRunStatus) -> TrajectoryRunStatus {
    let mut status = status.clone();
    status.batches = None;
    status.progress = None;
    if let Some(images) = &mut status.images {
        images.pulled = 0;
        images.pulls = None;
    }
    if let Some(cost) = &mut status.cost {
        cost.spent.clear();
        cost.projected = None;
    }
    for condition in &mut status.conditions {
        condition.message.clear();
    }
    status
}

#[cfg(test)]
mod tests {
    use k8s_openapi::jiff::Timestamp;

    use super::*;

    #[test]
    fn landlock_not_enforced_is_shown_in_the_status_and_announced_once_by_a_warning() {
        let run = TrajectoryRun::test().build();
        let now = Time(Timestamp::now());
        let working = Outcome::Working(Phase::Running, "generating".to_owned());
        let tally = |landlock| Tally {
            landlock,
            ..Tally::default()
        };
        let shown = desired(
            &run,
            &working,
            &tally(Some(LandlockStatus::NotEnforced)),
            &now,
        );
        assert_eq!(shown.sandbox.as_ref().unwrap().landlock, "NotEnforced");
        let event = sandbox_event(run.status.as_ref(), &shown).expect("a Warning");
        assert_eq!(event.type_, EventType::Warning);
        assert_eq!(event.reason, "LandlockNotEnforced");
        assert!(
            event
                .note
                .unwrap()
                .contains("spec.sandbox.landlock: required")
        );

        // Later reconciles read no pod for it and keep what the status shows, without a new Event.
        let mut later_run = run.clone();
        later_run.status = Some(shown.clone());
        let later = desired(&later_run, &working, &tally(None), &now);
        assert_eq!(later.sandbox, shown.sandbox);
        assert!(sandbox_event(Some(&shown), &later).is_none());

        // Confined commands are shown, and need no Event.
        let confined = desired(&run, &working, &tally(Some(LandlockStatus::Enforced)), &now);
        assert_eq!(confined.sandbox.as_ref().unwrap().landlock, "Enforced");
        assert!(sandbox_event(None, &confined).is_none());
    }

    #[test]
    fn conditions_keep_their_transition_time_while_the_status_holds() {
        let t0 = Time(Timestamp::from_second(1_000).unwrap());
        let t1 = Time(Timestamp::from_second(2_000).unwrap());
        let t2 = Time(Timestamp::from_second(3_000).unwrap());
        let mut conditions = Vec::new();
        let progressing = ConditionType::Progressing;

        assert!(set_condition(
            &mut conditions,
            progressing,
            true,
            Reason::Planning,
            "planning",
            Some(1),
            &t0
        ));
        assert_eq!(conditions[0].last_transition_time, t0);

        // Same status, new reason: updated in place, transition time kept.
        assert!(set_condition(
            &mut conditions,
            progressing,
            true,
            Reason::Generating,
            "2/10 batches",
            Some(1),
            &t1
        ));
        assert_eq!(conditions[0].last_transition_time, t0);
        assert_eq!(conditions[0].reason, "Generating");

        // Nothing new: no change reported, so no status write.
        assert!(!set_condition(
            &mut conditions,
            progressing,
            true,
            Reason::Generating,
            "2/10 batches",
            Some(1),
            &t2
        ));

        // The status flips: the transition time moves.
        assert!(set_condition(
            &mut conditions,
            progressing,
            false,
            Reason::Succeeded,
            "done",
            Some(2),
            &t2
        ));
        assert_eq!(conditions[0].last_transition_time, t2);
        assert_eq!(conditions[0].status, "False");
        assert_eq!(conditions[0].observed_generation, Some(2));

        // Another type is a separate entry.
        assert!(set_condition(
            &mut conditions,
            ConditionType::Succeeded,
            true,
            Reason::Succeeded,
            "done",
            Some(2),
            &t2
        ));
        let types: Vec<_> = conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["Progressing", "Succeeded"]);
    }
}
