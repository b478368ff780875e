//! Table tests of the pure middle of the pipeline ([`desired_state`]: validate → decide → build →
//! status), with the fixtures' runs, Jobs and observations.

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use trajectory_worker::contract::RunPlan;

use super::children::{MAX_ROUNDS, labels};
use super::status::{Reason, StatusWrite, set_condition, status_write};
use super::*;
use crate::api::ConditionType;
use crate::fixtures::{JobFixture, ObservedFixture, now};

/// The run every table starts from: `r` in `ns`, two retries per batch, at most one batch missing.
fn run() -> TrajectoryRun {
    TrajectoryRun::test()
        .named("r")
        .namespace("ns")
        .uid("uid-1")
        .retry(2, 1)
        .build()
}

fn decide(observed: &Observed) -> Desired {
    desired_state(&run(), observed, &Settings::default(), &now()).unwrap()
}

fn names(desired: &Desired) -> Vec<String> {
    desired
        .children
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

/// The message of the run's `Failed` condition.
fn failed_message(desired: &Desired) -> &str {
    let failed = desired
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == ConditionType::Failed.as_str())
        .expect("a Failed condition");
    &failed.message
}

fn plan_batches(desired: &Desired, name: &str) -> Option<Vec<u32>> {
    run_plan(desired, name).batches
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
    let desired = decide(&ObservedFixture::planned(5).done(0, 1).build());
    assert_eq!(names(&desired), ["r-gen-1"]);
    assert_eq!(plan_batches(&desired, "r-gen-1"), Some(vec![2, 3, 4]));
    assert_eq!(
        desired.children.jobs[0].spec.as_ref().unwrap().completions,
        Some(3)
    );
    assert_eq!(desired.status.progress.as_deref(), Some("2/5"));
    assert_eq!(desired.status.attempt, Some(1));
    let prompts = desired.status.prompts.as_ref().unwrap();
    assert_eq!((prompts.total, prompts.invalid), (50, 2));
}

#[test]
fn a_running_attempt_reports_batches_through_its_pending_list() {
    let observed = ObservedFixture::planned(5)
        .done(0, 1)
        .attempt(JobFixture::generation(1).completed("0,2"), &[2, 3, 4])
        .build();
    let desired = decide(&observed);
    assert_eq!(names(&desired), ["r-gen-1"]);
    assert!(desired.children.config_maps.is_empty());
    let batches = desired.status.batches.as_ref().unwrap();
    assert_eq!(batches.completed, "0-2,4");
    assert_eq!(desired.status.progress.as_deref(), Some("4/5"));
    assert_eq!(desired.status.phase, Some(Phase::Running));
}

#[test]
fn an_attempt_that_left_batches_undone_is_followed_by_one_for_them_only() {
    let observed = ObservedFixture::planned(5)
        .attempt(
            JobFixture::generation(1)
                .complete()
                .completed("0-2,4")
                .failed_indexes("3"),
            &[0, 1, 2, 3, 4],
        )
        .build();
    let desired = decide(&observed);
    assert_eq!(names(&desired), ["r-gen-2"]);
    assert_eq!(plan_batches(&desired, "r-gen-2"), Some(vec![3]));
    assert_eq!(desired.status.batches.as_ref().unwrap().failed, "3");
    assert_eq!(desired.status.attempt, Some(2));
}

#[test]
fn after_the_last_attempt_the_run_merges_what_is_done_within_the_failure_budget() {
    let observed = ObservedFixture::planned(3)
        .attempt(
            JobFixture::generation(1)
                .complete()
                .completed("0-1")
                .failed_indexes("2"),
            &[0, 1, 2],
        )
        .attempt(
            JobFixture::generation(2).complete().failed_indexes("0"),
            &[2],
        )
        .attempt(
            JobFixture::generation(3).complete().failed_indexes("0"),
            &[2],
        )
        .build();
    assert_eq!(names(&decide(&observed)), ["r-merge"]);
}

