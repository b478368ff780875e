//! How a worker pod's end counts against its Job: the `podFailurePolicy` that turns the worker
//! contract's exit codes ([`exit`]) into Kubernetes actions.

use k8s_openapi::api::batch::v1::{
    PodFailurePolicy, PodFailurePolicyOnExitCodesRequirement,
    PodFailurePolicyOnPodConditionsPattern, PodFailurePolicyRule,
};
use trajectory_worker::contract::exit;

use crate::reconcile::children::CONTAINER;

/// Ignore disruptions (preemption, spot loss, scale-down); fail the Job on a permanent
/// configuration error; on an Indexed Job, fail only the index on bad batch input, and count
/// nothing against it for a batch stopped at the budget.
pub fn failure_policy(indexed: bool) -> PodFailurePolicy {
    let on_exit = |action: &str, code: i32| PodFailurePolicyRule {
        action: action.to_owned(),
        on_exit_codes: Some(PodFailurePolicyOnExitCodesRequirement {
            container_name: Some(CONTAINER.to_owned()),
            operator: "In".to_owned(),
            values: vec![code],
        }),
        on_pod_conditions: None,
    };
    let mut rules = vec![
        PodFailurePolicyRule {
            action: "Ignore".to_owned(),
            on_exit_codes: None,
            on_pod_conditions: Some(vec![PodFailurePolicyOnPodConditionsPattern {
                status: Some("True".to_owned()),
                type_: "DisruptionTarget".to_owned(),
            }]),
        },
        on_exit("FailJob", exit::PERMANENT_CONFIG),
    ];
    if indexed {
        rules.push(on_exit("FailIndex", exit::BAD_BATCH_INPUT));
        // A batch stopped at the run's budget failed nothing: the operator holds the Job
        // (suspended) until the budget is raised, and the batch runs again then.
        rules.push(on_exit("Ignore", exit::BUDGET_EXHAUSTED));
    }
    PodFailurePolicy { rules }
}
