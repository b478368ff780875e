//! Runs on an autoscaled cluster: a real Karpenter (v1.14, its kwok provider,
//! `scripts/karpenter/build.sh`) beside the test control plane creates nodes for a run whose pods
//! fit no node, removes them after the run, drains one mid-run when its `NodeClaim` is deleted,
//! and stops at its `NodePool`'s limit.
//!
//! The run's pods select their test's pool ([`trajectory_tests::karpenter`]): the scheduler binds
//! them to Karpenter's kwok nodes, and the test-kubelet (`trajectory_tests::e2e`, with
//! `on_nodes`) runs each bound pod as a process of the worker's command line and ends a drained
//! one as a kubelet does (`SIGTERM`, then `SIGKILL` past its grace), so that the test counts which
//! batches ran where and every model request.
//!
//! Needs a running cluster: `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test
//! autoscaling`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{DeleteParams, ListParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use trajectory_operator::api::Phase;
use trajectory_tests::e2e::phase_of;
use trajectory_tests::karpenter::{
    Autoscaled, PoolSettings, Seen, karpenter_api, names, pool_claims, pool_nodes, succeeded,
    wait_for_no_nodes,
};
use trajectory_tests::wait_until;
use trajectory_worker::contract::exit;

/// The worker's command line, which the test-kubelet runs each pod as.
fn worker() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_e2e-worker"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_that_fits_no_node_gets_karpenter_nodes_runs_there_and_they_go_after() {
    // A batch takes about 3 s, longer than a node takes to come: the two workers' pods overlap.
    let created = Instant::now();
    let (setup, kubelet) = Autoscaled::with_run(
        "e2e-scale-up",
        Duration::from_millis(500),
        ("scaled", &json!({})),
        worker(),
    )
    .await;
    let mut seen = Seen::default();
    let run = Box::pin(setup.drive(&kubelet, &mut seen, succeeded, async |_, _| {})).await;
    let run_time = created.elapsed();
    setup.assert_succeeded_on_the_pool(&run, &kubelet, &seen);
    // Two workers of 1.2 CPUs each on nodes of two: two nodes at once.
    assert!(
        seen.most_at_once >= 2,
        "the two workers never had a node each: {seen:?}"
    );
    let removal =
        wait_for_no_nodes(&setup.client, &setup.pool.name, Duration::from_secs(120)).await;
    // Karpenter deletes a node before it lifts its NodeClaim's finalizer: the claims follow
    // their nodes within moments, and any still there after half a minute were left behind.
    wait_until(
        "the pool's NodeClaims to go after their nodes",
        Duration::from_secs(30),
        || async {
            pool_claims(&setup.client, &setup.pool.name)
                .await
                .is_empty()
                .then_some(())
        },
    )
    .await;
    eprintln!(
        "autoscaling: first node Ready {:.1} s after the run was created, {} nodes in all \
         ({} at once), run {:.1} s, its nodes removed {:.1} s after it succeeded",
        seen.first_node.expect("a node").as_secs_f64(),
        seen.nodes.len(),
        seen.most_at_once,
        run_time.as_secs_f64(),
        removal.as_secs_f64()
    );
}