#[test]
fn too_many_missing_batches_after_the_last_attempt_fail_the_run() {
    let observed = ObservedFixture::planned(3)
        .attempt(
            JobFixture::generation(1)
                .complete()
                .completed("0")
                .failed_indexes("1-2"),
            &[0, 1, 2],
        )
        .attempt(
            JobFixture::generation(2).complete().failed_indexes("0-1"),
            &[1, 2],
        )
        .attempt(
            JobFixture::generation(3).complete().failed_indexes("0-1"),
            &[1, 2],
        )
        .build();
    let desired = decide(&observed);
    assert!(desired.children.jobs.is_empty());
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
        let observed = ObservedFixture::planned(3)
            .attempt(JobFixture::generation(1).failed(job_reason), &[0, 1, 2])
            .build();
        let desired = decide(&observed);
        assert_eq!(desired.status.phase, Some(Phase::Failed), "{job_reason}");
        assert_eq!(
            condition(&desired, ConditionType::Failed),
            ("True", run_reason)
        );
        assert_eq!(desired.status.completion_time, Some(now()));
    }
    let observed = ObservedFixture::new()
        .plan(JobFixture::plan().failed("BackoffLimitExceeded"))
        .build();
    let desired = decide(&observed);
    assert_eq!(
        condition(&desired, ConditionType::Failed),
        ("True", "PlanFailed")
    );
}

#[test]
fn a_finished_merge_succeeds_the_run_with_its_output() {
    let desired = decide(&ObservedFixture::merged(2, 19).build());
    assert!(desired.children.jobs.is_empty());
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
    assert_eq!(desired.status.verification, None, "nothing was verified");
}

#[test]
fn a_merge_that_priced_records_puts_their_cost_in_the_status() {
    let unpriced = decide(&ObservedFixture::merged(2, 19).build());
    assert_eq!(unpriced.status.cost, None, "nothing was priced");
    let desired = decide(&ObservedFixture::merged(2, 19).priced("12.3456").build());
    assert_eq!(
        desired.status.cost,
        Some(crate::api::CostStatus {
            spent: "12.3456".to_owned(),
            projected: None,
            currency: "USD".to_owned(),
            exhausted_budget: None,
        })
    );
}

/// [`run`] with prices, and a budget of `max_cost` USD when given.
fn priced_run(max_cost: Option<f64>) -> TrajectoryRun {
    TrajectoryRun::test()
        .named("r")
        .namespace("ns")
        .retry(2, 1)
        .with(|spec| {
            spec.model.pricing = Some(trajectory_worker::spec::PricingSpec {
                input: Some(1.0),
                output: Some(2.0),
                ..Default::default()
            });
            spec.model.budget =
                max_cost.map(|max_cost| trajectory_worker::spec::BudgetSpec { max_cost });
        })
        .build()
}

#[test]
fn while_batches_run_the_status_shows_what_was_spent_and_what_the_run_will_cost() {
    let priced = priced_run(None);
    let mut observed = ObservedFixture::planned(4)
        .attempt(JobFixture::generation(1).completed("0"), &[0, 1, 2, 3])
        .build();
    let cost = |run: &TrajectoryRun, observed: &Observed| {
        let status = desired_state(run, observed, &Settings::default(), &now())
            .unwrap()
            .status;
        status.cost.map(|cost| (cost.spent, cost.projected))
    };
    assert_eq!(cost(&priced, &observed), None, "no pod reported yet");
    observed.run_spent = Some(1.25);
    assert_eq!(
        cost(&priced, &observed),
        Some(("1.25".to_owned(), Some("5".to_owned()))),
        "one batch of four done: four times as much in all"
    );
    // The pod that reported more is gone: what the status showed stands.
    let mut shown = priced.clone();
    shown.status = Some(crate::api::TrajectoryRunStatus {
        cost: Some(crate::api::CostStatus {
            spent: "2.5".to_owned(),
            projected: None,
            currency: "USD".to_owned(),
            exhausted_budget: None,
        }),
        ..Default::default()
    });
    assert_eq!(
        cost(&shown, &observed).map(|(spent, _)| spent),
        Some("2.5".to_owned())
    );
}

