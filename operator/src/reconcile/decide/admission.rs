//! Admission: for a run that names a Kueue queue, which of its Workloads to stop or start and
//! what the run's status says of where its Jobs wait (see [`crate::reconcile::queue`] for why a
//! queued run is stopped through its Workloads and never by suspending its Jobs).

use super::{Child, Shard};
use crate::reconcile::children::Component;
use crate::reconcile::observe::Observed;
use crate::reconcile::queue::{Admission as Queued, QueuedWorkload};
use crate::reconcile::status::{AdmissionTally, Reason};
use crate::reconcile::validate::ValidatedRun;

/// What a queued run does with its Workloads now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admissions {
    /// Workloads whose `spec.active` to set, by name.
    pub activate: Vec<(String, bool)>,
    /// What the run's `Admitted` condition says (none without a live queued Job).
    pub tally: Option<AdmissionTally>,
    /// A live Job is not running yet (no Workload yet, waiting for quota, evicted): its queue is
    /// looked at again after a while, since a Workload's progress in its queue does not change
    /// the Job the controller watches.
    pub recheck: bool,
}

/// The Job of `child`, if it is one that exists, with whether the run stops it now (the run is
/// suspended, or its generation Jobs are held at the budget).
fn live_job(run: &ValidatedRun<'_>, child: &Child) -> Option<(String, bool)> {
    let suspended = run.spec.suspend;
    match child {
        Child::Plan {
            round,
            exists: true,
        } => Some((run.child_name(Component::Plan { round: *round }), suspended)),
        Child::ImagePages {
            round,
            exists: true,
            ..
        } => Some((
            run.child_name(Component::ImagePages { round: *round }),
            suspended,
        )),
        Child::Build {
            round,
            exists: true,
            ..
        } => Some((
            run.child_name(Component::Build { round: *round }),
            suspended,
        )),
        Child::Merge {
            round,
            exists: true,
        } => Some((
            run.child_name(Component::Merge { round: *round }),
            suspended,
        )),
        Child::Generation(
            shard @ Shard {
                exists: true, held, ..
            },
        ) => Some((shard.job_name(run), suspended || *held)),
        _ => None,
    }
}

/// The Workloads to set and the run's admission, from its live Jobs' Workloads.
pub fn decide(run: &ValidatedRun<'_>, observed: &Observed, children: &[Child]) -> Admissions {
    let mut admissions = Admissions::default();
    let Some(queue_name) = run.spec.queue_name.as_deref() else {
        return admissions;
    };
    let Some(queue) = &observed.queue else {
        // No Workload API: the Jobs wait suspended for a Kueue that is not there.
        admissions.tally = Some(AdmissionTally::waiting(
            Reason::Queued,
            format!(
                "spec.queueName is {queue_name} but the cluster serves no Kueue Workload API \
                 (kueue.x-k8s.io): the Jobs stay suspended until Kueue is installed and admits \
                 them"
            ),
        ));
        return admissions;
    };
    // The first Job not running says where the run waits; all admitted, the last says by whom.
    let mut waiting: Option<AdmissionTally> = None;
    let mut admitted: Option<AdmissionTally> = None;
    for (job, stopped) in children.iter().filter_map(|child| live_job(run, child)) {
        let of_job = || queue.workloads.iter().filter(|w| w.job == job);
        let workloads: Vec<&QueuedWorkload> = of_job()
            .filter(|w| w.admission != Queued::Finished)
            .collect();
        if workloads.is_empty() && of_job().next().is_some() {
            // Its Job ended (or an elastic Job's slice was replaced and the new one is not
            // listed yet): nothing of it waits.
            continue;
        }
        if workloads.is_empty() {
            admissions.recheck = true;
            waiting.get_or_insert_with(|| {
                AdmissionTally::waiting(
                    Reason::Queued,
                    format!(
                        "Job {job} waits for Kueue to create its Workload in LocalQueue \
                         {queue_name}"
                    ),
                )
            });
            continue;
        }
        for workload in workloads {
            let (tally, change) = admission_of(&job, queue_name, workload, stopped);
            admissions.activate.extend(change);
            if tally.admitted {
                admitted = Some(tally);
            } else {
                // A Job stopped by the run waits for the run, not for its queue.
                admissions.recheck |= !stopped;
                waiting.get_or_insert(tally);
            }
        }
    }
    let creating = children.iter().any(|child| match child {
        Child::Plan { exists, .. }
        | Child::ImagePages { exists, .. }
        | Child::Build { exists, .. }
        | Child::Merge { exists, .. } => !exists,
        Child::Generation(shard) => !shard.exists,
        // Not queued: a queued run pulls nothing ahead.
        Child::ImageIndex { .. } | Child::Prefetch { .. } => false,
    });
    admissions.tally = waiting.or(admitted).or_else(|| {
        // No Job waits and none is about to be created (a finished run has no children): its
        // Jobs were all admitted.
        let evictions: u32 = queue.workloads.iter().map(|w| w.evictions).sum();
        let evicted = match evictions {
            0 => String::new(),
            1 => "; Kueue evicted a Job once, its finished batches kept".to_owned(),
            n => format!("; Kueue evicted its Jobs {n} times, their finished batches kept"),
        };
        (!creating && !queue.workloads.is_empty()).then(|| AdmissionTally {
            admitted: true,
            reason: Reason::Admitted,
            message: format!("every Job of the run was admitted; none waits in its queue{evicted}"),
        })
    });
    admissions
}

