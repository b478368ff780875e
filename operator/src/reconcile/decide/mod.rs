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
//!                  ▲                                                              │ IncompleteBatch
//!                  └─────────────── next round: plan-2 ─► gen-4 … ─► merge-2 ◄────┘
//! ```
//!
//! A new attempt runs only the batches no attempt finished, up to [`ATTEMPTS_PER_ROUND`]; after
//! that the run merges what is done (the merge reports the missing batches) as long as no more
//! than `retry.maxFailedBatches` are missing. A merge that finds batches marked done without all
//! their records clears their markers and fails with `IncompleteBatch`; the run then starts its
//! next round (up to [`MAX_ROUNDS`]), whose plan finds just those batches pending, so that
//! `Succeeded` always means every (prompt, sample) has its record.

use std::collections::BTreeSet;

use trajectory_worker::contract::{
    ImageGroup, MAX_JOB_COMPLETIONS, MergeSummary, PlanSummary, TaskResources, WorkerFailure,
    compact_ranges, format_ranges, groups_of_pages, parse_ranges, usd_text,
};

use self::admission::Admissions;
use self::builds::Built;
use self::images::Work;

use super::children::{
    ATTEMPTS_PER_ROUND, Component, MAX_NAME_LENGTH, MAX_ROUNDS, first_attempt_of,
};
use super::observe::{JobState, Observed, ObservedAttempt};
use super::status::{Merged, Outcome, Planned, Reason, Tally};
use super::validate::ValidatedRun;
use crate::api::{
    BatchCounts, CostStatus, OutputStatus, PendingListStatus, Phase, TrajectoryRunStatus,
    VerificationStatus,
};

pub mod admission;
pub mod builds;
pub mod images;
mod prefetch;
mod pulls;

/// What the run should have now, before it is built into objects.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The children to apply (none once the run is finished).
    pub children: Vec<Child>,
    /// Jobs to delete, by name, with their pods and plan `ConfigMap`s: finished Jobs of rows
    /// naming an image whose batches the status records, and Jobs whose pods cannot pull their
    /// image (a Job recording the rows unavailable replaces them).
    pub delete: Vec<String>,
    /// Write the status now even if only progress changed: half a window's worth of finished
    /// Jobs of rows naming an image waits for it to record their batches before they go.
    pub record_now: bool,
    pub outcome: Outcome,
    pub tally: Tally,
    /// For a run that names a Kueue queue: its Workloads to stop or start.
    pub admissions: Admissions,
}

impl Decision {
    /// A run whose spec breaks its own rules: it fails with reason `InvalidSpec`, and has no
    /// children.
    pub fn refused(message: String) -> Self {
        Self {
            children: Vec::new(),
            delete: Vec::new(),
            record_now: false,
            outcome: Outcome::Failed(Reason::InvalidSpec, message),
            tally: Tally::default(),
            admissions: Admissions::default(),
        }
    }
}

/// A child Job the run should have; a Job that does not exist yet comes with its plan `ConfigMap`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Child {
    Plan {
        round: u32,
        exists: bool,
    },
    /// The operator's copy of the image groups of the round's plan.
    ImageIndex {
        round: u32,
        groups: Vec<ImageGroup>,
    },
    /// The Job reporting the `pages` pages of the plan's image index `index`.
    ImagePages {
        round: u32,
        index: String,
        pages: u32,
        exists: bool,
    },
    /// The Job building the images of the round's plan's build list: `builds` lines.
    Build {
        round: u32,
        builds: u32,
        exists: bool,
    },
    Generation(Shard),
    /// The Job pulling the image of the round's piece `shard` ahead of that piece's Job.
    Prefetch {
        round: u32,
        shard: u32,
        image: String,
        exists: bool,
    },
    Merge {
        round: u32,
        exists: bool,
    },
}

/// Where a generation Job's conversations run their commands.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Tasks {
    /// The pod's sandbox container, in the run's image: rows naming no image.
    #[default]
    Sandbox,
    /// A task container of this image (as the rows name it) for each conversation of a batch.
    Image(String),
    /// The rows' image could not be pulled (why, as the node said), or (`build_failed`) built:
    /// the pod records each of their conversations failed, `image_unavailable` (or
    /// `image_build_failed`).
    Unavailable {
        image: String,
        why: String,
        build_failed: bool,
    },
}