/// A `NodeClaim` deleted under a running batch: Karpenter drains its node through the eviction
/// API, the worker finishes its conversations in flight on `SIGTERM`, the pod's end is not counted
/// against the batch (`DisruptionTarget`), and a pod on a new node finishes the batch without
/// asking the model again for any finished conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_removed_mid_run_costs_no_finished_conversation_and_no_batch_failure() {
    // One conversation at a time: a batch of 3 takes about 3.6 s, long enough to be drained
    // (Karpenter evicted its pod 0.15 s after the deletion here; the test prints it).
    // The pods' own grace period, which Karpenter's drain honours.
    let grace = 45;
    let (setup, kubelet) = Autoscaled::with_run(
        "e2e-node-gone",
        Duration::from_millis(600),
        (
            "drained",
            &json!({"podTemplate": {"terminationGracePeriodSeconds": grace}}),
        ),
        worker(),
    )
    .await;
    let claims = karpenter_api(&setup.client, "karpenter.sh", "v1", "NodeClaim");
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), setup.ns());
    let mut victim: Option<(String, u32, String)> = None;
    let mut drained_grace = None;
    let mut claim_deleted = Instant::now();
    let mut seen = Seen::default();
    let run = Box::pin(setup.drive(&kubelet, &mut seen, succeeded, async |_, _| {
        if let Some((pod, _, _)) = &victim {
            // The drained pod stays, terminating, until its process has ended.
            if drained_grace.is_none()
                && let Ok(pod) = pods.get(pod).await
            {
                drained_grace = pod.metadata.deletion_grace_period_seconds;
                if drained_grace.is_some() {
                    eprintln!(
                        "pod {} evicted {} ms after its NodeClaim was deleted",
                        pod.name_any(),
                        claim_deleted.elapsed().as_millis()
                    );
                }
            }
            return;
        }
        // A batch of three prompts, into its first conversation.
        let Some(running) = kubelet
            .running_batches()
            .into_iter()
            .find(|b| b.batch < 3 && b.running_for > Duration::from_millis(300))
        else {
            return;
        };
        let pod = pods.get(&running.pod).await.expect("the running pod");
        let node = pod
            .spec
            .and_then(|spec| spec.node_name)
            .expect("a played pod is bound");
        let claim = pool_claims(&setup.client, &setup.pool.name)
            .await
            .into_iter()
            .find(|claim| claim.data["status"]["nodeName"] == node.as_str())
            .unwrap_or_else(|| panic!("no NodeClaim of node {node}"));
        claims
            .delete(&claim.name_any(), &DeleteParams::default())
            .await
            .expect("delete the NodeClaim");
        claim_deleted = Instant::now();
        victim = Some((running.pod, running.batch, node));
    }))
    .await;
    let (pod, batch, node) = victim.expect("a batch was running on a node");
    assert_eq!(
        drained_grace,
        Some(grace),
        "the drain gave pod {pod} the grace period of spec.podTemplate"
    );
    setup.assert_succeeded_on_the_pool(&run, &kubelet, &seen);
    let played = kubelet.played();
    let drained = played
        .iter()
        .find(|p| p.pod == pod)
        .expect("the drained pod was played");
    assert_eq!(
        drained.exit_code,
        exit::INTERRUPTED,
        "the drained pod's worker was stopped by SIGTERM with conversations left: {played:#?}"
    );
    let finished_after: Vec<_> = played
        .iter()
        .filter(|p| p.batch == Some(batch) && p.pod != pod)
        .collect();
    assert!(
        matches!(finished_after.as_slice(), [after] if after.exit_code == exit::OK
            && after.node.as_deref() != Some(node.as_str())),
        "batch {batch} finished once, on another node than {node}: {played:#?}"
    );
    assert!(
        !names(&pool_nodes(&setup.client, &setup.pool.name).await).contains(&node),
        "the drained node {node} is still there"
    );
}

/// A `NodePool` limit that no node fits: the run waits with its pods Pending (Karpenter says
/// why on each), never `Failed`, asking the model nothing; a limit of one node: it runs one pod at
/// a time on that node and succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_pool_limit_below_the_runs_need_leaves_it_waiting_never_failed() {
    let below_one_node = PoolSettings {
        cpu_limit: "1".to_owned(),
        ..PoolSettings::default()
    };
    let setup = Autoscaled::new(
        "e2e-pool-limit",
        &below_one_node,
        Duration::from_millis(50),
        worker(),
    )
    .await;
    let kubelet = setup.create("limited", &json!({"concurrency": 2})).await;
    let mut seen = Seen::default();
    let waited = Instant::now();
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), setup.ns());
    let events: Api<Event> = Api::namespaced(setup.client.clone(), setup.ns());
    let run = Box::pin(setup.drive(
        &kubelet,
        &mut seen,
        |_| waited.elapsed() > Duration::from_secs(20),
        async |_, _| {},
    ))
    .await;
    assert_eq!(phase_of(&run), Some(Phase::Planning), "{:#?}", run.status);
    assert!(seen.nodes.is_empty(), "a node past the limit: {seen:?}");
    assert!(kubelet.played().is_empty(), "{:#?}", kubelet.played());
    assert_eq!(setup.model.request_count(), 0);
    let plan_pods = pods
        .list(&ListParams::default())
        .await
        .expect("list the pods")
        .items;
    let [plan_pod] = plan_pods.as_slice() else {
        panic!("one plan pod waits: {plan_pods:#?}");
    };
    let said = wait_until(
        "Karpenter to say why the plan pod waits",
        Duration::from_secs(30),
        || async {
            let selector = format!("involvedObject.name={}", plan_pod.name_any());
            events
                .list(&ListParams::default().fields(&selector))
                .await
                .ok()?
                .items
                .into_iter()
                .filter_map(|event| event.message)
                .find(|message| {
                    message.contains(&format!(
                        "exceed limits for nodepool (NodePool={})",
                        setup.pool.name
                    ))
                })
        },
    )
    .await;
    eprintln!("the plan pod waits: {said}");

    // Room for one node: the run goes on, one pod at a time.
    setup
        .karpenter
        .set_pool(
            &setup.client,
            &setup.pool.name,
            &PoolSettings {
                cpu_limit: "2".to_owned(),
                ..PoolSettings::default()
            },
        )
        .await;
    let run = Box::pin(setup.drive(&kubelet, &mut seen, succeeded, async |_, _| {})).await;
    setup.assert_succeeded_on_the_pool(&run, &kubelet, &seen);
    assert_eq!(seen.most_at_once, 1, "past the limit of one node: {seen:?}");
}
