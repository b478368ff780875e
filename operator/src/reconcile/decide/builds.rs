//! The images a round's plan builds (`spec.sandbox.builds`), built before any of their rows'
//! conversations starts.
//!
//! The plan marks each image group whose image is built with its line of the build list
//! ([`ImageGroup::build`]). Until the build Job of the round has reported every line, the run
//! waits (its other images too: the build Job is short next to a run, and one gate is simpler to
//! reason about than a window mixing built and unbuilt images). The reports then resolve the
//! groups: the line cleared, and the failed builds' groups marked ([`ImageGroup::build_failed`]),
//! which the operator keeps in its image index, so that the build Job can go. The rows of a
//! failed build are recorded failed, `image_build_failed`, by a Job that runs nothing of theirs.
//!
//! ```text
//!  groups with lines ──► build Job running ──► complete, every line reported ──► resolved
//!                                │ reports lost (pods gone)         (index kept, Job deleted)
//!                                ▼
//!                        deleted, and built again (what is in the registry is not rebuilt)
//! ```

use std::collections::BTreeMap;

use trajectory_worker::contract::{BuildOutcome, BuildReport, ImageGroup};

use super::{Child, Work};
use crate::api::Phase;
use crate::reconcile::observe::{JobState, Observed};
use crate::reconcile::status::{Outcome, Reason};

/// The round's image groups as far as their builds go.
#[derive(Debug)]
pub enum Built {
    /// Some image is still to be built: what the run shows meanwhile.
    Building {
        groups: Vec<ImageGroup>,
        outcome: Outcome,
    },
    /// Every image can be pulled, or is known not to have been built; `resolved` when the
    /// build reports resolved them in this reconcile (their copy is kept again).
    Ready {
        groups: Vec<ImageGroup>,
        resolved: bool,
    },
}