/// One generation Job of an attempt: an attempt of more than [`MAX_JOB_COMPLETIONS`] batches runs
/// as several, each working its slice of the pending batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    pub attempt: u32,
    /// 0 for the first Job of the attempt.
    pub shard: u32,
    pub pending: Pending,
    pub exists: bool,
    /// Its share of the run's `workers`: split over the attempt's unfinished Jobs, so that the run
    /// has `workers` pods at once however many Jobs it takes.
    pub parallelism: u32,
    pub tasks: Tasks,
    /// Suspended at the run's budget: its pods are stopped and it starts no more until the budget
    /// is raised.
    pub held: bool,
    /// The node its pods prefer: the one that pulled its image ahead (`spec.sandbox.prefetch`).
    pub prefer_node: Option<String>,
    /// What its rows' tasks ask of each task container (Harbor's `cpus`, `memory_mb`,
    /// `storage_mb`): their limits.
    pub task_resources: Option<TaskResources>,
}

impl Shard {
    pub fn component(&self) -> Component {
        Component::Generate {
            attempt: self.attempt,
            shard: self.shard,
        }
    }

    /// Its Job's name: the component's, with a suffix for a Job recording unavailable rows.
    pub fn job_name(&self, run: &ValidatedRun<'_>) -> String {
        let name = run.child_name(self.component());
        match self.tasks {
            Tasks::Unavailable { .. } => super::children::unavailable_job_name(&name),
            Tasks::Sandbox | Tasks::Image(_) => name,
        }
    }
}

/// The batches a generation attempt works, in index order (index *i* works `ids[i]`): batch ids,
/// or, when the plan wrote its pending list to storage, slots of that list (see [`IdSpace`]).
/// Never empty, so that no Job without completions is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    ids: Vec<u32>,
    /// The plan's pending list on storage the ids are slots of.
    list: Option<String>,
}

impl Pending {
    /// Batch ids; `None` for an empty list.
    pub fn new(batches: Vec<u32>) -> Option<Self> {
        Self::of(batches, None)
    }

    /// Batch ids, or slots of `list` when given; `None` for an empty list.
    pub fn of(ids: Vec<u32>, list: Option<String>) -> Option<Self> {
        (!ids.is_empty()).then_some(Self { ids, list })
    }

    /// What index *i* works: a batch id, or a slot of [`Pending::list`].
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The plan's pending list on storage that [`Pending::ids`] are slots of.
    pub fn list(&self) -> Option<&str> {
        self.list.as_deref()
    }

    /// The number of batches (the Job's completions).
    pub fn count(&self) -> u32 {
        u32::try_from(self.ids.len()).unwrap_or(u32::MAX)
    }

    /// The list cut into slices of at most [`MAX_JOB_COMPLETIONS`], one a Job.
    pub fn shards(&self) -> Vec<Pending> {
        let size = usize::try_from(MAX_JOB_COMPLETIONS).unwrap_or(usize::MAX);
        self.ids
            .chunks(size)
            .map(|chunk| Self {
                ids: chunk.to_vec(),
                list: self.list.clone(),
            })
            .collect()
    }

    /// True when index *i* works id *i*: the plan `ConfigMap` then needs no list.
    pub fn is_identity(&self) -> bool {
        self.ids.iter().copied().eq(0..self.count())
    }
}

/// What the ids of a run's attempts are. Batch ids while the plan's summary lists every batch
/// done before; when the done batches were too scattered to list (a resume of a million batches
/// with 40 % done at random has some 240,000 gaps), the plan wrote the pending batches to a list on
/// storage, and the ids are slots of that list: the operator then knows how many batches are
/// pending, not which, and the pods look their batches up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdSpace<'a> {
    Batches {
        total: u32,
    },
    Slots {
        list: &'a str,
        slots: u32,
        /// Batches done before the plan (not in the list).
        done_before: u32,
    },
}

impl<'a> IdSpace<'a> {
    pub fn of(plan: &'a PlanSummary) -> Self {
        match &plan.pending_list {
            Some(list) => Self::Slots {
                list,
                slots: plan.pending_count(),
                done_before: plan.done_count,
            },
            None => Self::Batches {
                total: plan.batches,
            },
        }
    }

    /// The ids done before any attempt: the plan's done batches (no slot is: the list holds the
    /// batches the plan found not done).
    fn done_by_the_plan(self, plan: &PlanSummary) -> BTreeSet<u32> {
        match self {
            Self::Batches { .. } => plan
                .done
                .iter()
                .flat_map(|range| range.first..=range.last)
                .collect(),
            Self::Slots { .. } => BTreeSet::new(),
        }
    }

    /// Batches done, from the ids done.
    fn done_count(self, done: &BTreeSet<u32>) -> u32 {
        let done = u32::try_from(done.len()).unwrap_or(u32::MAX);
        match self {
            Self::Batches { .. } => done,
            Self::Slots { done_before, .. } => done_before.saturating_add(done),
        }
    }

