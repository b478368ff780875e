//! How long a run waits for an autoscaler (issue 41): a real Karpenter (its kwok provider,
//! `scripts/karpenter/build.sh`) beside the test control plane, a run whose pods fit no node
//! (`workers` pods of 1.2 CPUs on nodes of 2), played by the test-kubelet on the nodes Karpenter
//! makes, as `tests/tests/autoscaling.rs` drives it. Per round:
//!
//! - **apply → first node Ready** and, for each of the run's pods, **pending → bound**: from the
//!   first time the pod is seen unbound to the first time it is seen bound to a node;
//! - **run end → nodes removed**: from `Succeeded` until the pool has no node left (Karpenter's
//!   consolidation of empty nodes, `consolidateAfter: 0s`), with Karpenter's default disruption
//!   budget (`nodes: 10%`, one node at a time in a small pool) and with a budget of `100%` for
//!   empty nodes.
//!
//! ```sh
//! TRAJ_E2E_WORKER=$CARGO_TARGET_DIR/debug/e2e-worker \
//!   scripts/cluster/with-cluster.sh cargo bench -p trajectory-tests --bench autoscaling
//! ```
//! Knobs: `AUTOSCALING_BENCH_ROUNDS` (3), `AUTOSCALING_BENCH_WORKERS` (4), `TRAJ_E2E_WORKER` (the
//! worker's command line the test-kubelet runs, with `trajectory-executor` beside it: the tests'
//! build, `$CARGO_TARGET_DIR/debug/e2e-worker`; `cargo bench` builds no executor).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use serde_json::json;
use trajectory_operator::reconcile::children::labels;
use trajectory_tests::karpenter::{Autoscaled, PoolSettings, Seen, succeeded, wait_for_no_nodes};

fn knob<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

fn ms(duration: Duration) -> u128 {
    duration.as_millis()
}

/// When each pod of the run was first seen unbound and first seen bound.
#[derive(Debug, Default)]
struct Binding {
    unbound: BTreeMap<String, Instant>,
    bound: BTreeMap<String, Duration>,
}

impl Binding {
    async fn observe(&mut self, pods: &Api<Pod>, run: &str) {
        let selector = format!("{}={run}", labels::RUN);
        let Ok(list) = pods.list(&ListParams::default().labels(&selector)).await else {
            return;
        };
        for pod in list.items {
            let name = pod.name_any();
            match pod.spec.and_then(|spec| spec.node_name) {
                None => {
                    self.unbound.entry(name).or_insert_with(Instant::now);
                }
                Some(_) => {
                    if let Some(seen) = self.unbound.get(&name) {
                        self.bound.entry(name).or_insert_with(|| seen.elapsed());
                    }
                }
            }
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    let rounds: usize = knob("AUTOSCALING_BENCH_ROUNDS", 3);
    let workers: u32 = knob("AUTOSCALING_BENCH_WORKERS", 4);
    let worker = std::env::var_os("TRAJ_E2E_WORKER").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_e2e-worker")),
        PathBuf::from,
    );
    let executor = worker.with_file_name("trajectory-executor");
    assert!(
        executor.is_file(),
        "{} is not there: the worker runs the model's commands with it. Point TRAJ_E2E_WORKER at \
         an e2e-worker that has it beside it (the tests' build: $CARGO_TARGET_DIR/debug/e2e-worker)",
        executor.display()
    );
    let mut report = format!(
        "\n### Autoscaling: a run of 4 batches, {workers} workers of 1.2 CPUs on Karpenter's 2-CPU kwok nodes\n\n\
         | round | empty nodes removed at once | apply → first node Ready ms | pending → bound ms (min, median, max; pods) | nodes (at once) | run s | run end → nodes removed s |\n\
         |---:|---|---:|---:|---:|---:|---:|\n"
    );
    for (round, empty_budget) in
        (0..rounds).flat_map(|round| [(round, None), (round, Some("100%"))])
    {
        let settings = PoolSettings {
            empty_budget: empty_budget.map(str::to_owned),
            ..PoolSettings::default()
        };
        let setup = Autoscaled::new(
            "bench-autoscaling",
            &settings,
            Duration::from_millis(500),
            worker.clone(),
        )
        .await;
        let pods: Api<Pod> = Api::namespaced(setup.client.clone(), setup.ns());
        let created = Instant::now();
        let kubelet = setup
            .create("scaled", &json!({"concurrency": 1, "workers": workers}))
            .await;
        let mut seen = Seen::default();
        let mut binding = Binding::default();
        // The first look at the pods is this round's first act: the plan pod is seen unbound.
        binding.observe(&pods, "scaled").await;
        let run = Box::pin(setup.drive(&kubelet, &mut seen, succeeded, async |_, _| {
            binding.observe(&pods, "scaled").await;
        }))
        .await;
        let run_time = created.elapsed();
        setup.assert_succeeded_on_the_pool(&run, &kubelet, &seen);
        let removal =
            wait_for_no_nodes(&setup.client, &setup.pool.name, Duration::from_secs(300)).await;
        let mut waits: Vec<Duration> = binding.bound.values().copied().collect();
        waits.sort_unstable();
        let median = waits.get(waits.len() / 2).copied().unwrap_or_default();
        let max = waits.last().copied().unwrap_or_default();
        let min = waits.first().copied().unwrap_or_default();
        let line = format!(
            "| {round} | {} | {} | {}, {}, {}; {} | {} ({}) | {:.1} | {:.1} |",
            empty_budget.unwrap_or("10% (the default budget)"),
            seen.first_node.map_or(0, ms),
            ms(min),
            ms(median),
            ms(max),
            waits.len(),
            seen.nodes.len(),
            seen.most_at_once,
            run_time.as_secs_f64(),
            removal.as_secs_f64()
        );
        eprintln!("{line}");
        report.push_str(&line);
        report.push('\n');
    }
    println!("{report}");
}