/// What one Workload of `job` says, and the change of its `spec.active` the run asks for.
fn admission_of(
    job: &str,
    queue_name: &str,
    workload: &QueuedWorkload,
    stopped: bool,
) -> (AdmissionTally, Option<(String, bool)>) {
    let name = &workload.name;
    if stopped {
        let change = workload.active.then(|| (name.clone(), false));
        let tally = AdmissionTally::waiting(
            Reason::Deactivated,
            format!(
                "the run is stopped: Workload {name} of Job {job} is deactivated \
                 (spec.active: false), its pods stopped and its quota released"
            ),
        );
        return (tally, change);
    }
    if !workload.active {
        if workload.stopped_by_run {
            let tally = AdmissionTally::waiting(
                Reason::Queued,
                format!(
                    "Workload {name} of Job {job} is activated again and waits in LocalQueue \
                     {queue_name}"
                ),
            );
            return (tally, Some((name.clone(), true)));
        }
        let tally = AdmissionTally::waiting(
            Reason::Deactivated,
            format!(
                "Workload {name} of Job {job} was deactivated outside the run (by an \
                 administrator, or by Kueue at its requeuing limit): set its spec.active to \
                 true to queue it again"
            ),
        );
        return (tally, None);
    }
    let evicted_before = match workload.evictions {
        0 => String::new(),
        1 => "; evicted once before, its finished batches kept".to_owned(),
        n => format!("; evicted {n} times before, its finished batches kept"),
    };
    let tally = match &workload.admission {
        Queued::Admitted { cluster_queue } => AdmissionTally {
            admitted: true,
            reason: Reason::Admitted,
            message: format!(
                "Job {job} admitted by ClusterQueue {cluster_queue} (Workload {name}){evicted_before}"
            ),
        },
        Queued::Evicted { reason, message } if reason == "Preempted" => AdmissionTally::waiting(
            Reason::Preempted,
            format!(
                "Job {job} was preempted and waits to be admitted again, its finished batches \
                 kept: {message}"
            ),
        ),
        Queued::Evicted { reason, message } => AdmissionTally::waiting(
            Reason::Evicted,
            format!(
                "Job {job} was evicted by Kueue ({reason}) and waits in LocalQueue {queue_name}: \
                 {message}"
            ),
        ),
        Queued::Waiting { message } => AdmissionTally::waiting(
            Reason::Queued,
            format!(
                "Job {job} waits in LocalQueue {queue_name} (Workload {name}): {}{evicted_before}",
                if message.is_empty() {
                    "not admitted yet"
                } else {
                    message
                }
            ),
        ),
        Queued::Finished => AdmissionTally {
            admitted: true,
            reason: Reason::Admitted,
            message: format!("Job {job} finished (Workload {name})"),
        },
    };
    (tally, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(active: bool, stopped_by_run: bool, admission: Queued) -> QueuedWorkload {
        QueuedWorkload {
            name: "job-q-gen-1-x".into(),
            job: "q-gen-1".into(),
            active,
            stopped_by_run,
            admission,
            evictions: 0,
        }
    }

    fn admitted() -> Queued {
        Queued::Admitted {
            cluster_queue: "cq".into(),
        }
    }

    #[test]
    fn a_stopped_run_deactivates_an_active_workload_once() {
        let (tally, change) = admission_of(
            "q-gen-1",
            "team-a",
            &workload(true, false, admitted()),
            true,
        );
        assert_eq!(change, Some(("job-q-gen-1-x".into(), false)));
        assert_eq!((tally.admitted, tally.reason), (false, Reason::Deactivated));
        let (_, change) = admission_of(
            "q-gen-1",
            "team-a",
            &workload(false, true, admitted()),
            true,
        );
        assert_eq!(change, None, "already deactivated: nothing to write");
    }

    #[test]
    fn a_resumed_run_activates_only_what_it_deactivated() {
        let stopped = Queued::Evicted {
            reason: "Deactivated".into(),
            message: String::new(),
        };
        let (tally, change) = admission_of(
            "q-gen-1",
            "team-a",
            &workload(false, true, stopped.clone()),
            false,
        );
        assert_eq!(change, Some(("job-q-gen-1-x".into(), true)));
        assert_eq!(tally.reason, Reason::Queued);
        let (tally, change) =
            admission_of("q-gen-1", "team-a", &workload(false, false, stopped), false);
        assert_eq!(change, None, "someone else's deactivation stays");
        assert_eq!(tally.reason, Reason::Deactivated);
        assert!(tally.message.contains("spec.active"), "{}", tally.message);
    }

    #[test]
    fn a_preempted_or_waiting_workload_says_why_and_an_admitted_one_its_evictions() {
        let preempted = Queued::Evicted {
            reason: "Preempted".into(),
            message: "Preempted to accommodate a workload".into(),
        };
        let (tally, change) = admission_of(
            "q-gen-1",
            "team-a",
            &workload(true, false, preempted),
            false,
        );
        assert_eq!(
            (tally.admitted, tally.reason, change),
            (false, Reason::Preempted, None)
        );
        let waiting = Queued::Waiting {
            message: "insufficient quota for cpu".into(),
        };
        let (tally, _) = admission_of("q-gen-1", "team-a", &workload(true, false, waiting), false);
        assert_eq!(tally.reason, Reason::Queued);
        assert!(tally.message.contains("insufficient quota for cpu"));
        assert!(
            tally.message.contains("LocalQueue team-a"),
            "{}",
            tally.message
        );
        let mut again = workload(true, false, admitted());
        again.evictions = 1;
        let (tally, _) = admission_of("q-gen-1", "team-a", &again, false);
        assert!(tally.admitted);
        assert!(
            tally.message.contains("evicted once before"),
            "{}",
            tally.message
        );
    }
}