    /// The ids not done, in order: what the next attempt works.
    fn pending(self, done: &BTreeSet<u32>) -> Option<Pending> {
        match self {
            Self::Batches { total } => Pending::new(pending_batches(total, done)),
            Self::Slots { list, slots, .. } => {
                Pending::of(pending_batches(slots, done), Some(list.to_owned()))
            }
        }
    }
}

/// The decision: plan, then generation attempts, then merge.
pub fn decide(run: &ValidatedRun<'_>, observed: &Observed) -> Decision {
    let mut work = Work::default();
    let mut tally = Tally {
        landlock: observed.landlock,
        ..Tally::default()
    };
    let outcome = stages(run, observed, &mut tally, &mut work);
    let admissions = admission::decide(run, observed, &work.children);
    tally.admission.clone_from(&admissions.tally);
    Decision {
        children: work.children,
        delete: work.delete,
        record_now: work.record_now,
        outcome,
        tally,
        admissions,
    }
}

/// Each stage either decides the outcome or hands the run on to the next.
fn stages(
    run: &ValidatedRun<'_>,
    observed: &Observed,
    tally: &mut Tally,
    work: &mut Work,
) -> Outcome {
    if let Some(outcome) = plan(observed, &mut work.children) {
        return outcome;
    }
    let Some(plan) = plan_summary(run, observed) else {
        if !observed.plan_pod_gone {
            return Outcome::Failed(
                Reason::PlanFailed,
                "the plan Job completed without a summary in its termination message".into(),
            );
        }
        // The plan pod went (its node with it) before its summary was recorded, and the status
        // holds no plan of this round: planning again (it only reads storage) is the way to know
        // the round's batches; an earlier round's would skip those its merge reopened.
        work.delete.extend(
            observed
                .plan_job
                .as_ref()
                .and_then(|job| job.metadata.name.clone()),
        );
        let message = format!(
            "round {}: the plan pod is gone and its summary was not recorded: planning again",
            observed.round
        );
        return Outcome::Working(Phase::Planning, message);
    };
    let generated = match image_groups(observed, &plan, work) {
        Groups::None => generate(run, observed, &plan, tally, &mut work.children),
        Groups::Read(groups) => {
            // Kept by the operator: the plan pod that reported them may be gone by the time
            // the last image's turn comes; kept again once the builds resolved them.
            let keep = |groups: &Vec<ImageGroup>, work: &mut Work| {
                work.children.push(Child::ImageIndex {
                    round: observed.round,
                    groups: groups.clone(),
                });
            };
            match builds::resolve(observed, groups, work) {
                Built::Building { groups, outcome } => {
                    if observed.image_index.is_none() {
                        keep(&groups, work);
                    }
                    Some(outcome)
                }
                Built::Ready { groups, resolved } => {
                    if observed.image_index.is_none() || resolved {
                        keep(&groups, work);
                    }
                    images::generate(run, observed, &plan, &groups, tally, work)
                }
            }
        }
        Groups::Unread(outcome) => Some(outcome),
    };
    if let Some(outcome) = generated {
        if matches!(outcome, Outcome::Working(Phase::Running, _)) {
            tally.cost = running_cost(run, observed, tally);
            hold_at_budget(run, observed, tally, work);
        }
        return outcome;
    }
    merge(run, observed, tally, &mut work.children)
}

/// What the run spent so far (the most its batch pods reported, never less than the status
/// showed) and, once some batch is done, what it will have spent at that rate.
fn running_cost(run: &ValidatedRun<'_>, observed: &Observed, tally: &Tally) -> Option<CostStatus> {
    let shown = run
        .status()
        .and_then(|status| status.cost.as_ref())
        .and_then(|cost| cost.spent.parse::<f64>().ok());
    let spent = match (observed.run_spent, shown) {
        (Some(reported), Some(shown)) => reported.max(shown),
        (reported, shown) => reported.or(shown)?,
    };
    let projected = tally
        .batches
        .as_ref()
        .filter(|batches| batches.completed_count > 0)
        .map(|batches| {
            usd_text(spent * f64::from(batches.total) / f64::from(batches.completed_count))
        });
    Some(CostStatus {
        spent: usd_text(spent),
        projected,
        currency: "USD".to_owned(),
        exhausted_budget: None,
    })
}

