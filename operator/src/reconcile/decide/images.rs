//! Generation of a run whose rows name container images of their own: one Job per image a
//! generation attempt, admitted through a window, and cleaned up once its batches are recorded.
//!
//! The plan groups the pending batches by image ([`ImageGroup`]); the batches of rows naming none
//! stay together. Each of these, cut at [`MAX_JOB_COMPLETIONS`], is a [`Piece`]: its shard number
//! is its place in that list, the same in every attempt, so that the Job of piece *p* in attempt
//! *a* is always `<run>-gen-<a>-<p>`. An Indexed Job's pod template cannot vary its image by
//! index, which is why there is one Job per image; one image's batches in one Job also let a
//! node pull the image once for all of them.
//!
//! ```text
//!  piece: waiting ──(window has room)──► Job running ──► complete ──(batches in status)──► deleted
//!                                            │ pods cannot pull the image
//!                                            ▼
//!                      deleted, and a `-na` Job records its rows failed (image_unavailable)
//! ```
//!
//! The window: at most `workers` Jobs run at once, pieces starting in order as others finish, the
//! workers split over the running ones. The attempt ends when no piece waits and no Job runs;
//! what failed is retried by the next attempt, as in a run without images.

use std::collections::{BTreeMap, BTreeSet};

use trajectory_worker::contract::{
    BuildOutcome, ImageGroup, MAX_JOB_COMPLETIONS, PlanSummary, TaskResources, parse_ranges,
};

use super::{
    AfterAttempt, Child, IdSpace, Pending, Shard, Tasks, after_attempt, attempt_state,
    count_batches, failure_of, to_usize, too_many_failed, worker_shares,
};
use crate::api::{BuildStatus, Phase};
use crate::reconcile::children::{
    Component, MAX_NAME_LENGTH, first_attempt_of, round_of_attempt, unavailable_job_name,
};
use crate::reconcile::observe::{JobState, Observed, ObservedAttempt};
use crate::reconcile::status::{ImageTally, Outcome, Reason, Tally};
use crate::reconcile::validate::ValidatedRun;

/// Unavailable images the status lists by name (it counts them all).
pub const LISTED_UNAVAILABLE: usize = 10;

/// A share of the generation work that one Job per attempt does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub shard: u32,
    /// The image its rows name; `None` for the rows that name none.
    pub image: Option<String>,
    /// Its ids (batch ids, or slots of the plan's pending list), ascending.
    pub ids: Vec<u32>,
    /// Why its image could not be built, when the run built it and that failed.
    pub build_failed: Option<String>,
    /// What its rows' tasks ask of their containers.
    pub resources: Option<TaskResources>,
}

/// The run's pieces: the rows naming no image first, then each image group in the plan's order.
pub fn pieces(
    ids: IdSpace<'_>,
    plan: &PlanSummary,
    groups: &[ImageGroup],
) -> Result<Vec<Piece>, String> {
    let mut grouped = Vec::with_capacity(groups.len());
    let mut in_groups = BTreeSet::new();
    for group in groups {
        let group_ids = parse_ranges(&group.ids)
            .map_err(|reason| format!("image group {}: {reason}", group.image))?;
        in_groups.extend(group_ids.iter().copied());
        grouped.push((
            Some(group.image.clone()),
            group_ids,
            group.build_failed.clone(),
            group.resources,
        ));
    }
    let done = ids.done_by_the_plan(plan);
    let upper = match ids {
        IdSpace::Batches { total } => total,
        IdSpace::Slots { slots, .. } => slots,
    };
    let imageless: Vec<u32> = (0..upper)
        .filter(|id| !done.contains(id) && !in_groups.contains(id))
        .collect();
    let size = to_usize(MAX_JOB_COMPLETIONS);
    let mut pieces = Vec::new();
    for (image, ids, build_failed, resources) in
        std::iter::once((None, imageless, None, None)).chain(grouped)
    {
        for chunk in ids.chunks(size) {
            pieces.push(Piece {
                shard: u32::try_from(pieces.len()).unwrap_or(u32::MAX),
                image: image.clone(),
                ids: chunk.to_vec(),
                build_failed: build_failed.clone(),
                resources,
            });
        }
    }
    Ok(pieces)
}

/// Where a piece stands in the current attempt.
enum PieceState<'a> {
    /// Every batch of it is done.
    Finished,
    /// It has batches left and no Job in this attempt yet.
    Waiting(Vec<u32>),
    /// Its Job in this attempt (the one recording it unavailable, when there is one).
    Job(&'a ObservedAttempt),
}