#[test]
fn a_run_at_its_budget_is_held_suspended_until_the_budget_is_raised() {
    let with_budget = |max_cost: f64| priced_run(Some(max_cost));
    let mut observed = ObservedFixture::planned(3)
        .attempt(JobFixture::generation(1).completed("0"), &[0, 1, 2])
        .build();
    let desired = |run: &TrajectoryRun, observed: &Observed| {
        desired_state(run, observed, &Settings::default(), &now()).unwrap()
    };
    let suspend = |desired: &Desired| desired.children.jobs[0].spec.as_ref().unwrap().suspend;
    let budget_in_plan = |desired: &Desired| {
        run_plan(desired, "r-gen-1")
            .spec
            .model
            .budget
            .map(|budget| budget.max_cost)
    };

    let running = desired(&with_budget(2.0), &observed);
    assert_eq!(suspend(&running), Some(false));
    assert_eq!(
        condition(&running, ConditionType::Suspended),
        ("False", "Resumed")
    );

    // A pod stopped at 2 USD: the Job is held, and the run says why.
    observed.budget_exhausted_at = Some(2.0);
    observed.run_spent = Some(2.0);
    let held = desired(&with_budget(2.0), &observed);
    assert_eq!(names(&held), ["r-gen-1"]);
    assert_eq!(suspend(&held), Some(true));
    assert_eq!(
        condition(&held, ConditionType::Suspended),
        ("True", "BudgetExhausted")
    );
    assert_eq!(condition(&held, ConditionType::Reconciling).0, "False");
    assert_eq!(held.status.phase, Some(Phase::Running));
    assert_eq!(
        held.status.progress.as_deref(),
        Some("1/3"),
        "what is done stays done"
    );

    assert_eq!(
        held.status
            .cost
            .as_ref()
            .and_then(|cost| cost.exhausted_budget.as_deref()),
        Some("2")
    );
    // The pods that said so are gone (the Job controller removes them once it is suspended):
    // the status holds it still. (The flaw: the Job was let go, its new pods found the budget
    // spent and stopped, and the run went back and forth between held and running.)
    let mut shown = with_budget(2.0);
    shown.status = Some(held.status.clone());
    let mut gone = observed.clone();
    gone.budget_exhausted_at = None;
    gone.run_spent = None;
    let still = desired(&shown, &gone);
    assert_eq!(suspend(&still), Some(true));
    assert_eq!(
        condition(&still, ConditionType::Suspended),
        ("True", "BudgetExhausted")
    );
    let mut raised_run = with_budget(5.0);
    raised_run.status = Some(held.status.clone());
    let raised = desired(&raised_run, &gone);
    assert_eq!(suspend(&raised), Some(false));
    assert_eq!(
        raised.status.cost.and_then(|cost| cost.exhausted_budget),
        None
    );

    // Raised: the same Job runs on, its plan (which the pods it starts read) holding the new
    // budget; the pods that stopped at the old one no longer hold it.
    let raised = desired(&with_budget(5.0), &observed);
    assert_eq!(names(&raised), ["r-gen-1"]);
    assert_eq!(suspend(&raised), Some(false));
    assert_eq!(budget_in_plan(&raised), Some(5.0));
    assert_eq!(
        condition(&raised, ConditionType::Suspended),
        ("False", "Resumed")
    );
    assert_eq!(
        condition(&raised, ConditionType::Reconciling),
        ("True", "Generating")
    );
}

#[test]
fn a_merge_that_counted_verified_records_puts_them_in_the_status() {
    let desired = decide(&ObservedFixture::merged(2, 19).verified(20, 12).build());
    assert_eq!(
        desired.status.verification,
        Some(crate::api::VerificationStatus {
            verified: 20,
            passed: 12
        })
    );
}

#[test]
fn an_invalid_spec_stalls_the_run_naming_the_field() {
    let run = TrajectoryRun::test()
        .named("r")
        .with(|spec| spec.batch_size = 0)
        .build();
    let desired = desired_state(&run, &Observed::default(), &Settings::default(), &now()).unwrap();
    assert!(desired.children.jobs.is_empty());
    assert_eq!(
        condition(&desired, ConditionType::Failed),
        ("True", "InvalidSpec")
    );
    let message = failed_message(&desired);
    assert!(message.contains("spec.batchSize"), "{message}");
}

#[test]
fn deciding_twice_changes_nothing() {
    let mut run = run();
    let observed = ObservedFixture::planned(5).done(0, 1).build();
    let first = desired_state(&run, &observed, &Settings::default(), &now()).unwrap();
    run.status = Some(first.status.clone());
    let later = Time(Timestamp::from_second(20_000).unwrap());
    let second = desired_state(&run, &observed, &Settings::default(), &later).unwrap();
    assert_eq!(first.status, second.status);
}