/// The groups, once their images are built: the build Job created, awaited, and its reports
/// applied to them; the Job deleted once the operator keeps the resolved groups.
pub fn resolve(observed: &Observed, groups: Vec<ImageGroup>, work: &mut Work) -> Built {
    let round = observed.round;
    let lines = groups.iter().filter_map(|group| group.build).max();
    let Some(builds) = lines.map(|last| last + 1) else {
        // Resolved (or nothing built): the build Job, if any, reported all it had to.
        if let Some(job) = &observed.build_job {
            work.delete.extend(job.metadata.name.clone());
        }
        return Built::Ready {
            groups,
            resolved: false,
        };
    };
    let building = |groups, message: String| Built::Building {
        groups,
        outcome: Outcome::Working(Phase::Planning, message),
    };
    let Some(job) = &observed.build_job else {
        work.children.push(Child::Build {
            round,
            builds,
            exists: false,
        });
        return building(groups, format!("building {builds} task images"));
    };
    let reports: BTreeMap<u32, &BuildReport> = observed
        .build_reports
        .iter()
        .map(|report| (report.build, report))
        .collect();
    match JobState::of(job) {
        JobState::Running => {
            work.children.push(Child::Build {
                round,
                builds,
                exists: true,
            });
            let message = format!("building {builds} task images: {} done", reports.len());
            building(groups, message)
        }
        JobState::Failed { message, .. } => Built::Building {
            groups,
            outcome: Outcome::Failed(
                Reason::PlanFailed,
                format!(
                    "the image build Job failed (not a build: the builds report theirs): \
                     {message}"
                ),
            ),
        },
        JobState::Complete if (0..builds).any(|line| !reports.contains_key(&line)) => {
            if !observed.build_pods_gone {
                let missing = (0..builds).find(|line| !reports.contains_key(line));
                return Built::Building {
                    groups,
                    outcome: Outcome::Failed(
                        Reason::PlanFailed,
                        format!(
                            "the image build Job completed without a report of line {} of the \
                             build list in its build container's termination message (is \
                             spec.sandbox.builds.image one that runs trajectory-worker build?)",
                            missing.unwrap_or_default() + 1
                        ),
                    ),
                };
            }
            // Pods gone before their reports were kept (a node scaled down): build again;
            // what was pushed is found in the registry and not built twice.
            work.delete.extend(job.metadata.name.clone());
            let message = format!("building {builds} task images: reports lost, building again");
            building(groups, message)
        }
        JobState::Complete => {
            let resolved = groups
                .into_iter()
                .map(|mut group| {
                    let report = group.build.take().and_then(|line| reports.get(&line));
                    group.built = report.map(|report| report.outcome);
                    if let Some(report) = report.filter(|r| r.outcome == BuildOutcome::Failed) {
                        group.build_failed = Some(
                            report
                                .error
                                .clone()
                                .unwrap_or_else(|| "the build failed".to_owned()),
                        );
                    }
                    group
                })
                .collect();
            Built::Ready {
                groups: resolved,
                resolved: true,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use trajectory_worker::contract::{BuildOutcome, BuildReport, ImageGroup, env, paths};
    use trajectory_worker::spec::ImageBuilds;

    use crate::api::TrajectoryRun;
    use crate::fixtures::{
        JobFixture, ObservedFixture, job_named as job, job_names as names, now, pod_of,
    };
    use crate::reconcile::children::{BUILD_CONTAINER, CONTAINER};
    use crate::reconcile::observe::{IMAGE_INDEX_KEY, Observed};
    use crate::reconcile::{Desired, desired_state};
    use crate::settings::Settings;

    /// Four workers, building into an in-cluster registry with a push Secret.
    fn decide(observed: &Observed) -> Desired {
        let run = TrajectoryRun::test()
            .named("coding-v1")
            .namespace("ns")
            .uid("uid-1")
            .with(|spec| {
                spec.workers = 4;
                spec.dataset.format = trajectory_worker::spec::DatasetFormat::HarborTasks;
                spec.sandbox.builds = Some(ImageBuilds {
                    repository: "registry.ns:5000/envs".into(),
                    insecure: true,
                    push_secret: Some("push".into()),
                    image: None,
                    resources: None,
                });
            })
            .build();
        desired_state(&run, observed, &Settings::default(), &now()).unwrap()
    }

    const BUILT: &str = "registry.ns:5000/envs:aa";
    const BROKEN: &str = "registry.ns:5000/envs:bb";

    /// Five batches: 0 names no image, 1-2 a prebuilt image, 3 and 4 images the run builds
    /// (lines 0 and 1 of its build list).
    fn planned() -> ObservedFixture {
        ObservedFixture::planned(5)
            .images(&[("docker.io/swe/a:1", "1-2"), (BUILT, "3"), (BROKEN, "4")])
            .built_images(&[(BUILT, 0), (BROKEN, 1)])
    }

    fn report(build: u32, image: &str, outcome: BuildOutcome) -> BuildReport {
        BuildReport {
            build,
            image: image.into(),
            outcome,
            seconds: 1.0,
            error: (outcome == BuildOutcome::Failed).then(|| "RUN exit 3: exit status 3".into()),
        }
    }

    fn kept_index(desired: &Desired) -> Vec<ImageGroup> {
        let map = desired
            .children
            .config_maps
            .iter()
            .find(|map| map.metadata.name.as_deref() == Some("coding-v1-images"))
            .expect("the image index is kept");
        map.data.as_ref().unwrap()[IMAGE_INDEX_KEY]
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    /// Before any conversation, a build Job of one index per line of the build list: a
    /// restricted container readies the build from the run's storage, a privileged one that
    /// sees nothing of the run's but the build builds and pushes it.
    #[test]
    fn no_conversation_starts_before_the_build_job_built_the_images() {
        let desired = decide(&planned().build());
        assert_eq!(
            names(&desired),
            ["coding-v1-build"],
            "no generation Job yet"
        );
        assert_eq!(desired.status.phase, Some(crate::api::Phase::Planning));
        let groups = kept_index(&desired);
        assert_eq!(groups[1].build, Some(0), "kept with the builds unresolved");
        let build = job(&desired, "coding-v1-build");
        let spec = build.spec.as_ref().unwrap();
        assert_eq!(
            (spec.completions, spec.completion_mode.as_deref()),
            (Some(2), Some("Indexed"))
        );
        let pod = pod_of(build);
        let context = &pod.init_containers.as_ref().unwrap()[0];
        assert_eq!(context.name, CONTAINER);
        assert_eq!(
            context.args.as_deref(),
            Some(&["build-context".to_owned()][..])
        );
        let context_security = context.security_context.as_ref().unwrap();
        assert_eq!(context_security.run_as_non_root, Some(true));
        let mounts = |c: &k8s_openapi::api::core::v1::Container| -> Vec<String> {
            c.volume_mounts
                .iter()
                .flatten()
                .map(|m| m.mount_path.clone())
                .collect()
        };
        assert!(mounts(context).contains(&paths::STORAGE_ROOT.to_owned()));
        assert!(mounts(context).contains(&paths::BUILD_DIR.to_owned()));
        let builder = &pod.containers[0];
        assert_eq!(builder.name, BUILD_CONTAINER);
        assert_eq!(builder.args.as_deref(), Some(&["build".to_owned()][..]));
        assert_eq!(
            mounts(builder),
            [paths::BUILD_DIR, "/run/trajectory/push-secret"],
            "nothing of the run's but the build and the push credentials"
        );
        let security = builder.security_context.as_ref().unwrap();
        assert_eq!(
            (security.privileged, security.run_as_user),
            (Some(true), Some(0))
        );
        let vars: Vec<&str> = builder
            .env
            .iter()
            .flatten()
            .map(|var| var.name.as_str())
            .collect();
        assert!(vars.contains(&"REGISTRY_AUTH_FILE"), "{vars:?}");
        assert!(
            !vars
                .iter()
                .any(|name| name.contains("API_KEY") || *name == env::STORAGE_ROOT),
            "{vars:?}"
        );
        assert_eq!(pod.automount_service_account_token, Some(false));
        // The API server refuses a failure policy naming a container the pod does not have.
        let named: Vec<&str> = pod
            .containers
            .iter()
            .chain(pod.init_containers.iter().flatten())
            .map(|c| c.name.as_str())
            .collect();
        for rule in &spec.pod_failure_policy.as_ref().unwrap().rules {
            if let Some(container) = rule
                .on_exit_codes
                .as_ref()
                .and_then(|codes| codes.container_name.as_deref())
            {
                assert!(named.contains(&container), "{container} in {named:?}");
            }
        }
    }

    /// Once every line reported, the groups are resolved and kept so, the images built start
    /// as any image does, and the rows of the failed build are recorded failed by a Job that
    /// runs nothing of theirs; the status counts the builds.
    #[test]
    fn a_failed_build_has_its_rows_recorded_and_the_others_run() {
        let reports = vec![
            report(0, BUILT, BuildOutcome::Built),
            report(1, BROKEN, BuildOutcome::Failed),
        ];
        let observed = planned()
            .image_index_kept()
            .build_job(JobFixture::builds().complete().completed("0-1"), reports)
            .build();
        let desired = decide(&observed);
        let groups = kept_index(&desired);
        assert!(
            groups.iter().all(|group| group.build.is_none()),
            "{groups:?}"
        );
        assert_eq!(groups[1].built, Some(BuildOutcome::Built));
        assert_eq!(
            groups[2].build_failed.as_deref(),
            Some("RUN exit 3: exit status 3")
        );
        assert_eq!(
            names(&desired),
            [
                "coding-v1-gen-1",
                "coding-v1-gen-1-1",
                "coding-v1-gen-1-2",
                "coding-v1-gen-1-3-na"
            ]
        );
        let pod = pod_of(job(&desired, "coding-v1-gen-1-3-na"));
        let build_failed = pod.containers[0]
            .env
            .iter()
            .flatten()
            .find(|var| var.name == env::IMAGE_BUILD_FAILED)
            .and_then(|var| var.value.clone())
            .expect("the rows are recorded image_build_failed");
        assert!(
            build_failed.contains(BROKEN) && build_failed.contains("exit status 3"),
            "{build_failed}"
        );
        assert!(
            pod.init_containers
                .iter()
                .flatten()
                .all(|c| !c.name.starts_with("task-"))
        );
        let images = desired.status.images.as_ref().unwrap();
        let builds = images.builds.as_ref().unwrap();
        assert_eq!((builds.built, builds.reused, builds.failed), (1, 0, 1));

        // Kept resolved, the build Job goes.
        let resolved = planned()
            .image_index(groups)
            .build_job(JobFixture::builds().complete().completed("0-1"), Vec::new())
            .build();
        assert_eq!(decide(&resolved).delete, ["coding-v1-build"]);
    }

    /// A complete build Job whose pods went before their reports were kept (a node scaled
    /// down) is built again: what it pushed is found in the registry then. One whose pods are
    /// there and said nothing (a build image that is not the worker's) fails the run, rather
    /// than build forever.
    #[test]
    fn lost_reports_are_built_again_and_missing_ones_fail_the_run() {
        let complete = || {
            planned().image_index_kept().build_job(
                JobFixture::builds().complete().completed("0-1"),
                vec![report(0, BUILT, BuildOutcome::Built)],
            )
        };
        let desired = decide(&complete().build_pods_gone().build());
        assert_eq!(desired.delete, ["coding-v1-build"]);
        assert!(names(&desired).is_empty(), "{:?}", names(&desired));

        let desired = decide(&complete().build());
        assert_eq!(desired.status.phase, Some(crate::api::Phase::Failed));
        assert!(desired.delete.is_empty());
        let failed = desired
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "Failed");
        assert!(
            failed.is_some_and(|c| c.message.contains("without a report of line 2")),
            "{:?}",
            desired.status.conditions
        );

        let failed = planned()
            .image_index_kept()
            .build_job(
                JobFixture::builds().failed("BackoffLimitExceeded"),
                Vec::new(),
            )
            .build();
        let desired = decide(&failed);
        assert_eq!(desired.status.phase, Some(crate::api::Phase::Failed));
    }
}