/// Holds the generation Jobs (suspended) while a pod of the latest attempt found the run's budget
/// spent and the budget was not raised since: at the budget no new conversation starts, and the
/// pods that find it so stop (their batches count as neither done nor failed). Raising
/// `maxCost` lets the Jobs run on, with the new budget in their plan.
fn hold_at_budget(run: &ValidatedRun<'_>, observed: &Observed, tally: &mut Tally, work: &mut Work) {
    // The pods that found the budget spent are gone soon after their Job is suspended: the
    // status keeps what they said, or the Job would start pods again only for them to stop.
    let shown = run
        .status()
        .and_then(|status| status.cost.as_ref())
        .and_then(|cost| cost.exhausted_budget.as_deref())
        .and_then(|budget| budget.parse::<f64>().ok());
    let exhausted_at = match (observed.budget_exhausted_at, shown) {
        (Some(reported), Some(shown)) => Some(reported.max(shown)),
        (reported, shown) => reported.or(shown),
    };
    let (Some(budget), Some(exhausted_at)) = (&run.spec.model.budget, exhausted_at) else {
        return;
    };
    // Budgets are compared as written (USD amounts, not sums of them).
    if budget.max_cost > exhausted_at {
        return;
    }
    if let Some(cost) = &mut tally.cost {
        cost.exhausted_budget = Some(usd_text(exhausted_at));
    }
    for child in &mut work.children {
        if let Child::Generation(shard) = child {
            shard.held = true;
        }
    }
    tally.budget_exhausted = Some(format!(
        "the run spent its budget of {} USD (spec.model.budget.maxCost): no conversation starts \
         and its batch pods are stopped; raise maxCost to finish the run (what is done stays done)",
        budget.max_cost
    ));
}

/// The image groups of the round's plan, as far as the operator has them.
enum Groups {
    /// No row names an image.
    None,
    Read(Vec<ImageGroup>),
    /// They cannot be had (yet): what the run does meanwhile.
    Unread(Outcome),
}

/// The most bytes of image groups the operator keeps in its `ConfigMap` (the API server refuses
/// one of more than 1 MiB).
const MAX_IMAGE_INDEX_BYTES: usize = 900 * 1024;

/// The groups from the operator's own copy, or from the plan's summary when it lists them all, or
/// from the pages of the plan's image index, which a Job of the round reports when the summary
/// could not list them all (deleted once the operator keeps them).
fn image_groups(observed: &Observed, plan: &PlanSummary, work: &mut Work) -> Groups {
    let round = observed.round;
    if let Some(groups) = &observed.image_index {
        if let Some(job) = &observed.image_pages_job {
            work.delete.extend(job.metadata.name.clone());
        }
        return Groups::Read(groups.clone());
    }
    let Some(images) = &plan.images else {
        return Groups::None;
    };
    let Some(index) = &images.index else {
        return Groups::Read(images.listed.clone());
    };
    let reading = || {
        Groups::Unread(Outcome::Working(
            Phase::Planning,
            format!(
                "reading the plan's {} image groups ({} pages)",
                images.groups, images.pages
            ),
        ))
    };
    let pages_job = |exists| Child::ImagePages {
        round,
        index: index.clone(),
        pages: images.pages,
        exists,
    };
    let Some(job) = &observed.image_pages_job else {
        work.children.push(pages_job(false));
        return reading();
    };
    match JobState::of(job) {
        JobState::Running => {
            work.children.push(pages_job(true));
            reading()
        }
        JobState::Failed { message, .. } => Groups::Unread(Outcome::Failed(
            Reason::PlanFailed,
            format!("reading the plan's image index {index} failed: {message}"),
        )),
        JobState::Complete => {
            let read: BTreeSet<u32> = observed.image_pages.iter().map(|page| page.page).collect();
            if read.len() < to_usize(images.pages) {
                // Pods gone before their pages were kept (a node scaled down): read them again.
                work.delete.extend(job.metadata.name.clone());
                return reading();
            }
            let groups = groups_of_pages(&observed.image_pages);
            let bytes: usize = groups
                .iter()
                .map(|g| g.image.len() + g.ids.len() + 24)
                .sum();
            if bytes > MAX_IMAGE_INDEX_BYTES {
                return Groups::Unread(Outcome::Failed(
                    Reason::PlanFailed,
                    format!(
                        "the dataset names {} images, more than the operator keeps ({} KiB of \
                         image groups at most); split the dataset into runs",
                        images.groups,
                        MAX_IMAGE_INDEX_BYTES / 1024
                    ),
                ));
            }
            Groups::Read(groups)
        }
    }
}