/// The generation stage of a run whose plan grouped its batches by image; `None` when the run goes
/// on to merge.
pub fn generate(
    run: &ValidatedRun<'_>,
    observed: &Observed,
    plan: &PlanSummary,
    groups: &[ImageGroup],
    tally: &mut Tally,
    decision: &mut Work,
) -> Option<Outcome> {
    let ids = IdSpace::of(plan);
    let total = plan.batches;
    let pieces = match pieces(ids, plan, groups) {
        Ok(pieces) => pieces,
        Err(reason) => {
            return Some(Outcome::Failed(
                Reason::PlanFailed,
                format!("the plan's image groups cannot be read: {reason}"),
            ));
        }
    };
    let recorded = recorded_this_round(run, observed.round, ids);
    let (done, done_count) = count_batches(plan, ids, observed, recorded.clone(), tally);
    let mut images = image_tally(groups, &pieces, &done, observed);
    // Counted over the batches the status records; a plan's pending list (slots, not batch ids)
    // keeps no such record, and its figures are the report's alone.
    let recorded_pulls = run
        .status()
        .and_then(|status| status.images.as_ref())
        .and_then(|images| images.pulls.as_ref());
    images.pulls = match ids {
        IdSpace::Batches { .. } => {
            super::pulls::tally(recorded_pulls, observed, (&recorded, &done))
        }
        IdSpace::Slots { .. } => recorded_pulls.cloned(),
    };
    tally.images = Some(images);
    decision
        .delete
        .extend(finished_jobs(observed, &recorded, ids));
    // Finished Jobs and their pods stay until the status records their batches; progress is
    // written at most once a status interval, so half a window's worth of them waiting has it
    // written now: one write for `workers / 2` images, and never more than one and a half
    // windows of Jobs alive.
    decision.record_now =
        awaiting_record(observed, &recorded, ids) >= to_usize(run.spec.workers).div_ceil(2).max(1);

    let pending = ids.pending(&done)?;
    // The latest attempt's Jobs may all be gone (deleted once recorded): the status's attempt of
    // this round is the floor.
    let recorded_attempt = run
        .status()
        .and_then(|status| status.attempt)
        .filter(|attempt| round_of_attempt(*attempt) == observed.round);
    let attempt = observed
        .attempts
        .iter()
        .map(|a| a.attempt)
        .chain(recorded_attempt)
        .max()
        .unwrap_or_else(|| first_attempt_of(observed.round));
    tally.attempt = Some(attempt);
    if let Some(refusal) = names_too_long(run, attempt, &pieces) {
        return Some(refusal);
    }
    let jobs: Vec<&ObservedAttempt> = observed
        .attempts
        .iter()
        .filter(|a| a.attempt == attempt)
        .collect();
    if let Some(outcome) = too_many_failed(run, &jobs, &done) {
        return Some(outcome);
    }
    let states: Vec<(&Piece, PieceState)> = pieces
        .iter()
        .map(|piece| (piece, piece_state(piece, &jobs, &done)))
        .collect();
    let working = states.iter().any(|(_, state)| match state {
        PieceState::Waiting(_) => true,
        PieceState::Job(job) => JobState::of(&job.job) == JobState::Running,
        PieceState::Finished => false,
    });
    let state = attempt_state(&jobs);
    let decisive = matches!(&state, JobState::Failed { reason, .. }
        if reason == "PodFailurePolicy" || reason == "MaxFailedIndexesExceeded");
    let list = pending.list().map(str::to_owned);
    if working && !decisive {
        window(run, attempt, &states, (observed, list.as_deref()), decision);
        let message = format!("attempt {attempt}: {done_count} of {total} batches done");
        return Some(Outcome::Working(Phase::Running, message));
    }
    let attempt_of_round = (attempt + 1).saturating_sub(first_attempt_of(observed.round));
    match after_attempt(run, attempt_of_round, (&state, failure_of(&jobs)), &pending) {
        AfterAttempt::Fail(outcome) => Some(outcome),
        AfterAttempt::Merge => None,
        AfterAttempt::Next => {
            let next = attempt + 1;
            tally.attempt = Some(next);
            let waiting: Vec<(&Piece, PieceState)> = pieces
                .iter()
                .map(|piece| (piece, piece_state(piece, &[], &done)))
                .collect();
            window(run, next, &waiting, (observed, list.as_deref()), decision);
            let message = format!("attempt {next}: {} batches to generate", pending.count());
            Some(Outcome::Working(Phase::Running, message))
        }
    }
}

/// What the generation stage adds to the decision besides its outcome: children to apply, Jobs to
/// delete.
#[derive(Debug, Default)]
pub struct Work {
    pub children: Vec<Child>,
    pub delete: Vec<String>,
    /// Write the status now, not at the next status interval: see [`Decision::record_now`].
    pub record_now: bool,
}