#[test]
fn progress_alone_is_written_at_most_once_per_interval_and_anything_else_at_once() {
    let interval = Duration::from_secs(3);
    let running = ObservedFixture::planned(5)
        .attempt(JobFixture::generation(1), &[0, 1, 2, 3, 4])
        .build();
    let written = decide(&running).status;
    let moved = ObservedFixture::planned(5)
        .attempt(JobFixture::generation(1).completed("0-1"), &[0, 1, 2, 3, 4])
        .build();
    let progressed = decide(&moved).status;
    assert_eq!(progressed.progress.as_deref(), Some("2/5"));
    let merging = ObservedFixture::planned(5)
        .done(0, 4)
        .attempt(JobFixture::generation(1).completed("0-1"), &[0, 1, 2, 3, 4])
        .build();
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

    // Images pulled, the pods' waits for them and money spent move as batches finish: progress
    // too. An image that cannot be pulled, or a run held at its budget, is news.
    let with_images = |pulled: u32, unavailable| TrajectoryRunStatus {
        images: Some(crate::api::ImageStatus {
            total: 3_500,
            pulled,
            unavailable,
            unavailable_images: Vec::new(),
            builds: None,
            pulls: Some(crate::api::PullStatus {
                pods: u64::from(pulled),
                pull_millis: u64::from(pulled) * 1000,
                pod_millis: 100_000,
                ..crate::api::PullStatus::default()
            }),
        }),
        cost: Some(crate::api::CostStatus {
            spent: format!("{pulled}.5"),
            projected: Some("9.0".into()),
            currency: "USD".into(),
            exhausted_budget: None,
        }),
        ..written.clone()
    };
    let (before, pulled_one, unpullable) =
        (with_images(10, 0), with_images(11, 0), with_images(10, 1));
    assert_eq!(
        status_write(Some(&before), &pulled_one, Some(second), interval),
        StatusWrite::After(2 * second)
    );
    assert_eq!(
        status_write(Some(&before), &unpullable, Some(second), interval),
        StatusWrite::Now
    );
    let mut held = before.clone();
    if let Some(cost) = held.cost.as_mut() {
        cost.exhausted_budget = Some("10".into());
    }
    assert_eq!(
        status_write(Some(&before), &held, Some(second), interval),
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
    let running = ObservedFixture::planned(5)
        .done(0, 1)
        .attempt(JobFixture::generation(1).completed("2"), &[2, 3, 4]);
    let with_pod = decide_with(None, &running.clone().build());
    assert_eq!(with_pod.status.progress.as_deref(), Some("3/5"));

    let observed = running.clone().without_plan_summary().build();
    let without_pod = decide_with(Some(with_pod.status.clone()), &observed);
    assert_eq!(names(&without_pod), names(&with_pod));
    assert_eq!(without_pod.status, with_pod.status);

    // Nothing recorded yet: the plan runs again (its Job goes, to be made anew), never
    // guessing its batches.
    let unrecorded = decide_with(None, &observed);
    assert_eq!(
        unrecorded.delete,
        ["coding-v1-plan"],
        "the observed plan Job"
    );
    assert!(unrecorded.children.jobs.is_empty());
    assert_eq!(unrecorded.status.phase, Some(Phase::Planning));
    // A plan pod that succeeded without a summary is not this project's worker: the run fails,
    // saying so, rather than planning again and again.
    let silent = decide_with(None, &running.silent_plan_pod().build());
    assert_eq!(
        condition(&silent, ConditionType::Failed),
        ("True", "PlanFailed")
    );

    // A succeeded run keeps its counts when both pods are gone.
    let merged = ObservedFixture::merged(5, 48);
    let succeeded = decide_with(None, &merged.clone().build()).status;
    let merged = merged
        .without_plan_summary()
        .without_merge_summary()
        .build();
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

    let done = ObservedFixture::planned(2)
        .done(0, 1)
        .merge(JobFixture::merge().complete())
        .build();
    let succeeded = decide(&done).status;
    assert_eq!(holds(&succeeded), ["Ready", "Succeeded"]);

    let failed = ObservedFixture::planned(3)
        .attempt(
            JobFixture::generation(1).failed("PodFailurePolicy"),
            &[0, 1, 2],
        )
        .build();
    let failed = decide(&failed).status;
    assert_eq!(holds(&failed), ["Failed", "Stalled"]);

    let suspended = TrajectoryRun::test()
        .named("r")
        .namespace("ns")
        .retry(2, 1)
        .suspended()
        .build();
    let observed = ObservedFixture::planned(3)
        .attempt(JobFixture::generation(1), &[0, 1, 2])
        .build();
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

/// However a spec is wrong, no builder sees it: a spec that breaks its own rules ends the run with
/// no children, and one the operator cannot build from is an error.
#[test]
fn a_spec_that_fails_validation_never_reaches_a_builder() {
    let refused = [
        TrajectoryRun::test().with(|spec| spec.batch_size = 0),
        TrajectoryRun::test().with(|spec| spec.workers = 0),
    ];
    for run in refused {
        let desired = desired_state(
            &run.build(),
            &ObservedFixture::planned(3).build(),
            &Settings::default(),
            &now(),
        )
        .expect("a refused spec is a decision");
        assert!(desired.children.jobs.is_empty());
        assert!(desired.children.config_maps.is_empty());
        assert_eq!(desired.status.phase, Some(Phase::Failed));
    }
    let invalid = [
        TrajectoryRun::test().with(|spec| spec.storage.volume = None),
        TrajectoryRun::test().with_pod_template(serde_json::json!({"image": 7})),
        TrajectoryRun::test().named(&"r".repeat(60)),
        TrajectoryRun::test().without_uid(),
    ];
    for run in invalid {
        let run = run.build();
        let result = desired_state(&run, &Observed::default(), &Settings::default(), &now());
        assert!(result.is_err(), "{:?} has no children", run.metadata.name);
    }
}

/// A distribution this build cannot serve is refused by the operator itself, naming the field,
/// before a plan pod starts.
#[test]
fn an_unknown_or_unavailable_distribution_fails_the_run_before_any_pod() {
    use trajectory_worker::spec::DistributionSpec;
    let cases = [
        (
            DistributionSpec::Named("researh".into()),
            "spec.distribution: unknown distribution \"researh\"",
        ),
        (
            DistributionSpec::Named("research".into()),
            "spec.tools.web.search: required because distribution \"research\" draws toolset web",
        ),
        (
            DistributionSpec::Inline([("terminl".to_owned(), 100.0)].into()),
            "spec.distribution.terminl: unknown toolset \"terminl\"",
        ),
    ];
    for (distribution, message) in cases {
        let run = TrajectoryRun::test()
            .with(|spec| spec.distribution = distribution.clone())
            .build();
        let desired = desired_state(&run, &Observed::default(), &Settings::default(), &now())
            .expect("a refused spec is a decision");
        assert!(desired.children.jobs.is_empty(), "{distribution:?}");
        assert_eq!(
            condition(&desired, ConditionType::Failed),
            ("True", "InvalidSpec")
        );
        let failed = failed_message(&desired);
        assert!(failed.contains(message), "{failed}");
    }
}

/// An attempt of more batches than one Job may hold (Kubernetes' 100,000 completions with
/// `backoffLimitPerIndex`) runs as several Jobs: each works a slice, named `-gen-N-S` past the
/// first, with the run's workers split over them and its pending slice in compact ranges.
#[test]
fn an_attempt_of_more_batches_than_a_job_holds_runs_as_several_jobs() {
    let run = TrajectoryRun::test()
        .named("r")
        .namespace("ns")
        .with(|spec| spec.workers = 8)
        .build();
    let decide =
        |observed: &Observed| desired_state(&run, observed, &Settings::default(), &now()).unwrap();
    let desired = decide(&ObservedFixture::planned(250_001).build());
    assert_eq!(names(&desired), ["r-gen-1", "r-gen-1-1", "r-gen-1-2"]);
    let specs: Vec<(Option<i32>, Option<i32>)> = desired
        .children
        .jobs
        .iter()
        .map(|job| {
            let spec = job.spec.as_ref().unwrap();
            (spec.completions, spec.parallelism)
        })
        .collect();
    assert_eq!(
        specs,
        [
            (Some(100_000), Some(3)),
            (Some(100_000), Some(3)),
            (Some(50_001), Some(2))
        ]
    );
    let shard_labels: Vec<Option<&str>> = desired
        .children
        .jobs
        .iter()
        .map(|job| {
            job.metadata
                .labels
                .as_ref()
                .unwrap()
                .get(labels::SHARD)
                .map(String::as_str)
        })
        .collect();
    assert_eq!(shard_labels, [None, Some("1"), Some("2")]);
    // Each shard's plan: identity for the first; ranges (and no long list) for the others; all small.
    let plans: Vec<(Option<String>, bool)> = desired
        .children
        .config_maps
        .iter()
        .map(|map| {
            let text = &map.data.as_ref().unwrap()["plan.json"];
            assert!(text.len() < 4096, "{} bytes", text.len());
            let plan: RunPlan = serde_json::from_str(text).unwrap();
            (plan.batch_ranges, plan.batches.is_some())
        })
        .collect();
    assert_eq!(
        plans,
        [
            (None, false),
            (Some("100000-199999".into()), false),
            (Some("200000-250000".into()), false)
        ]
    );
    assert_eq!(desired.status.attempt, Some(1));

    // The first shard finished: the other two share all the workers; progress counts every shard.
    let observed = ObservedFixture::planned(250_001)
        .attempt(
            JobFixture::generation(1).complete().completed("0-99999"),
            &(0..100_000).collect::<Vec<u32>>(),
        )
        .attempt(
            JobFixture::generation(1).shard(1).completed("0-9"),
            &(100_000..200_000).collect::<Vec<u32>>(),
        )
        .attempt(
            JobFixture::generation(1).shard(2),
            &(200_000..250_001).collect::<Vec<u32>>(),
        )
        .build();
    let running = decide(&observed);
    assert_eq!(names(&running), ["r-gen-1-1", "r-gen-1-2"]);
    let parallelism: Vec<Option<i32>> = running
        .children
        .jobs
        .iter()
        .map(|job| job.spec.as_ref().unwrap().parallelism)
        .collect();
    assert_eq!(parallelism, [Some(4), Some(4)]);
    assert!(running.children.config_maps.is_empty());
    assert_eq!(running.status.progress.as_deref(), Some("100010/250001"));
    assert_eq!(
        running.status.batches.as_ref().unwrap().completed,
        "0-100009"
    );
}

#[test]
fn a_failure_in_any_shard_is_the_attempt_s() {
    let run = TrajectoryRun::test()
        .named("r")
        .namespace("ns")
        .retry(2, 1)
        .build();
    let decide =
        |observed: &Observed| desired_state(&run, observed, &Settings::default(), &now()).unwrap();
    let shard_of = |shard: u32| -> Vec<u32> { (shard * 100_000..(shard + 1) * 100_000).collect() };
    let config_error = ObservedFixture::planned(200_000)
        .attempt(JobFixture::generation(1), &shard_of(0))
        .attempt(
            JobFixture::generation(1)
                .shard(1)
                .failed("PodFailurePolicy"),
            &shard_of(1),
        )
        .build();
    assert_eq!(
        condition(&decide(&config_error), ConditionType::Failed),
        ("True", "WorkerConfigError")
    );
    // Each Job allows one failed index; two across them exceed the run's limit of one.
    let failed = ObservedFixture::planned(200_000)
        .attempt(JobFixture::generation(1).failed_indexes("5"), &shard_of(0))
        .attempt(
            JobFixture::generation(1).shard(1).failed_indexes("7"),
            &shard_of(1),
        )
        .build();
    let desired = decide(&failed);
    assert_eq!(
        condition(&desired, ConditionType::Failed),
        ("True", "TooManyFailedBatches")
    );
    assert_eq!(desired.status.batches.as_ref().unwrap().failed, "5,100007");
}

#[test]
fn a_run_name_too_long_for_its_tenth_job_fails_the_run_naming_it() {
    let name = "r".repeat(55);
    let run = TrajectoryRun::test().named(&name).build();
    let fits = desired_state(
        &run,
        &ObservedFixture::planned(1_000_000).build(),
        &Settings::default(),
        &now(),
    )
    .unwrap();
    assert_eq!(fits.children.jobs.len(), 10);
    let desired = desired_state(
        &run,
        &ObservedFixture::planned(1_000_001).build(),
        &Settings::default(),
        &now(),
    )
    .unwrap();
    assert!(desired.children.jobs.is_empty());
    assert_eq!(
        condition(&desired, ConditionType::Failed),
        ("True", "InvalidSpec")
    );
    assert!(
        failed_message(&desired).contains("too long for the 11 Jobs"),
        "{}",
        failed_message(&desired)
    );
}

/// A worker that stopped on a configuration error says why in its termination message: a reason
/// a run can fail with becomes the run's, and the message carries the worker's words.
#[test]
fn the_worker_s_reason_for_a_configuration_error_is_the_run_s() {
    let failed_with = |reason: &str| {
        ObservedFixture::planned(3)
            .attempt(
                JobFixture::generation(1).failed("PodFailurePolicy"),
                &[0, 1, 2],
            )
            .worker_failure(reason, "the model server refused the API key (HTTP 401)")
            .build()
    };
    let desired = decide(&failed_with("ModelUnauthorized"));
    assert_eq!(
        condition(&desired, ConditionType::Failed),
        ("True", "ModelUnauthorized")
    );
    assert_eq!(
        failed_message(&desired),
        "a worker stopped on a configuration error no retry can fix: ModelUnauthorized: the model server refused the API key (HTTP 401)"
    );
    for (worker, run) in [
        ("ModelNotFound", "ModelNotFound"),
        ("StorageReadOnly", "StorageReadOnly"),
        // A reason a run does not fail with keeps the generic one; the message still says it.
        ("OutputInUse", "WorkerConfigError"),
    ] {
        let desired = decide(&failed_with(worker));
        assert_eq!(condition(&desired, ConditionType::Failed), ("True", run));
        assert!(failed_message(&desired).contains(worker), "{worker}");
    }
    let plan = ObservedFixture::new()
        .plan(JobFixture::plan().failed("PodFailurePolicy"))
        .plan_failure("InvalidDataset", "datasets/prompts.jsonl: no valid line")
        .build();
    let desired = decide(&plan);
    assert_eq!(
        condition(&desired, ConditionType::Failed),
        ("True", "PlanFailed")
    );
    assert_eq!(
        failed_message(&desired),
        "the plan Job failed: InvalidDataset: datasets/prompts.jsonl: no valid line"
    );
}

/// The labels of the child Job `name` of a decision.
fn job_labels<'a>(
    desired: &'a Desired,
    name: &str,
) -> &'a std::collections::BTreeMap<String, String> {
    desired
        .children
        .jobs
        .iter()
        .find(|job| job.metadata.name.as_deref() == Some(name))
        .and_then(|job| job.metadata.labels.as_ref())
        .unwrap_or_else(|| panic!("no Job {name} with labels"))
}