/// The plan stage's outcome while it is not done; `None` once the plan Job completed.
fn plan(observed: &Observed, children: &mut Vec<Child>) -> Option<Outcome> {
    let round = observed.round;
    let planning = || {
        let message = match round {
            1 => "planning the dataset".to_owned(),
            round => format!("round {round}: planning the batches the last merge found incomplete"),
        };
        Some(Outcome::Working(Phase::Planning, message))
    };
    let Some(plan_job) = &observed.plan_job else {
        children.push(Child::Plan {
            round,
            exists: false,
        });
        return planning();
    };
    match JobState::of(plan_job) {
        JobState::Running => {
            children.push(Child::Plan {
                round,
                exists: true,
            });
            planning()
        }
        JobState::Failed { message, .. } => Some(Outcome::Failed(
            Reason::PlanFailed,
            format!(
                "the plan Job failed: {}",
                said(observed.plan_failure.as_ref(), &message)
            ),
        )),
        JobState::Complete => None,
    }
}

/// The plan's summary: read from the plan pod's termination message; that pod goes when its node
/// does (a scaled-down node, hours into a run), so what the status recorded from it stands in,
/// when it is this round's.
fn plan_summary(run: &ValidatedRun<'_>, observed: &Observed) -> Option<PlanSummary> {
    observed.plan_summary.clone().or_else(|| {
        let status = run.status()?;
        (status.plan_round.unwrap_or(1) == observed.round)
            .then(|| recorded_plan(Some(status)))
            .flatten()
    })
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
    let ids = IdSpace::of(plan);
    let (done, done_count) = count_batches(plan, ids, observed, BTreeSet::new(), tally);

    let pending = ids.pending(&done)?;
    let next = match latest_attempt(&observed.attempts) {
        None => first_attempt_of(observed.round),
        Some(shards) => {
            let attempt = shards[0].attempt;
            match attempt_state(&shards) {
                JobState::Running => {
                    tally.attempt = Some(attempt);
                    if let Some(outcome) = too_many_failed(run, &shards, &done) {
                        return Some(outcome);
                    }
                    children.extend(running_shards(run, &shards));
                    let message =
                        format!("attempt {attempt}: {done_count} of {total} batches done");
                    return Some(Outcome::Working(Phase::Running, message));
                }
                state => match after_attempt(
                    run,
                    (attempt + 1).saturating_sub(first_attempt_of(observed.round)),
                    (&state, failure_of(&shards)),
                    &pending,
                ) {
                    AfterAttempt::Fail(outcome) => return Some(outcome),
                    AfterAttempt::Next => attempt + 1,
                    AfterAttempt::Merge => return None,
                },
            }
        }
    };
    Some(start_attempt(run, next, &pending, tally, children))
}

/// The ids done (by the plan, `recorded` ones, and the round's attempts) and how many batches
/// that is, with the batch counts, progress and prompt counts they make in `tally`.
fn count_batches(
    plan: &PlanSummary,
    ids: IdSpace<'_>,
    observed: &Observed,
    recorded: BTreeSet<u32>,
    tally: &mut Tally,
) -> (BTreeSet<u32>, u32) {
    let mut done = ids.done_by_the_plan(plan);
    done.extend(recorded);
    let mut failed = BTreeSet::new();
    for attempt in &observed.attempts {
        done.extend(attempt.batches.completed.iter().copied());
        failed.extend(attempt.batches.failed.iter().copied());
    }
    let done_count = ids.done_count(&done);
    tally.batches = Some(batch_counts(plan.batches, ids, &done, &failed));
    tally.progress = Some(progress(done_count, plan.batches));
    tally.planned = Some(Planned {
        total: plan.prompts,
        invalid: plan.invalid,
        round: observed.round,
    });
    (done, done_count)
}

/// The Jobs of the latest attempt, in shard order.
fn latest_attempt(attempts: &[ObservedAttempt]) -> Option<Vec<&ObservedAttempt>> {
    let latest = attempts.iter().map(|a| a.attempt).max()?;
    let mut shards: Vec<&ObservedAttempt> =
        attempts.iter().filter(|a| a.attempt == latest).collect();
    shards.sort_by_key(|a| a.shard);
    Some(shards)
}

/// How an attempt of one or more Jobs stands: a Job failed by its pod failure policy or its
/// failed-index limit decides it; otherwise it runs while any Job runs, and has ended when none
/// does (completed, or failed otherwise as its first failed Job says).
fn attempt_state(shards: &[&ObservedAttempt]) -> JobState {
    let states: Vec<JobState> = shards.iter().map(|s| JobState::of(&s.job)).collect();
    let decisive = states.iter().find(|state| {
        matches!(state, JobState::Failed { reason, .. }
            if reason == "PodFailurePolicy" || reason == "MaxFailedIndexesExceeded")
    });
    if let Some(state) = decisive {
        return state.clone();
    }
    if states.contains(&JobState::Running) {
        return JobState::Running;
    }
    states
        .into_iter()
        .find(|state| *state != JobState::Complete)
        .unwrap_or(JobState::Complete)
}