fn piece_state<'a>(
    piece: &Piece,
    jobs: &[&'a ObservedAttempt],
    done: &BTreeSet<u32>,
) -> PieceState<'a> {
    let of_piece = jobs.iter().filter(|job| job.shard == piece.shard);
    // The Job recording the rows unavailable replaces the one whose pods could not pull.
    if let Some(job) = of_piece
        .clone()
        .find(|job| job.unavailable.is_some())
        .or_else(|| of_piece.clone().next())
    {
        return PieceState::Job(job);
    }
    let left: Vec<u32> = piece
        .ids
        .iter()
        .copied()
        .filter(|id| !done.contains(id))
        .collect();
    if left.is_empty() {
        PieceState::Finished
    } else {
        PieceState::Waiting(left)
    }
}

/// The attempt's running Jobs kept with their share of the workers, and waiting pieces started
/// while fewer than `workers` Jobs run; a Job whose pods cannot pull its image is replaced by the
/// one recording its rows unavailable.
fn window(
    run: &ValidatedRun<'_>,
    attempt: u32,
    states: &[(&Piece, PieceState)],
    (observed, list): (&Observed, Option<&str>),
    work: &mut Work,
) {
    let workers = to_usize(run.spec.workers).max(1);
    let mut live: Vec<Shard> = Vec::new();
    for (piece, state) in states {
        let PieceState::Job(job) = state else {
            continue;
        };
        if JobState::of(&job.job) != JobState::Running {
            continue;
        }
        let pending = Pending::of(job.pending.clone(), job.pending_list.clone());
        let Some(pending) = pending else { continue };
        let name = job.job.metadata.name.clone().unwrap_or_default();
        match (&job.unavailable, observed.unpullable.get(&name)) {
            (None, Some(why)) => {
                work.delete.push(name);
                live.push(Shard {
                    attempt,
                    shard: piece.shard,
                    pending,
                    exists: false,
                    parallelism: 0,
                    tasks: Tasks::Unavailable {
                        image: piece.image.clone().unwrap_or_default(),
                        why: why.clone(),
                        build_failed: false,
                    },
                    held: false,
                    prefer_node: None,
                    task_resources: None,
                });
            }
            (unavailable, _) => live.push(Shard {
                attempt,
                shard: piece.shard,
                pending,
                exists: true,
                parallelism: 0,
                tasks: match (unavailable, &job.image) {
                    (Some(why), image) => Tasks::Unavailable {
                        image: image.clone().unwrap_or_default(),
                        why: why.clone(),
                        build_failed: job.build_failed,
                    },
                    (None, Some(image)) => Tasks::Image(image.clone()),
                    (None, None) => Tasks::Sandbox,
                },
                held: false,
                prefer_node: None,
                task_resources: None,
            }),
        }
    }
    let mut waiting = states.iter().filter_map(|(piece, state)| match state {
        PieceState::Waiting(left) => Some((*piece, left)),
        PieceState::Finished | PieceState::Job(_) => None,
    });
    while live.len() < workers {
        let Some((piece, left)) = waiting.next() else {
            break;
        };
        let Some(pending) = Pending::of(left.clone(), list.map(str::to_owned)) else {
            continue;
        };
        live.push(Shard {
            attempt,
            shard: piece.shard,
            pending,
            exists: false,
            parallelism: 0,
            tasks: match (&piece.image, &piece.build_failed) {
                (Some(image), Some(why)) => Tasks::Unavailable {
                    image: image.clone(),
                    why: why.clone(),
                    build_failed: true,
                },
                (Some(image), None) => Tasks::Image(image.clone()),
                (None, _) => Tasks::Sandbox,
            },
            held: false,
            prefer_node: super::prefetch::node_of(observed, piece.shard),
            task_resources: piece.resources,
        });
    }
    let shares = worker_shares(run.spec.workers, live.len());
    for (mut shard, share) in live.into_iter().zip(shares) {
        shard.parallelism = share.min(shard.pending.count()).max(1);
        work.children.push(Child::Generation(shard));
    }
    // The pieces next in line once these run: their images are pulled ahead.
    super::prefetch::prefetch(run, observed, waiting.map(|(piece, _)| piece), work);
}

/// The batches the run's status recorded done in this round: Jobs that finished are deleted once
/// the status holds their batches, and their batches are known from it afterwards. Only batch
/// ids are recorded (a plan's pending list makes the status count, not list, them), and only
/// a status of this round counts: a later round plans the batches its merge found incomplete.
fn recorded_this_round(run: &ValidatedRun<'_>, round: u32, ids: IdSpace<'_>) -> BTreeSet<u32> {
    let IdSpace::Batches { .. } = ids else {
        return BTreeSet::new();
    };
    let Some(status) = run.status() else {
        return BTreeSet::new();
    };
    if status
        .attempt
        .is_none_or(|attempt| round_of_attempt(attempt) != round)
    {
        return BTreeSet::new();
    }
    status
        .batches
        .as_ref()
        .and_then(|batches| parse_ranges(&batches.completed).ok())
        .unwrap_or_default()
        .into_iter()
        .collect()
}