#[test]
fn a_merge_that_finds_batches_incomplete_starts_a_round_that_plans_them_again() {
    let incomplete = "batch 4 is marked done but lacks prompt 41 sample 0; its marker was removed";
    let failed_merge = |round: u32| {
        ObservedFixture::merged(5, 50)
            .round(round)
            .merge(JobFixture::merge_of_round(round).failed("PodFailurePolicy"))
            .merge_failure("IncompleteBatch", incomplete)
    };

    let desired = decide(&failed_merge(1).build());
    assert_eq!(names(&desired), ["r-plan-2"]);
    assert_eq!(job_labels(&desired, "r-plan-2")[labels::ROUND], "2");
    assert_eq!(desired.status.phase, Some(Phase::Planning));

    // Round 2's plan found batch 4 pending again: its attempts are numbered on from round 1's.
    let replanned = ObservedFixture::planned(5)
        .done(0, 3)
        .plan(JobFixture::plan_of_round(2).complete())
        .round(2);
    let desired = decide(&replanned.clone().build());
    assert_eq!(names(&desired), ["r-gen-4"]);
    assert_eq!(plan_batches(&desired, "r-gen-4"), Some(vec![4]));
    assert_eq!(job_labels(&desired, "r-gen-4")[labels::ROUND], "2");
    assert_eq!(desired.status.attempt, Some(4));

    // Its attempts get the round's own budget: two more after a failed first one.
    let retried = replanned.clone().attempt(
        JobFixture::generation(4).complete().failed_indexes("0"),
        &[4],
    );
    assert_eq!(names(&decide(&retried.build())), ["r-gen-5"]);
    let regenerated = replanned.attempt(JobFixture::generation(4).complete().completed("0"), &[4]);
    assert_eq!(names(&decide(&regenerated.build())), ["r-merge-2"]);

    // The last round's merge failing so fails the run; so does any other merge failure at once.
    let desired = decide(&failed_merge(MAX_ROUNDS).build());
    assert!(desired.children.jobs.is_empty());
    assert_eq!(
        condition(&desired, ConditionType::Failed),
        ("True", "MergeFailed")
    );
    assert!(
        failed_message(&desired).contains(incomplete),
        "{}",
        failed_message(&desired)
    );
    let other = ObservedFixture::merged(5, 50)
        .merge(JobFixture::merge().failed("PodFailurePolicy"))
        .merge_failure("OutputMismatch", "the output directory holds another run");
    assert_eq!(
        condition(&decide(&other.build()), ConditionType::Failed),
        ("True", "MergeFailed")
    );
}