/// What the attempt's failed pods reported, from the Job that failed first in shard order.
fn failure_of<'a>(shards: &[&'a ObservedAttempt]) -> Option<&'a WorkerFailure> {
    shards.iter().find_map(|shard| shard.failure.as_ref())
}

/// What a failed worker said (`reason: error`), or the Job's own message when no pod said.
fn said(failure: Option<&WorkerFailure>, job_message: &str) -> String {
    failure.map_or_else(
        || job_message.to_owned(),
        |failure| format!("{}: {}", failure.reason, failure.error),
    )
}

/// Over several Jobs, each limits its own failed indexes; the run's `retry.maxFailedBatches` is
/// checked across them here. (A single Job's own limit is the run's.)
fn too_many_failed(
    run: &ValidatedRun<'_>,
    shards: &[&ObservedAttempt],
    done: &BTreeSet<u32>,
) -> Option<Outcome> {
    let retry = &run.spec.retry;
    let failed = shards
        .iter()
        .flat_map(|s| s.batches.failed.iter())
        .filter(|batch| !done.contains(batch))
        .count();
    (shards.len() > 1 && failed > to_usize(retry.max_failed_batches)).then(|| {
        Outcome::Failed(
            Reason::TooManyFailedBatches,
            format!(
                "more than {} batches failed after {} retries each",
                retry.max_failed_batches, retry.per_batch
            ),
        )
    })
}

/// The running Jobs of an attempt, re-asserted with their share of the workers (the finished ones
/// need nothing more, and free their share for the others).
fn running_shards(run: &ValidatedRun<'_>, shards: &[&ObservedAttempt]) -> Vec<Child> {
    let running: Vec<&&ObservedAttempt> = shards
        .iter()
        .filter(|s| JobState::of(&s.job) == JobState::Running)
        .collect();
    let parallelisms = worker_shares(run.spec.workers, running.len());
    running
        .into_iter()
        .zip(parallelisms)
        .filter_map(|(observed, parallelism)| {
            Some(Child::Generation(Shard {
                attempt: observed.attempt,
                shard: observed.shard,
                pending: Pending::of(observed.pending.clone(), observed.pending_list.clone())?,
                exists: true,
                parallelism,
                tasks: Tasks::Sandbox,
                held: false,
                prefer_node: None,
                task_resources: None,
            }))
        })
        .collect()
}

/// `workers` split over `jobs`: the first ones get one more when it does not divide evenly.
fn worker_shares(workers: u32, jobs: usize) -> Vec<u32> {
    let jobs_u32 = u32::try_from(jobs).unwrap_or(u32::MAX).max(1);
    let (each, extra) = (workers / jobs_u32, workers % jobs_u32);
    (0..jobs_u32)
        .map(|i| each + u32::from(i < extra))
        .take(jobs)
        .collect()
}

fn to_usize(value: u32) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

/// What follows an attempt that ended with batches still pending.
enum AfterAttempt {
    Fail(Outcome),
    Next,
    /// No attempt is left, and few enough batches are missing: merge what is done.
    Merge,
}

