//! What the generation pods waited for their images, in the run's status: each succeeded pod's
//! figure is added in the status write that first records its batch, so that a figure counts once
//! however often the run is reconciled (a write that fails drops both, and the next reconcile
//! adds it again over the same recorded batches).

use std::collections::{BTreeMap, BTreeSet};

use kube::ResourceExt;
use trajectory_worker::contract::PodPull;

use crate::api::{ImagePull, PullStatus};
use crate::reconcile::observe::Observed;

/// The longest waits the status lists.
const LISTED_LONGEST: usize = 5;

/// The status's pull figures (`recorded`: what they cover) with those of the pods whose batches
/// are `done` now and not yet recorded.
pub fn tally(
    recorded_pulls: Option<&PullStatus>,
    observed: &Observed,
    (recorded, done): (&BTreeSet<u32>, &BTreeSet<u32>),
) -> Option<PullStatus> {
    // One pod a batch: the Job controller keeps one succeeded pod an index.
    let mut new: BTreeMap<u32, &PodPull> = BTreeMap::new();
    for report in &observed.pull_reports {
        let Some(attempt) = observed
            .attempts
            .iter()
            .find(|attempt| attempt.job.name_any() == report.job)
        else {
            continue;
        };
        let Some(&id) = attempt.pending.get(report.index as usize) else {
            continue;
        };
        if done.contains(&id) && !recorded.contains(&id) {
            new.entry(id).or_insert(&report.pull);
        }
    }
    if new.is_empty() {
        return recorded_pulls.cloned();
    }
    let mut status = recorded_pulls.cloned().unwrap_or_default();
    for pull in new.into_values() {
        status.pods += 1;
        status.pull_millis += pull.pull_ms;
        status.pod_millis += pull.pod_ms;
        status.longest.push(ImagePull {
            image: pull.image.clone(),
            pull_millis: pull.pull_ms,
        });
    }
    status
        .longest
        .sort_by_key(|pull| std::cmp::Reverse(pull.pull_millis));
    status.longest.truncate(LISTED_LONGEST);
    status.pull_share = share(status.pull_millis, status.pod_millis);
    Some(status)
}

/// `part` as a share of `whole`, in percent with one decimal.
fn share(part: u64, whole: u64) -> String {
    let tenths = (u128::from(part) * 1000)
        .checked_div(u128::from(whole))
        .unwrap_or(0);
    format!("{}.{}%", tenths / 10, tenths % 10)
}

#[cfg(test)]
mod tests {
    use trajectory_worker::contract::PodPull;

    use super::*;
    use crate::fixtures::JobFixture;
    use crate::reconcile::observe::{ObservedAttempt, PullReport};

    fn report(job: &str, index: u32, image: &str, pull_ms: u64) -> PullReport {
        PullReport {
            job: job.to_owned(),
            index,
            pull: PodPull {
                image: image.to_owned(),
                pull_ms,
                start_ms: 200,
                pod_ms: 10_000,
            },
        }
    }

    #[test]
    fn a_pods_wait_counts_once_in_the_write_that_records_its_batch() {
        let job = JobFixture::generation(1).build();
        let name = job.name_any();
        let observed = Observed {
            attempts: vec![ObservedAttempt::new(1, job, vec![4, 5, 6]).unwrap()],
            pull_reports: vec![
                report(&name, 0, "a", 3000),
                report(&name, 1, "b", 1000),
                report(&name, 2, "c", 500),
                report("another-job", 0, "gone", 9000),
            ],
            ..Observed::default()
        };
        // Batch 4 recorded already (its wait counted then); 5 newly done; 6 not done yet.
        let recorded_pulls = PullStatus {
            pods: 1,
            pull_millis: 3000,
            pod_millis: 10_000,
            pull_share: "30.0%".to_owned(),
            longest: vec![ImagePull {
                image: "a".to_owned(),
                pull_millis: 3000,
            }],
        };
        let (recorded, done) = ([4].into(), [4, 5].into());
        let status = tally(Some(&recorded_pulls), &observed, (&recorded, &done)).unwrap();
        assert_eq!(status.pods, 2);
        assert_eq!(status.pull_millis, 4000);
        assert_eq!(status.pod_millis, 20_000);
        assert_eq!(status.pull_share, "20.0%");
        let longest: Vec<&str> = status.longest.iter().map(|p| p.image.as_str()).collect();
        assert_eq!(longest, ["a", "b"]);
        // Once 5 is recorded, nothing new: the figures stay as written.
        let (recorded, done) = ([4, 5].into(), [4, 5].into());
        assert_eq!(
            tally(Some(&status), &observed, (&recorded, &done)),
            Some(status.clone())
        );
    }

    #[test]
    fn the_share_is_a_percentage_with_one_decimal() {
        assert_eq!(share(1, 3), "33.3%");
        assert_eq!(share(0, 0), "0.0%");
        assert_eq!(share(5, 5), "100.0%");
    }
}