/// A later round's plan pod gone before its summary was recorded: the status still shows the
/// round before, whose batches include those the last merge reopened. Falling back on it (as the
/// operator did) skipped them, and the run ended `MergeFailed`; now the round plans again.
#[test]
fn a_later_rounds_plan_pod_lost_before_its_summary_is_recorded_is_planned_again() {
    let decide_with = |status: &TrajectoryRunStatus, observed: &Observed| {
        let mut run = run();
        run.status = Some(status.clone());
        desired_state(&run, observed, &Settings::default(), &now()).unwrap()
    };
    // Round 1 recorded all five batches done; its merge found batch 4 incomplete.
    let round_one = decide(&ObservedFixture::merged(5, 50).build()).status;
    assert_eq!(round_one.batches.as_ref().unwrap().completed, "0-4");
    let replanned = ObservedFixture::planned(5)
        .done(0, 3)
        .plan(JobFixture::plan_of_round(2).complete())
        .round(2);

    let lost = decide_with(
        &round_one,
        &replanned.clone().without_plan_summary().build(),
    );
    assert_eq!(lost.delete, ["coding-v1-plan-2"], "round 2 plans again");
    assert!(
        lost.children.jobs.is_empty(),
        "no merge over round 1's batches"
    );
    assert_eq!(lost.status.phase, Some(Phase::Planning));

    // Once round 2's summary was recorded, its pod may go: the status stands in for it.
    let recorded = decide_with(&round_one, &replanned.clone().build());
    assert_eq!(recorded.status.plan_round, Some(2));
    assert_eq!(names(&recorded), ["r-gen-4"]);
    let gone = decide_with(&recorded.status, &replanned.without_plan_summary().build());
    assert_eq!(names(&gone), ["r-gen-4"]);
    assert_eq!(plan_batches(&gone, "r-gen-4"), Some(vec![4]));
}