/// `attempt_of_round`: the attempt's place in its round, from 1.
fn after_attempt(
    run: &ValidatedRun<'_>,
    attempt_of_round: u32,
    (state, failure): (&JobState, Option<&WorkerFailure>),
    pending: &Pending,
) -> AfterAttempt {
    let retry = &run.spec.retry;
    match state {
        JobState::Failed { reason, message } if reason == "PodFailurePolicy" => {
            let reason = failure
                .and_then(|failure| Reason::of_worker(&failure.reason))
                .unwrap_or(Reason::WorkerConfigError);
            AfterAttempt::Fail(Outcome::Failed(
                reason,
                format!(
                    "a worker stopped on a configuration error no retry can fix: {}",
                    said(failure, message)
                ),
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
        _ if pending.count() > retry.max_failed_batches
            && attempt_of_round >= ATTEMPTS_PER_ROUND =>
        {
            AfterAttempt::Fail(Outcome::Failed(
                Reason::TooManyFailedBatches,
                format!(
                    "{} batches are not done after {ATTEMPTS_PER_ROUND} attempts; at most {} may be missing",
                    pending.count(),
                    retry.max_failed_batches
                ),
            ))
        }
        _ if attempt_of_round < ATTEMPTS_PER_ROUND => AfterAttempt::Next,
        _ => AfterAttempt::Merge,
    }
}

/// A new generation attempt over the pending batches: one Job, or one per
/// [`MAX_JOB_COMPLETIONS`] batches with the workers split over them.
fn start_attempt(
    run: &ValidatedRun<'_>,
    attempt: u32,
    pending: &Pending,
    tally: &mut Tally,
    children: &mut Vec<Child>,
) -> Outcome {
    tally.attempt = Some(attempt);
    let slices = pending.shards();
    let last = Component::Generate {
        attempt,
        shard: u32::try_from(slices.len() - 1).unwrap_or(u32::MAX),
    };
    if last.child_name(&run.name).len() > MAX_NAME_LENGTH {
        return Outcome::Failed(
            Reason::InvalidSpec,
            format!(
                "the run name {:?} is too long for the {} Jobs its {} batches take (at most {} batches a Job): Job {:?} would exceed {MAX_NAME_LENGTH} characters; use a shorter name or a larger spec.batchSize",
                run.name,
                slices.len(),
                pending.count(),
                MAX_JOB_COMPLETIONS,
                last.child_name(&run.name)
            ),
        );
    }
    let message = format!("attempt {attempt}: {} batches to generate", pending.count());
    let shares = worker_shares(run.spec.workers, slices.len());
    for ((shard, slice), parallelism) in (0_u32..).zip(slices).zip(shares) {
        children.push(Child::Generation(Shard {
            attempt,
            shard,
            pending: slice,
            exists: false,
            parallelism,
            tasks: Tasks::Sandbox,
            held: false,
            prefer_node: None,
            task_resources: None,
        }));
    }
    Outcome::Working(Phase::Running, message)
}

/// The merge stage: started once generation is over, then finished or failed.
fn merge(
    run: &ValidatedRun<'_>,
    observed: &Observed,
    tally: &mut Tally,
    children: &mut Vec<Child>,
) -> Outcome {
    let round = observed.round;
    let merging = || Outcome::Working(Phase::Merging, "merging the batches".into());
    let Some(merge_job) = &observed.merge_job else {
        children.push(Child::Merge {
            round,
            exists: false,
        });
        return merging();
    };
    match JobState::of(merge_job) {
        JobState::Running => {
            children.push(Child::Merge {
                round,
                exists: true,
            });
            merging()
        }
        JobState::Failed { .. }
            if round < MAX_ROUNDS
                && observed
                    .merge_failure
                    .as_ref()
                    .is_some_and(|failure| failure.reason == INCOMPLETE_BATCH) =>
        {
            children.push(Child::Plan {
                round: round + 1,
                exists: false,
            });
            Outcome::Working(
                Phase::Planning,
                format!(
                    "round {}: the merge found batches incomplete ({}); planning them again",
                    round + 1,
                    said(observed.merge_failure.as_ref(), "")
                ),
            )
        }
        JobState::Failed { message, .. } => Outcome::Failed(
            Reason::MergeFailed,
            format!(
                "the merge Job failed: {}",
                said(observed.merge_failure.as_ref(), &message)
            ),
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

/// The reason a merge reports for batches marked done that lack records (it has cleared their
/// markers by then).
pub const INCOMPLETE_BATCH: &str = "IncompleteBatch";

fn merged(run: &ValidatedRun<'_>, merge: &MergeSummary) -> Merged {
    Merged {
        succeeded: merge.trajectories,
        discarded: merge.discarded,
        failed: merge.failed,
        verification: (merge.verified > 0).then_some(VerificationStatus {
            verified: merge.verified,
            passed: merge.passed,
        }),
        // What the run spent, when its pods kept claims; else what the kept records cost.
        cost: merge
            .spent
            .clone()
            .or_else(|| merge.cost.clone())
            .map(|spent| CostStatus {
                spent,
                projected: None,
                currency: "USD".to_owned(),
                exhausted_budget: None,
            }),
        output: OutputStatus {
            path: run.output_path.clone(),
            trajectories: merge.trajectories,
            bytes: merge.bytes,
            report: format!(
                "{}/{}",
                run.output_path.trim_end_matches('/'),
                trajectory_worker::contract::paths::REPORT_FILE
            ),
        },
    }
}

/// The plan's summary as far as the run's status recorded it (once the plan was observed, every
/// status write carries its batch total and prompt counts): the batches completed so far stand
/// for the plan's `done`, of which they are a superset; a plan with a pending list on storage
/// stands as that list (the attempts' slots count in it). `None` before anything was recorded.
fn recorded_plan(status: Option<&TrajectoryRunStatus>) -> Option<PlanSummary> {
    let status = status?;
    let (batches, prompts) = (status.batches.as_ref()?, status.prompts.as_ref()?);
    let (done, done_count, pending_list) = if let Some(list) = &batches.pending_list {
        let done_before = batches.total.saturating_sub(list.batches);
        (Vec::new(), done_before, Some(list.path.clone()))
    } else {
        let done = parse_ranges(&batches.completed).ok()?;
        let count = u32::try_from(done.len()).ok()?;
        (compact_ranges(done), count, None)
    };
    Some(PlanSummary {
        prompts: prompts.total,
        invalid: prompts.invalid,
        batches: batches.total,
        done,
        done_count,
        dataset_digest: String::new(),
        spec_hash: String::new(),
        done_truncated: pending_list.is_some(),
        pending_list,
        images: None,
    })
}

/// The ids below `total` not done, in order.
pub fn pending_batches(total: u32, done: &BTreeSet<u32>) -> Vec<u32> {
    (0..total).filter(|batch| !done.contains(batch)).collect()
}

/// The status' batch counts: done batches (from the plan's recovery scan and every attempt) and the
/// batches that failed and are not done; as ranges of batch ids when the ids are batch ids.
pub fn batch_counts(
    total: u32,
    ids: IdSpace<'_>,
    done: &BTreeSet<u32>,
    failed: &BTreeSet<u32>,
) -> BatchCounts {
    let failed: Vec<u32> = failed.difference(done).copied().collect();
    let failed_count = u32::try_from(failed.len()).unwrap_or(u32::MAX);
    let completed_count = ids.done_count(done);
    match ids {
        IdSpace::Batches { .. } => BatchCounts {
            total,
            completed: format_ranges(&compact_ranges(done.iter().copied())),
            failed: format_ranges(&compact_ranges(failed)),
            completed_count,
            failed_count,
            pending_list: None,
        },
        IdSpace::Slots { list, slots, .. } => BatchCounts {
            total,
            completed: String::new(),
            failed: String::new(),
            completed_count,
            failed_count,
            pending_list: Some(PendingListStatus {
                path: list.to_owned(),
                batches: slots,
            }),
        },
    }
}

/// `done/total`, the Progress printer column.
pub fn progress(done: u32, total: u32) -> String {
    format!("{done}/{total}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_counts_use_compact_ranges_and_progress_counts_done_batches() {
        let done: BTreeSet<u32> = (0..=41).chain([44]).collect();
        let failed: BTreeSet<u32> = [42, 44, 50].into();
        let counts = batch_counts(120, IdSpace::Batches { total: 120 }, &done, &failed);
        assert_eq!(counts.total, 120);
        assert_eq!(counts.completed, "0-41,44");
        // A batch that failed in one attempt and finished in a later one is not failed.
        assert_eq!(counts.failed, "42,50");
        assert_eq!((counts.completed_count, counts.failed_count), (43, 2));
        assert_eq!(
            batch_counts(
                3,
                IdSpace::Batches { total: 3 },
                &BTreeSet::new(),
                &BTreeSet::new()
            )
            .completed,
            ""
        );
    }

    #[test]
    fn workers_are_split_over_the_jobs_the_first_ones_taking_the_remainder() {
        assert_eq!(worker_shares(8, 3), [3, 3, 2]);
        assert_eq!(worker_shares(8, 1), [8]);
        // Fewer workers than Jobs: the last ones wait with none until others finish.
        assert_eq!(worker_shares(2, 4), [1, 1, 0, 0]);
        assert_eq!(worker_shares(5, 0), Vec::<u32>::new());
    }

    #[test]
    fn pending_batches_are_cut_into_slices_a_job_can_hold() {
        let pending = Pending::new((0..250_001).collect()).unwrap();
        let sizes: Vec<u32> = pending.shards().iter().map(Pending::count).collect();
        assert_eq!(sizes, [100_000, 100_000, 50_001]);
        assert_eq!(pending.shards()[1].ids()[0], 100_000);
        assert!(pending.shards()[0].is_identity() && !pending.shards()[1].is_identity());
    }

    #[test]
    fn pending_batches_skip_the_done_ones() {
        let done: BTreeSet<u32> = [0, 1, 3].into();
        assert_eq!(pending_batches(6, &done), [2, 4, 5]);
        assert_eq!(pending_batches(2, &[0, 1].into()), Vec::<u32>::new());
        assert_eq!(pending_batches(3, &BTreeSet::new()), [0, 1, 2]);
    }
}