/// Complete Jobs of this round, but those recording unavailable images, whose every batch the
/// status already records: nothing more is read from them, and they go with their pods.
fn finished_jobs<'a>(
    observed: &'a Observed,
    recorded: &'a BTreeSet<u32>,
    ids: IdSpace<'_>,
) -> impl Iterator<Item = String> + 'a {
    complete_image_jobs(observed, ids)
        .filter(|job| job.pending.iter().all(|id| recorded.contains(id)))
        .filter_map(|job| job.job.metadata.name.clone())
}

/// How many complete Jobs of rows naming an image wait for the status to record their batches.
fn awaiting_record(observed: &Observed, recorded: &BTreeSet<u32>, ids: IdSpace<'_>) -> usize {
    complete_image_jobs(observed, ids)
        .filter(|job| !job.pending.iter().all(|id| recorded.contains(id)))
        .count()
}

/// The complete Jobs of rows naming an image that can go once recorded (those recording rows
/// unavailable stay, as the round's record of them).
fn complete_image_jobs<'a>(
    observed: &'a Observed,
    ids: IdSpace<'_>,
) -> impl Iterator<Item = &'a ObservedAttempt> + 'a {
    let listed = matches!(ids, IdSpace::Batches { .. });
    observed
        .attempts
        .iter()
        .filter(move |job| listed && job.unavailable.is_none())
        .filter(|job| JobState::of(&job.job) == JobState::Complete)
}

/// The run's images: how many, how many pulled (some batch of theirs is done by a Job of their
/// image), which could not be.
fn image_tally(
    groups: &[ImageGroup],
    pieces: &[Piece],
    done: &BTreeSet<u32>,
    observed: &Observed,
) -> ImageTally {
    let mut unavailable: BTreeMap<String, String> = BTreeMap::new();
    for job in &observed.attempts {
        if let (Some(why), Some(image)) = (&job.unavailable, &job.image) {
            unavailable
                .entry(image.clone())
                .or_insert_with(|| why.clone());
        }
    }
    let pulled: BTreeSet<&str> = pieces
        .iter()
        .filter_map(|piece| Some((piece.image.as_deref()?, &piece.ids)))
        .filter(|(image, ids)| {
            !unavailable.contains_key(*image) && ids.iter().any(|id| done.contains(id))
        })
        .map(|(image, _)| image)
        .collect();
    ImageTally {
        total: u32::try_from(groups.len()).unwrap_or(u32::MAX),
        pulled: u32::try_from(pulled.len()).unwrap_or(u32::MAX),
        unavailable_count: u32::try_from(unavailable.len()).unwrap_or(u32::MAX),
        unavailable: unavailable.into_iter().take(LISTED_UNAVAILABLE).collect(),
        builds: build_tally(groups),
        pulls: None,
    }
}

/// How the builds of the groups' images went, once they reported; by image.
fn build_tally(groups: &[ImageGroup]) -> Option<BuildStatus> {
    let outcomes: BTreeMap<&str, BuildOutcome> = groups
        .iter()
        .filter_map(|group| Some((group.image.as_str(), group.built?)))
        .collect();
    if outcomes.is_empty() {
        return None;
    }
    let count = |outcome| {
        let images = outcomes.values().filter(|built| **built == outcome).count();
        u32::try_from(images).unwrap_or(u32::MAX)
    };
    Some(BuildStatus {
        built: count(BuildOutcome::Built),
        reused: count(BuildOutcome::Present),
        failed: count(BuildOutcome::Failed),
    })
}