#[test]
fn the_incomplete_batch_reason_is_the_one_the_worker_reports() {
    let reported = trajectory_worker::run::RunError::IncompleteBatch(String::new()).reason();
    assert_eq!(reported, decide::INCOMPLETE_BATCH);
}

/// The plan of the `ConfigMap` `name` of a decision.
fn run_plan(desired: &Desired, name: &str) -> RunPlan {
    let map = desired
        .children
        .config_maps
        .iter()
        .find(|m| m.metadata.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no ConfigMap {name}"));
    serde_json::from_str(&map.data.as_ref().unwrap()["plan.json"]).unwrap()
}

#[test]
fn a_plan_with_its_pending_list_on_storage_is_worked_by_slots_of_that_list() {
    const LIST: &str = "plan/pending-00000000000000aa.ranges";
    // A million batches, 400,000 of them done at random by an earlier run.
    let scattered = ObservedFixture::planned(1_000_000).scattered(400_000, 9, LIST);
    let desired = decide(&scattered.clone().build());
    let shards: Vec<String> = (0..6)
        .map(|shard| match shard {
            0 => "r-gen-1".to_owned(),
            shard => format!("r-gen-1-{shard}"),
        })
        .collect();
    assert_eq!(names(&desired), shards);
    for (shard, name) in (0_u32..).zip(&shards) {
        let plan = run_plan(&desired, name);
        assert_eq!(plan.pending_list.as_deref(), Some(LIST), "{name}");
        let first = shard * 100_000;
        assert_eq!(
            plan.batch_ranges,
            Some(format!("{first}-{}", first + 99_999)),
            "{name}"
        );
        assert_eq!(plan.batches, None, "slots are never listed as batch ids");
        let job = desired
            .children
            .jobs
            .iter()
            .find(|job| job.metadata.name.as_ref() == Some(name))
            .unwrap();
        assert_eq!(job.spec.as_ref().unwrap().completions, Some(100_000));
    }
    let counts = desired.status.batches.clone().unwrap();
    assert_eq!(
        (counts.total, counts.completed_count, counts.failed_count),
        (1_000_000, 400_000, 0)
    );
    assert_eq!(
        (counts.completed.as_str(), counts.failed.as_str()),
        ("", "")
    );
    let list = counts.pending_list.clone().unwrap();
    assert_eq!((list.path.as_str(), list.batches), (LIST, 600_000));
    assert_eq!(desired.status.progress.as_deref(), Some("400000/1000000"));

    // A later attempt works the slots the first left undone, in the same list.
    let slots: Vec<u32> = (0..100_000).collect();
    let mut observed = scattered.clone();
    for (shard, first) in (0_u32..6).zip((0_u32..).step_by(100_000)) {
        let job = JobFixture::generation(1).shard(shard).complete();
        let job = if shard == 2 {
            job.completed("0-41,43-99999").failed_indexes("42")
        } else {
            job.completed("0-99999")
        };
        let ids: Vec<u32> = slots.iter().map(|slot| first + slot).collect();
        observed = observed.attempt(job, &ids);
    }
    let mut observed = observed.build();
    for attempt in &mut observed.attempts {
        attempt.pending_list = Some(LIST.to_owned());
    }
    let retried = decide(&observed);
    assert_eq!(names(&retried), ["r-gen-2"]);
    let plan = run_plan(&retried, "r-gen-2");
    assert_eq!(
        (plan.pending_list.as_deref(), plan.batch_ranges.as_deref()),
        (Some(LIST), Some("200042"))
    );
    let counts = retried.status.batches.clone().unwrap();
    assert_eq!((counts.completed_count, counts.failed_count), (999_999, 1));

    // Without the plan pod, the status stands in for the plan, list and all.
    let mut recorded_run = run();
    recorded_run.status = Some(desired.status.clone());
    let without_pod = scattered.without_plan_summary().build();
    let recorded =
        desired_state(&recorded_run, &without_pod, &Settings::default(), &now()).unwrap();
    assert_eq!(names(&recorded), shards);
    assert_eq!(
        run_plan(&recorded, "r-gen-1-5").pending_list.as_deref(),
        Some(LIST)
    );
}