/// A refusal when the name of the attempt's last Job (its `-na` one) would not fit.
fn names_too_long(run: &ValidatedRun<'_>, attempt: u32, pieces: &[Piece]) -> Option<Outcome> {
    let last = u32::try_from(pieces.len().saturating_sub(1)).unwrap_or(u32::MAX);
    let longest = unavailable_job_name(
        &Component::Generate {
            attempt,
            shard: last,
        }
        .child_name(&run.name),
    );
    (longest.len() > MAX_NAME_LENGTH).then(|| {
        Outcome::Failed(
            Reason::InvalidSpec,
            format!(
                "the run name {:?} is too long for the {} Jobs its images take: Job {longest:?} \
                 would exceed {MAX_NAME_LENGTH} characters; use a shorter name",
                run.name,
                pieces.len()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::batch::v1::Job;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use trajectory_worker::contract::{RunPlan, env, paths, task_slots};
    use trajectory_worker::spec::ImageRewrite;

    use crate::api::{BatchCounts, TrajectoryRun, TrajectoryRunStatus};
    use crate::fixtures::{
        JobFixture, ObservedFixture, job_named as job, job_names as names, now, pod_of as pod,
    };
    use crate::reconcile::observe::Observed;
    use crate::reconcile::{Desired, desired_state};
    use crate::settings::Settings;

    /// `r`, two workers, rows' `docker.io/` images pulled from a mirror.
    fn run(status: Option<TrajectoryRunStatus>) -> TrajectoryRun {
        TrajectoryRun::test()
            .named("r")
            .namespace("ns")
            .uid("uid-1")
            .with(|spec| {
                spec.workers = 2;
                spec.sandbox.image_rewrite = vec![ImageRewrite {
                    from: "docker.io/".into(),
                    to: "mirror.local:5000/".into(),
                }];
            })
            .with_status(status)
            .build()
    }

    fn decide(observed: &Observed, status: Option<TrajectoryRunStatus>) -> Desired {
        desired_state(&run(status), observed, &Settings::default(), &now()).unwrap()
    }

    /// Six batches: 0 and 4 name no image, 1-2 `docker.io/swe/a:1`, 3 `swe/b`, 5 `swe/c`.
    fn planned() -> ObservedFixture {
        ObservedFixture::planned(6).images(&[
            ("docker.io/swe/a:1", "1-2"),
            ("swe/b", "3"),
            ("swe/c", "5"),
        ])
    }

    fn env_of(job: &Job, name: &str) -> Option<String> {
        pod(job).containers[0]
            .env
            .iter()
            .flatten()
            .find(|var| var.name == name)
            .and_then(|var| var.value.clone())
    }

    fn batches_of(desired: &Desired, name: &str) -> Vec<u32> {
        let map = desired
            .children
            .config_maps
            .iter()
            .find(|map| map.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no ConfigMap {name}"));
        let plan: RunPlan =
            serde_json::from_str(&map.data.as_ref().unwrap()[paths::PLAN_FILE]).unwrap();
        plan.pending_list().unwrap().unwrap_or_default()
    }

    /// The rows naming no image first, then one Job per image, no more Jobs at once than
    /// workers: each image's Job runs a task container of the (rewritten) image per
    /// conversation slot, beside the run's sandbox; the groups are kept in a `ConfigMap`.
    #[test]
    fn each_image_gets_a_job_of_task_containers_and_no_more_jobs_run_than_workers() {
        let desired = decide(&planned().build(), None);
        assert_eq!(names(&desired), ["r-gen-1", "r-gen-1-1"]);
        assert!(
            desired
                .children
                .config_maps
                .iter()
                .any(|map| map.metadata.name.as_deref() == Some("r-images")),
            "the groups are kept"
        );
        assert_eq!(batches_of(&desired, "r-gen-1"), [0, 4]);
        assert_eq!(batches_of(&desired, "r-gen-1-1"), [1, 2]);
        let plain = job(&desired, "r-gen-1");
        assert_eq!(env_of(plain, env::TASK_SOCKETS), None);
        let of_image = job(&desired, "r-gen-1-1");
        let annotations = of_image.metadata.annotations.as_ref().unwrap();
        assert_eq!(annotations["trajectories.dev/image"], "docker.io/swe/a:1");
        assert_eq!(
            env_of(of_image, env::TASK_SOCKETS).as_deref(),
            Some(paths::TASK_SOCKETS_DIR)
        );
        let tasks: Vec<_> = pod(of_image)
            .init_containers
            .iter()
            .flatten()
            .filter(|c| c.name.starts_with("task-"))
            .collect();
        let run = run(None);
        let slots = task_slots(run.spec.run.batch_size, run.spec.run.samples_per_prompt);
        assert_eq!(tasks.len(), slots as usize);
        assert!(
            tasks
                .iter()
                .all(|c| c.image.as_deref() == Some("mirror.local:5000/swe/a:1"))
        );
        assert!(
            tasks
                .iter()
                .all(|c| c.restart_policy.as_deref() == Some("Always"))
        );
        let images = desired.status.images.as_ref().unwrap();
        assert_eq!((images.total, images.pulled, images.unavailable), (3, 0, 0));
    }

    /// With `prefetch`, the images next in line once the window is full are pulled ahead, each
    /// by a one-pod Job holding nothing of the run's; the image's Job, once it starts, prefers the
    /// node that pulled it, and its prefetch Job goes.
    #[test]
    fn the_next_images_are_pulled_ahead_and_their_jobs_prefer_the_node_that_pulled() {
        let prefetching = |status| {
            TrajectoryRun::test()
                .named("r")
                .namespace("ns")
                .uid("uid-1")
                .with(|spec| {
                    spec.workers = 2;
                    spec.sandbox.prefetch = 1;
                })
                .with_status(status)
                .build()
        };
        let decide = |observed: &Observed| {
            desired_state(&prefetching(None), observed, &Settings::default(), &now()).unwrap()
        };
        let desired = decide(&planned().build());
        assert_eq!(names(&desired), ["r-gen-1", "r-gen-1-1", "r-pull-2"]);
        let ahead = pod(job(&desired, "r-pull-2"));
        let (install, pull) = (
            &ahead.init_containers.as_ref().unwrap()[0],
            &ahead.containers[0],
        );
        assert_eq!(pull.image.as_deref(), Some("swe/b"));
        assert_eq!(pull.command.as_ref().unwrap()[1], "pulled");
        assert_eq!(install.command.as_ref().unwrap()[1], "install");
        assert_eq!(
            ahead.volumes.as_ref().unwrap().len(),
            1,
            "the executor's alone"
        );
        assert_eq!(ahead.automount_service_account_token, Some(false));
        assert!(
            pull.env.is_none() && install.env.is_none(),
            "no key, no settings"
        );
        let security = pull.security_context.as_ref().unwrap();
        assert_eq!(security.run_as_non_root, Some(true));
        assert_eq!(security.allow_privilege_escalation, Some(false));
        assert!(ahead.node_name.is_none() && ahead.affinity.is_none());

        // The first image done: b starts, on the node that pulled it; c is pulled ahead next.
        let mut observed = planned()
            .image_index_kept()
            .attempt(
                JobFixture::generation(1).complete().completed("0-1"),
                &[0, 4],
            )
            .attempt(
                JobFixture::generation(1)
                    .shard(1)
                    .image("docker.io/swe/a:1"),
                &[1, 2],
            )
            .build();
        let mut pulling = job(&desired, "r-pull-2").clone();
        pulling.metadata.uid = Some("pull-2".into());
        observed.prefetch_jobs.push(pulling);
        observed.prefetched.insert(2, "node-7".into());
        let desired = decide(&observed);
        assert_eq!(names(&desired), ["r-gen-1-1", "r-gen-1-2", "r-pull-3"]);
        assert_eq!(desired.delete, ["r-pull-2"]);
        let preferred = pod(job(&desired, "r-gen-1-2"))
            .affinity
            .as_ref()
            .and_then(|a| a.node_affinity.as_ref())
            .and_then(|a| {
                a.preferred_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .expect("a preferred node");
        let fields = preferred[0].preference.match_fields.as_ref().unwrap();
        assert_eq!(fields[0].key, "metadata.name");
        assert_eq!(
            fields[0].values.as_deref(),
            Some(&["node-7".to_owned()][..])
        );
        assert!(pod(job(&desired, "r-gen-1-1")).affinity.is_none());
    }

    /// What an image's Harbor tasks ask (`cpus`, `memory_mb`, `storage_mb`) is the limit of
    /// each of its task containers, over the run's `spec.sandbox.resources`: requested as the
    /// run requests it, else not at all, so that a pod of 16 conversations reserves no 16 times
    /// the task's cap; the run's sandbox container and other images' task containers keep the
    /// run's resources.
    #[test]
    fn an_images_task_resources_are_the_limits_of_its_task_containers() {
        type Quantities = Option<BTreeMap<String, Quantity>>;
        let mut observed = planned().build();
        let groups = &mut observed
            .plan_summary
            .as_mut()
            .unwrap()
            .images
            .as_mut()
            .unwrap()
            .listed;
        groups[0].resources = Some(trajectory_worker::contract::TaskResources {
            millicpus: Some(2000),
            memory_mb: Some(2048),
            storage_mb: None,
        });
        let sized = TrajectoryRun::test()
            .named("r")
            .namespace("ns")
            .uid("uid-1")
            .with(|spec| {
                spec.workers = 2;
                spec.sandbox.resources = Some(serde_json::json!({
                    "requests": {"cpu": "250m"},
                    "limits": {"cpu": "1", "ephemeral-storage": "1Gi"},
                }));
            })
            .build();
        let desired = desired_state(&sized, &observed, &Settings::default(), &now()).unwrap();
        let quantity = |map: &Quantities, name: &str| map.as_ref()?.get(name).map(|q| q.0.clone());
        let of_image = pod(job(&desired, "r-gen-1-1"));
        let tasks: Vec<_> = of_image
            .init_containers
            .iter()
            .flatten()
            .filter(|c| c.name.starts_with("task-"))
            .collect();
        assert!(!tasks.is_empty());
        for task in &tasks {
            let resources = task.resources.as_ref().unwrap();
            assert_eq!(quantity(&resources.limits, "cpu").as_deref(), Some("2000m"));
            assert_eq!(
                quantity(&resources.limits, "memory").as_deref(),
                Some("2048Mi")
            );
            assert_eq!(
                quantity(&resources.limits, "ephemeral-storage").as_deref(),
                Some("1Gi")
            );
            assert_eq!(
                quantity(&resources.requests, "cpu").as_deref(),
                Some("250m")
            );
            assert_eq!(
                quantity(&resources.requests, "memory").as_deref(),
                Some("0")
            );
        }
        let sandbox = of_image
            .init_containers
            .iter()
            .flatten()
            .find(|c| c.name == "sandbox")
            .unwrap();
        let resources = sandbox.resources.as_ref().unwrap();
        assert_eq!(quantity(&resources.limits, "cpu").as_deref(), Some("1"));
        assert_eq!(quantity(&resources.limits, "memory"), None);
    }

    /// As Jobs complete, the next images start in their place; a complete Job is deleted once
    /// the status records its batches, and its batches stay done.
    #[test]
    fn finished_jobs_make_room_for_the_next_images_and_go_once_recorded() {
        let observed = planned()
            .image_index_kept()
            .attempt(
                JobFixture::generation(1).complete().completed("0-1"),
                &[0, 4],
            )
            .attempt(
                JobFixture::generation(1)
                    .shard(1)
                    .image("docker.io/swe/a:1"),
                &[1, 2],
            )
            .build();
        let desired = decide(&observed, None);
        assert_eq!(names(&desired), ["r-gen-1-1", "r-gen-1-2"]);
        assert_eq!(batches_of(&desired, "r-gen-1-2"), [3]);
        assert!(desired.delete.is_empty(), "not recorded yet");
        assert_eq!(desired.status.batches.as_ref().unwrap().completed, "0,4");

        let recorded = TrajectoryRunStatus {
            attempt: Some(1),
            batches: Some(BatchCounts {
                total: 6,
                completed: "0,4".into(),
                completed_count: 2,
                ..BatchCounts::default()
            }),
            ..TrajectoryRunStatus::default()
        };
        let desired = decide(&observed, Some(recorded.clone()));
        assert_eq!(desired.delete, ["coding-v1-gen-1"]);
        // The Job gone, its batches still count as done, from the status.
        let gone = planned()
            .image_index_kept()
            .attempt(
                JobFixture::generation(1)
                    .shard(1)
                    .image("docker.io/swe/a:1"),
                &[1, 2],
            )
            .build();
        let desired = decide(&gone, Some(recorded));
        assert_eq!(names(&desired), ["r-gen-1-1", "r-gen-1-2"]);
        assert_eq!(desired.status.batches.as_ref().unwrap().completed, "0,4");
        assert_eq!(desired.status.images.as_ref().unwrap().pulled, 0);
    }

    /// Finished Jobs wait for the status to record their batches before they go; once half a
    /// window's worth of them waits (`workers`: two, so one), the status is written now, not at
    /// the next status interval.
    #[test]
    fn half_a_window_of_finished_jobs_has_the_status_written_now() {
        let second = JobFixture::generation(1)
            .shard(1)
            .image("docker.io/swe/a:1");
        let running = planned()
            .image_index_kept()
            .attempt(JobFixture::generation(1).completed("0"), &[0, 4])
            .attempt(second.clone(), &[1, 2])
            .build();
        assert!(!decide(&running, None).record_now);
        let one = planned()
            .image_index_kept()
            .attempt(JobFixture::generation(1), &[0, 4])
            .attempt(second.complete().completed("0-1"), &[1, 2])
            .build();
        let desired = decide(&one, None);
        assert!(desired.record_now);
        assert!(desired.delete.is_empty(), "not recorded yet");
    }

    /// A Job whose pods cannot pull its image is deleted, and one recording its rows failed
    /// (`image_unavailable`, no task container, no sandbox) takes its place; the status then
    /// lists the image, and an Event names it once.
    #[test]
    fn an_image_that_cannot_be_pulled_has_its_rows_recorded_unavailable() {
        let why = "mirror.local:5000/swe/a:1 (ErrImagePull): manifest unknown";
        let running = || {
            planned()
                .image_index_kept()
                .attempt(JobFixture::generation(1), &[0, 4])
        };
        let observed = running()
            .attempt(
                JobFixture::generation(1)
                    .shard(1)
                    .image("docker.io/swe/a:1"),
                &[1, 2],
            )
            .unpullable("coding-v1-gen-1-1", why)
            .build();
        let desired = decide(&observed, None);
        assert_eq!(desired.delete, ["coding-v1-gen-1-1"]);
        assert_eq!(names(&desired), ["r-gen-1", "r-gen-1-1-na"]);
        let recording = job(&desired, "r-gen-1-1-na");
        let message = env_of(recording, env::IMAGE_UNAVAILABLE).unwrap();
        assert!(message.contains("docker.io/swe/a:1") && message.contains("manifest unknown"));
        assert_eq!(env_of(recording, env::TASK_SOCKETS), None);
        assert!(
            pod(recording).init_containers.is_none(),
            "nothing of the rows runs"
        );
        assert_eq!(batches_of(&desired, "r-gen-1-1-na"), [1, 2]);

        let recorded = running()
            .attempt(
                JobFixture::generation(1)
                    .shard(1)
                    .image("docker.io/swe/a:1")
                    .unavailable(why),
                &[1, 2],
            )
            .build();
        let desired = decide(&recorded, None);
        assert!(desired.delete.is_empty());
        // Re-asserted (named from the run, as the fixtures' Jobs are not).
        assert_eq!(names(&desired), ["r-gen-1", "r-gen-1-1-na"]);
        let images = desired.status.images.as_ref().unwrap();
        assert_eq!(images.unavailable, 1);
        assert_eq!(images.unavailable_images[0].image, "docker.io/swe/a:1");
        let event = crate::reconcile::status::image_event(None, &desired.status).unwrap();
        assert!(event.note.unwrap().contains("docker.io/swe/a:1"));
        assert!(
            crate::reconcile::status::image_event(Some(&desired.status), &desired.status).is_none()
        );
    }

    /// Groups the plan's summary could not list are read from its index on storage by a Job of
    /// one pod a page; once they are all in, the operator keeps them (groups cut over two pages
    /// joined again), starts the images' Jobs, and deletes the pages' Job.
    #[test]
    fn groups_beyond_the_summary_are_read_in_pages_then_kept() {
        let in_pages = || planned().images_in_pages("plan/images-00000000000000ab", 2);
        let desired = decide(&in_pages().build(), None);
        assert_eq!(names(&desired), ["r-img"]);
        let reader = job(&desired, "r-img");
        let spec = reader.spec.as_ref().unwrap();
        assert_eq!(
            (spec.completions, spec.completion_mode.as_deref()),
            (Some(2), Some("Indexed"))
        );
        assert_eq!(
            env_of(reader, env::IMAGE_INDEX).as_deref(),
            Some("plan/images-00000000000000ab")
        );
        assert_eq!(
            pod(reader).containers[0].args.as_ref().unwrap(),
            &["image-page"]
        );
        assert_eq!(desired.status.phase, Some(crate::api::Phase::Planning));

        let group = |image: &str, ids: &str| {
            trajectory_worker::contract::ImageGroup::new(image.to_owned(), ids.to_owned())
        };
        let pages = vec![
            trajectory_worker::contract::ImagePage {
                page: 0,
                groups: vec![group("docker.io/swe/a:1", "1")],
            },
            trajectory_worker::contract::ImagePage {
                page: 1,
                groups: vec![group("docker.io/swe/a:1", "2"), group("swe/b", "3")],
            },
        ];
        let read = in_pages()
            .image_pages(JobFixture::image_pages().complete(), pages.clone())
            .build();
        let desired = decide(&read, None);
        assert_eq!(names(&desired), ["r-gen-1", "r-gen-1-1"]);
        assert_eq!(
            batches_of(&desired, "r-gen-1-1"),
            [1, 2],
            "the two parts joined"
        );
        assert_eq!(
            batches_of(&desired, "r-gen-1"),
            [0, 4, 5],
            "batch 5 is in no group read"
        );
        let kept = desired
            .children
            .config_maps
            .iter()
            .find(|map| map.metadata.name.as_deref() == Some("r-images"))
            .expect("the groups are kept");
        assert_eq!(
            kept.data.as_ref().unwrap()["groups.jsonl"].lines().count(),
            2
        );

        // A page missing (its pod gone): the Job goes, to be made again.
        let missing = in_pages()
            .image_pages(JobFixture::image_pages().complete(), pages[..1].to_vec())
            .build();
        assert_eq!(decide(&missing, None).delete, ["coding-v1-img"]);
        let mut kept = in_pages()
            .image_pages(JobFixture::image_pages().complete(), pages)
            .build();
        kept.image_index = Some(vec![group("docker.io/swe/a:1", "1,2"), group("swe/b", "3")]);
        assert_eq!(decide(&kept, None).delete, ["coding-v1-img"]);
    }
}
