//! The operator's performance targets (issue 6), against the real control plane, with the release
//! binary `trajectory-operator run` as a child process (leader election off, acting on the part's
//! namespace only), as a cluster runs it:
//!
//! - **latency**: a run of 10,000 batches: plan pod finished → generation Job created (target
//!   < 5 s), split into the Job controller's part (pod finished → plan Job `Complete`) and the
//!   operator's (plan Job `Complete` → generation Job created); also apply → plan Job created.
//! - **writes**: API requests per run from the operator's own counter
//!   (`trajectory_operator_api_requests_total` on `/metrics`), for runs of 20 and 200 batches,
//!   with status writes paced (the default 3 s) and unpaced (`--status-interval-ms 0`).
//! - **memory**: the operator's RSS (`/proc/<pid>/status`) with 200 runs at once, all generating,
//!   against the same process idle.
//! - **images** (only when named in `OPERATOR_BENCH_PARTS`): a run whose 10,000 rows name 2,000
//!   images (one generation Job per image, `workers: 16`, `batchSize: 4`, `concurrency: 4`): time
//!   to done and to the first generation pod, the most generation Jobs running and pods alive at
//!   once, the operator's API requests by verb and resource, and its memory at the end; it asserts
//!   what the end-to-end test of many images does (`assert_image_run`; docs/benchmarks.md,
//!   "Task images").
//! - **kueue** (only when named): a run of 20 batches through a real Kueue's queue against the same
//!   run without one: apply → plan Job admitted, apply → first model request, the run's time and
//!   the operator's API writes (Kueue built by `scripts/kueue/build.sh`, or `TRAJ_KUEUE` and
//!   `TRAJ_KUEUE_SRC`).
//!
//! Runs are driven as in the end-to-end tests (`trajectory_tests::e2e`): the test-kubelet plays
//! the pods with the worker's real steps on a scratch directory and a scripted model; the real Job
//! controller computes `completedIndexes`.
//!
//! ```sh
//! scripts/cluster/with-cluster.sh cargo bench -p trajectory-operator --bench operator
//! ```
//! Knobs: `OPERATOR_BENCH_PARTS` (`latency,writes,memory`; `images` and `kueue` run only when
//! named),
//! `OPERATOR_BENCH_BATCHES` (10000), `OPERATOR_BENCH_DONE_PERCENT` (0: the latency part's runs
//! resume over that share of their batches done at random by an earlier run),
//! `OPERATOR_BENCH_ROUNDS` (3), `OPERATOR_BENCH_RUNS` (200), `OPERATOR_BENCH_IMAGE_ROWS` (10000),
//! `OPERATOR_BENCH_IMAGES` (2000), `OPERATOR_BENCH_IMAGE_WORKERS` (16).
//!
//! The test-kubelet runs the model's terminal commands through the worker's executor, the
//! `e2e-worker` binary of the tests crate, which `cargo bench` of this crate does not build:
//! `cargo build --release -p trajectory-tests --bin e2e-worker` first (or set `TRAJ_E2E_WORKER`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use trajectory_operator::api::{Phase, TrajectoryRun};
use trajectory_operator::reconcile::children::labels;
use trajectory_operator::reconcile::observe::JobState;
use trajectory_tests::e2e::{
    Kubelet, NO_NODE, Scratch, assert_image_run, count_live_children, http_get, mark_done, model,
    phase_of, plan_termination_message, random_batches, run_spec, write_dataset,
    write_image_dataset,
};
use trajectory_tests::kueue::Kueue;
use trajectory_tests::{TestNamespace, client, install_crds, wait_until};
use trajectory_worker::contract::{MAX_JOB_COMPLETIONS, parse_ranges};

fn knob<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// The operator binary running as a child process.
struct Operator {
    child: Child,
    addr: SocketAddr,
}

impl Operator {
    /// Starts the operator acting on `namespace` only, so that what it counts is the part's.
    async fn start(namespace: &str, status_interval_ms: u64, log: &Path) -> Self {
        // A free port: bound, read, released for the child to bind.
        let addr = TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port");
        let log = std::fs::File::create(log).expect("the operator's log file");
        let child = Command::new(env!("CARGO_BIN_EXE_trajectory-operator"))
            .args(["run", "--leader-election=false", "--log-format", "json"])
            .arg(format!("--http-addr={addr}"))
            .arg(format!("--status-interval-ms={status_interval_ms}"))
            .arg(format!("--watch-namespace={namespace}"))
            .stderr(log.try_clone().expect("the log file"))
            .stdout(log)
            .spawn()
            .expect("start trajectory-operator");
        let operator = Self { child, addr };
        wait_until(
            "the operator to be ready",
            Duration::from_secs(30),
            || async {
                http_get(addr, "/readyz")
                    .await
                    .filter(|r| r.starts_with("HTTP/1.1 200") && r.ends_with("running\n"))
            },
        )
        .await;
        operator
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `VmRSS` and `VmHWM` (peak) of the process, in MiB.
    fn memory(&self) -> (f64, f64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("the operator's /proc status");
        let kib = |key: &str| -> f64 {
            status
                .lines()
                .find_map(|line| line.strip_prefix(key))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("no {key} in /proc status"))
        };
        (kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0)
    }

    /// `trajectory_operator_api_requests_total` by (verb, resource).
    async fn requests(&self) -> BTreeMap<(String, String), u64> {
        self.counted("api_requests_total", ["verb", "resource"])
            .await
    }

    /// `trajectory_operator_reconcile_errors_total` by (stage, class): a status write refused
    /// with a 409 Conflict is a transient error at the `status` stage.
    async fn reconcile_errors(&self) -> BTreeMap<(String, String), u64> {
        self.counted("reconcile_errors_total", ["stage", "class"])
            .await
    }

    /// The counter `trajectory_operator_<name>` by the values of its two labels `keys`.
    async fn counted(&self, name: &str, keys: [&str; 2]) -> BTreeMap<(String, String), u64> {
        let text = http_get(self.addr, "/metrics")
            .await
            .expect("the operator's /metrics");
        let prefix = format!("trajectory_operator_{name}{{");
        let mut counts = BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(&prefix) else {
                continue;
            };
            let (labels, value) = rest.split_once("} ").expect("a sample line");
            let label = |name: &str| {
                labels
                    .split(',')
                    .find_map(|pair| pair.strip_prefix(&format!("{name}=\"")))
                    .map(|v| v.trim_end_matches('"').to_owned())
                    .expect("the label")
            };
            counts.insert(
                (label(keys[0]), label(keys[1])),
                value.parse().expect("a count"),
            );
        }
        counts
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        // SIGTERM would be graceful, but std has no way to send it without `unsafe`; the operator
        // keeps no state of its own, so a kill loses nothing.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ms(duration: Duration) -> String {
    format!("{:.0}", duration.as_secs_f64() * 1000.0)
}

fn median(values: &mut [Duration]) -> Duration {
    values.sort_unstable();
    values[values.len() / 2]
}

/// Polls from the moment the plan pod finished: how long until the plan Job was `Complete` (the
/// Job controller's part) and until the generation Jobs of all `batches` were created (one, or one
/// per 100,000 batches).
async fn generation_job_after_plan(
    jobs: &Api<Job>,
    name: &str,
    batches: u32,
) -> (Duration, Duration) {
    let plan_job = format!("{name}-plan");
    let planned = Instant::now();
    let selector = format!("{}={name},{}=generate", labels::RUN, labels::COMPONENT);
    let shards = batches.div_ceil(MAX_JOB_COMPLETIONS);
    let mut complete_at = None;
    let created_at = loop {
        if complete_at.is_none()
            && jobs
                .get(&plan_job)
                .await
                .is_ok_and(|job| JobState::of(&job) == JobState::Complete)
        {
            complete_at = Some(planned.elapsed());
        }
        let generation = jobs
            .list(&ListParams::default().labels(&selector))
            .await
            .expect("list the generation Jobs")
            .items;
        if generation.len() == usize::try_from(shards).expect("a count") {
            let completions: i32 = generation
                .iter()
                .filter_map(|job| job.spec.as_ref()?.completions)
                .sum();
            assert_eq!(completions, i32::try_from(batches).expect("i32"));
            break planned.elapsed();
        }
        assert!(
            planned.elapsed() < Duration::from_secs(120),
            "not all {shards} generation Jobs 120 s after the plan finished"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    (complete_at.unwrap_or(created_at), created_at)
}

/// What a run of many batches hands over: the largest plan `ConfigMap` of its generation Jobs and
/// the plan pod's termination message, in bytes.
async fn hand_off_sizes(client: &Client, ns: &str, name: &str) -> (usize, usize) {
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let selector = format!("{}={name},{}=generate", labels::RUN, labels::COMPONENT);
    let largest_map = maps
        .list(&ListParams::default().labels(&selector))
        .await
        .expect("list the plan ConfigMaps")
        .items
        .iter()
        .filter_map(|map| Some(map.data.as_ref()?.values().map(String::len).sum::<usize>()))
        .max()
        .unwrap_or(0);
    let message = plan_termination_message(client, ns, name)
        .await
        .map_or(0, |message| message.len());
    (largest_map, message)
}

/// The API writes of the latency part's runs, what they handed over, and the operator's memory.
async fn report_hand_offs(
    report: &mut String,
    operator: &Operator,
    client: &Client,
    ns: &str,
    rounds: usize,
    batches: u32,
) {
    let requests = operator.requests().await;
    let writes = |resource: &str| -> u64 {
        requests
            .iter()
            .filter(|((verb, r), _)| {
                r == resource && verb != "get" && verb != "list" && verb != "watch"
            })
            .map(|(_, count)| count)
            .sum()
    };
    let (rss, hwm) = operator.memory();
    let (largest_map, message) = hand_off_sizes(client, ns, &format!("big-{}", rounds - 1)).await;
    let _ = writeln!(
        report,
        "\n{} generation Job(s) a run; in all {rounds} runs: {} Job writes, {} ConfigMap writes, {} status writes; largest plan ConfigMap {largest_map} bytes; plan termination message {message} bytes; operator RSS {rss:.1} MiB, peak (VmHWM) {hwm:.1} MiB",
        batches.div_ceil(MAX_JOB_COMPLETIONS),
        writes("jobs"),
        writes("configmaps"),
        writes("trajectoryruns/status"),
    );
}

/// Part 1: a run of `batches` batches, `rounds` times.
async fn latency(client: &Client, scratch: &Scratch, base_url: &str, report: &mut String) {
    let batches: u32 = knob("OPERATOR_BENCH_BATCHES", 10_000);
    let done_percent: u32 = knob("OPERATOR_BENCH_DONE_PERCENT", 0);
    let done_before = batches / 100 * done_percent.min(100);
    let rounds: usize = knob("OPERATOR_BENCH_ROUNDS", 3);
    let namespace = TestNamespace::create(client, "bench-latency").await;
    let ns = namespace.name();
    let operator = Operator::start(ns, 3000, &scratch.0.join("operator-latency.log")).await;
    write_dataset(
        &scratch.storage(),
        usize::try_from(batches).expect("a count"),
    );
    let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), ns);
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    let (mut applied_to_plan_job, mut pod_to_complete, mut complete_to_gen, mut total) =
        (vec![], vec![], vec![], vec![]);
    let _ = writeln!(
        report,
        "\n### Latency: a run of {batches} batches, {done_before} done before at random ({rounds} rounds)\n\n| round | apply → plan Job created ms | plan pod finished → plan Job Complete ms (Job controller) | plan Job Complete → generation Job created ms (operator) | plan pod finished → generation Job created ms |\n|---:|---:|---:|---:|---:|"
    );
    for round in 0..rounds {
        let name = format!("big-{round}");
        let spec = run_spec(base_url, &json!({"batchSize": 1, "workers": 8}));
        let kubelet = Kubelet::new(client, ns, &name, scratch);
        if done_before > 0 {
            kubelet.plan_an_earlier_run(ns, &spec.run).await;
            let done = random_batches(batches, done_before, u64::try_from(round).unwrap_or(0));
            let output = scratch.storage().join(spec.run.output_path(ns, &name));
            mark_done(&output.join("batches"), &done);
        }
        let applied = Instant::now();
        runs.create(&PostParams::default(), &TrajectoryRun::new(&name, spec))
            .await
            .expect("create the run");
        let plan_job = format!("{name}-plan");
        wait_until("the plan Job", Duration::from_secs(30), || async {
            jobs.get_opt(&plan_job).await.ok().flatten()
        })
        .await;
        let plan_created = applied.elapsed();
        assert!(kubelet.play_the_plan().await, "the plan pod was played");
        let (complete_at, created_at) =
            generation_job_after_plan(&jobs, &name, batches - done_before).await;
        let operator_part = created_at.saturating_sub(complete_at);
        let _ = writeln!(
            report,
            "| {round} | {} | {} | {} | **{}** |",
            ms(plan_created),
            ms(complete_at),
            ms(operator_part),
            ms(created_at)
        );
        applied_to_plan_job.push(plan_created);
        pod_to_complete.push(complete_at);
        complete_to_gen.push(operator_part);
        total.push(created_at);
        let status = runs.get(&name).await.expect("the run").status;
        let (largest_map, message) = hand_off_sizes(client, ns, &name).await;
        eprintln!(
            "round {round}: gen Jobs after {} ms; run {:?} {:?}; largest plan ConfigMap {largest_map} B, plan termination message {message} B; operator RSS, peak {:?} MiB",
            ms(created_at),
            status.as_ref().and_then(|s| s.phase),
            status.as_ref().and_then(|s| s.progress.clone()),
            operator.memory()
        );
    }
    let _ = writeln!(
        report,
        "| median | {} | {} | {} | **{}** |",
        ms(median(&mut applied_to_plan_job)),
        ms(median(&mut pod_to_complete)),
        ms(median(&mut complete_to_gen)),
        ms(median(&mut total))
    );
    report_hand_offs(report, &operator, client, ns, rounds, batches - done_before).await;
    drop(operator);
}

/// Part 2: the API requests of whole runs, paced and unpaced.
async fn writes(client: &Client, base_url: &str, report: &mut String) {
    let _ = writeln!(
        report,
        "\n### API requests per run (from the operator's counter)\n\n| batches | status interval | run s | Jobs applied (SSA) or patched | ConfigMaps applied | status writes | Events | writes in all | reads (get, list) |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for batches in [20_usize, 200] {
        for interval_ms in [3000_u64, 0] {
            let scratch = Scratch::new();
            write_dataset(&scratch.storage(), batches);
            let namespace = TestNamespace::create(client, "bench-writes").await;
            let ns = namespace.name();
            let operator =
                Operator::start(ns, interval_ms, &scratch.0.join("operator-writes.log")).await;
            let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), ns);
            // Let the watches settle, so that the delta is the run's.
            tokio::time::sleep(Duration::from_secs(1)).await;
            let before = operator.requests().await;
            let started = Instant::now();
            runs.create(
                &PostParams::default(),
                &TrajectoryRun::new(
                    "writes",
                    run_spec(base_url, &json!({"batchSize": 1, "workers": 8})),
                ),
            )
            .await
            .expect("create the run");
            let kubelet = Kubelet::new(client, ns, "writes", &scratch);
            let run = kubelet
                .serve_until("the run to finish", Duration::from_secs(600), |run| {
                    matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
                })
                .await;
            let elapsed = started.elapsed();
            assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
            // The Succeeded Event is published after the status write.
            tokio::time::sleep(Duration::from_secs(1)).await;
            let after = operator.requests().await;
            let delta = |verbs: &[&str], resource: &str| -> u64 {
                after
                    .iter()
                    .filter(|((verb, res), _)| {
                        verbs.contains(&verb.as_str()) && (resource.is_empty() || res == resource)
                    })
                    .map(|(key, count)| count - before.get(key).copied().unwrap_or(0))
                    .sum()
            };
            let writes = ["create", "patch", "update", "delete"];
            let _ = writeln!(
                report,
                "| {batches} | {} | {:.1} | {} | {} | **{}** | {} | {} | {} |",
                if interval_ms == 0 {
                    "0 (every change)".to_owned()
                } else {
                    format!("{} s", interval_ms / 1000)
                },
                elapsed.as_secs_f64(),
                delta(&["create", "patch"], "jobs"),
                delta(&["patch"], "configmaps"),
                delta(&["patch", "update"], "trajectoryruns/status"),
                delta(&writes, "events"),
                delta(&writes, ""),
                delta(&["get", "list"], ""),
            );
            eprintln!("{batches} batches, interval {interval_ms} ms: {elapsed:?}");
        }
    }
}

/// The completion indexes all first generation Jobs report done.
async fn completed_generation_indexes(jobs: &Api<Job>) -> usize {
    jobs.list(&ListParams::default())
        .await
        .expect("list Jobs")
        .items
        .iter()
        .filter(|job| {
            job.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.ends_with("-gen-1"))
        })
        .filter_map(|job| job.status.as_ref()?.completed_indexes.clone())
        .map(|ranges| parse_ranges(&ranges).map_or(0, |ids| ids.len()))
        .sum()
}

/// A run of one prompt per batch, two pods at a time.
async fn create_small_run(runs: &Api<TrajectoryRun>, name: &str, base_url: &str) {
    runs.create(
        &PostParams::default(),
        &TrajectoryRun::new(
            name,
            run_spec(base_url, &json!({"batchSize": 1, "workers": 2})),
        ),
    )
    .await
    .expect("create a run");
}

/// Part 3: the operator's memory with `count` runs generating at once.
async fn memory(client: &Client, base_url: &str, report: &mut String) {
    let count: usize = knob("OPERATOR_BENCH_RUNS", 200);
    let scratch = Scratch::new();
    write_dataset(&scratch.storage(), 100);
    let namespace = TestNamespace::create(client, "bench-memory").await;
    let ns = namespace.name();
    let operator = Operator::start(ns, 3000, &scratch.0.join("operator-memory.log")).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (idle, _) = operator.memory();
    let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), ns);
    let names: Vec<String> = (0..count).map(|i| format!("r{i:03}")).collect();
    let started = Instant::now();
    for name in &names {
        create_small_run(&runs, name, base_url).await;
    }
    let kubelets: Vec<Kubelet> = names
        .iter()
        .map(|name| Kubelet::new(client, ns, name, &scratch))
        .collect();
    let mut peak_rss = 0.0_f64;
    let mut sample = |operator: &Operator| {
        let (rss, _) = operator.memory();
        peak_rss = peak_rss.max(rss);
    };
    // Plan every run, then work two rounds of batch pods in each.
    let mut running = 0;
    while running < count {
        for kubelet in &kubelets {
            kubelet.play_pending().await;
        }
        sample(&operator);
        running = runs
            .list(&ListParams::default())
            .await
            .expect("list the runs")
            .items
            .iter()
            .filter(|run| phase_of(run) == Some(Phase::Running))
            .count();
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "only {running} of {count} runs reached Running in 15 minutes"
        );
    }
    let all_running = started.elapsed();
    for _ in 0..2 {
        for kubelet in &kubelets {
            kubelet.play_pending().await;
            sample(&operator);
        }
    }
    // Every finished batch reaches the runs' status (the Job controller, then the operator's
    // paced writes), which the memory is measured through.
    let finished: u32 = kubelets
        .iter()
        .flat_map(Kubelet::played)
        .filter(|p| p.mode == "batch" && p.exit_code == 0)
        .count()
        .try_into()
        .expect("a count");
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    let settle = Instant::now();
    let mut jobs_settled = None;
    let done = loop {
        sample(&operator);
        // First the Job controller records the finished pods in `completedIndexes`, then the
        // operator copies them into the runs' status.
        if jobs_settled.is_none() {
            let completed = completed_generation_indexes(&jobs).await;
            if completed >= usize::try_from(finished).expect("a count") {
                jobs_settled = Some(settle.elapsed());
            }
        }
        let done: u32 = runs
            .list(&ListParams::default())
            .await
            .expect("list the runs")
            .items
            .iter()
            .map(trajectory_tests::e2e::done_batches)
            .sum();
        if done >= finished || settle.elapsed() > Duration::from_secs(180) {
            break done;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let settled = settle.elapsed();
    let jobs_settled = jobs_settled.unwrap_or(settled);
    let played: usize = kubelets.iter().map(|k| k.played().len()).sum();
    let job_count = jobs
        .list(&ListParams::default())
        .await
        .expect("list Jobs")
        .items
        .len();
    let (rss, hwm) = operator.memory();
    let _ = writeln!(
        report,
        "\n### Memory with {count} runs at once\n\n| operator idle RSS MiB | runs | Jobs | pods played | batches finished / in status | all Running after s | Jobs' completedIndexes caught up after s | runs' status caught up after s | RSS at the end MiB | peak RSS sampled MiB | VmHWM MiB | peak ÷ idle |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n| {idle:.1} | {count} | {job_count} | {played} | {finished} / {done} | {:.0} | {:.1} | {:.1} | {rss:.1} | {peak_rss:.1} | **{hwm:.1}** | {:.2} |",
        all_running.as_secs_f64(),
        jobs_settled.as_secs_f64(),
        settled.as_secs_f64(),
        hwm / idle,
    );
}

/// The API requests of `after` beyond `before`, by (verb, resource), those that changed.
fn requests_since(
    before: &BTreeMap<(String, String), u64>,
    after: &BTreeMap<(String, String), u64>,
) -> BTreeMap<(String, String), u64> {
    after
        .iter()
        .map(|(key, count)| {
            (
                key.clone(),
                count - before.get(key).copied().unwrap_or(0).min(*count),
            )
        })
        .filter(|(_, count)| *count > 0)
        .collect()
}

/// Part 5 (only when named): a queued run through a real Kueue (`tests/src/kueue.rs`) against
/// the same run without a queue, `OPERATOR_BENCH_ROUNDS` rounds each: apply → plan Job created,
/// apply → plan Job admitted (unsuspended), apply → first model request, the run's time, and the
/// operator's API writes (and its Workload requests) from its own counter.
async fn kueue(client: &Client, report: &mut String) {
    let rounds: usize = knob("OPERATOR_BENCH_ROUNDS", 3);
    let kueue = Kueue::shared(client).await;
    let _ = writeln!(
        report,
        "\n### Kueue: a run of 20 batches through a queue and without one\n\n| round | queue | apply → plan Job ms | apply → plan Job admitted ms | apply → first model request ms | run s | writes in all | Workload lists | Workload patches | status writes |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for round in 0..rounds {
        for queued in [true, false] {
            let scratch = Scratch::new();
            write_dataset(&scratch.storage(), 20);
            let namespace = kueue
                .namespace(client, "bench-kueue", "team-a", ("16", "32Gi"), &json!({}))
                .await;
            let ns = namespace.name();
            let operator = Operator::start(ns, 3000, &scratch.0.join("operator-kueue.log")).await;
            let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), ns);
            let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
            tokio::time::sleep(Duration::from_secs(1)).await;
            let before = operator.requests().await;
            let model = trajectory_tests::e2e::model().await;
            let mut extra = json!({
                "batchSize": 1, "workers": 8,
                "podTemplate": {
                    "nodeSelector": {NO_NODE.0: NO_NODE.1},
                    "resources": {"requests": {"cpu": "500m", "memory": "64Mi"}},
                },
            });
            if queued {
                extra["queueName"] = json!("team-a");
            }
            let started = Instant::now();
            runs.create(
                &PostParams::default(),
                &TrajectoryRun::new("queued", run_spec(&model.base_url(), &extra)),
            )
            .await
            .expect("create the run");
            let kubelet = Kubelet::new(client, ns, "queued", &scratch);
            let (mut created, mut admitted, mut first_request) = (None, None, None);
            let run = loop {
                if admitted.is_none()
                    && let Ok(job) = jobs.get("queued-plan").await
                {
                    created.get_or_insert_with(|| started.elapsed());
                    if job.spec.as_ref().and_then(|s| s.suspend) == Some(false) {
                        admitted.get_or_insert_with(|| started.elapsed());
                    }
                }
                if admitted.is_some() {
                    kubelet.play_pending().await;
                }
                if first_request.is_none() && model.request_count() > 0 {
                    first_request = Some(started.elapsed());
                }
                let run = runs.get("queued").await.expect("the run");
                if matches!(phase_of(&run), Some(Phase::Succeeded | Phase::Failed)) {
                    break run;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(600),
                    "the run did not finish: {:#?}",
                    run.status
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            let elapsed = started.elapsed();
            assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
            tokio::time::sleep(Duration::from_secs(1)).await;
            let delta = requests_since(&before, &operator.requests().await);
            let count = |verbs: &[&str], resource: &str| -> u64 {
                delta
                    .iter()
                    .filter(|((verb, res), _)| {
                        verbs.contains(&verb.as_str()) && (resource.is_empty() || res == resource)
                    })
                    .map(|(_, count)| count)
                    .sum()
            };
            let show = |at: Option<Duration>| at.map_or_else(|| "-".to_owned(), ms);
            let _ = writeln!(
                report,
                "| {round} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} |",
                if queued { "team-a" } else { "none" },
                show(created),
                show(admitted),
                show(first_request),
                elapsed.as_secs_f64(),
                count(&["create", "patch", "update", "delete"], ""),
                count(&["list"], "workloads"),
                count(&["patch"], "workloads"),
                count(&["patch", "update"], "trajectoryruns/status"),
            );
            eprintln!("kueue round {round}, queued {queued}: {elapsed:?}");
        }
    }
}

/// Part 4: a run of `rows` rows over `images` images, each row naming its image (one generation
/// Job per image, at most `workers` running), as the end-to-end test
/// `a_run_over_many_images_keeps_its_jobs_within_the_window_and_cleans_them_up` drives it, at
/// scale, with the operator's API requests and memory.
async fn images(client: &Client, base_url: &str, report: &mut String) {
    let rows: usize = knob("OPERATOR_BENCH_IMAGE_ROWS", 10_000);
    let images: usize = knob("OPERATOR_BENCH_IMAGES", 2_000);
    let workers: usize = knob("OPERATOR_BENCH_IMAGE_WORKERS", 16);
    let scratch = Scratch::new();
    write_image_dataset(&scratch.storage(), rows, images);
    let namespace = TestNamespace::create(client, "bench-images").await;
    let ns = namespace.name();
    let operator = Operator::start(ns, 3000, &scratch.0.join("operator-images.log")).await;
    let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), ns);
    // Let the watches settle, so that the delta is the run's.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = operator.requests().await;
    let errors_before = operator.reconcile_errors().await;
    let spec = run_spec(
        base_url,
        &json!({
            "dataset": {"path": "datasets/images.jsonl"},
            "batchSize": 4, "workers": workers, "concurrency": 4,
        }),
    );
    let created = Instant::now();
    runs.create(&PostParams::default(), &TrajectoryRun::new("images", spec))
        .await
        .expect("create the run");
    let (stop, counting) = count_live_children(client, ns, created);
    let kubelet = Kubelet::new(client, ns, "images", &scratch);
    let run = kubelet
        .serve_until("the run to end", Duration::from_secs(3 * 3600), |run| {
            matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
        })
        .await;
    let took = created.elapsed();
    let _ = stop.send(());
    let live = counting.await.expect("the counter");
    let batches = run
        .status
        .as_ref()
        .and_then(|s| s.batches.as_ref())
        .map_or(0, |b| b.total);
    eprintln!(
        "images: {rows} rows over {images} images ({batches} batches), {workers} workers: {:?} after {took:?}; first generation pod after {:?}; most generation Jobs running {}, pods {}; requests so far {:?}; operator RSS, peak {:?} MiB",
        phase_of(&run),
        live.first_pod,
        live.most_jobs,
        live.most_pods,
        requests_since(&before, &operator.requests().await),
        operator.memory(),
    );
    // Waits until the finished Jobs are deleted, so that the requests counted are the whole run's.
    assert_image_run(client, ns, &run, &kubelet, (rows, images, workers), live).await;
    // The Succeeded Event is published after the status write.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let requests = requests_since(&before, &operator.requests().await);
    let errors = requests_since(&errors_before, &operator.reconcile_errors().await);
    let status_conflicts: u64 = errors
        .iter()
        .filter(|((stage, _), _)| stage == "status")
        .map(|(_, count)| count)
        .sum();
    let (rss, hwm) = operator.memory();
    let sum = |verbs: &[&str], resource: &str| -> u64 {
        requests
            .iter()
            .filter(|((verb, res), _)| {
                verbs.contains(&verb.as_str()) && (resource.is_empty() || res == resource)
            })
            .map(|(_, count)| count)
            .sum()
    };
    let writes = ["create", "patch", "update", "delete"];
    let all_writes = sum(&writes, "");
    let per_batch = |count: u64| count as f64 / f64::from(batches.max(1));
    let _ = writeln!(
        report,
        "\n### A run over many images: {rows} rows over {images} images, batchSize 4, workers {workers}, concurrency 4\n\n| batches | done in s | run created → first generation pod s | most generation Jobs running at once | most generation pods at once | Job writes | status writes | status writes refused (409) | Events | writes in all | writes per batch | status writes per image | reads (get, list) | `ConfigMap` gets per batch | operator RSS at the end MiB | VmHWM MiB |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n| {batches} | {:.1} | {:.1} | **{}** | {} | {} | {} | {status_conflicts} | {} | {all_writes} | **{:.2}** | **{:.2}** | {} | {:.2} | {rss:.1} | **{hwm:.1}** |",
        took.as_secs_f64(),
        live.first_pod.unwrap_or_default().as_secs_f64(),
        live.most_jobs,
        live.most_pods,
        sum(&writes, "jobs"),
        sum(&writes, "trajectoryruns/status"),
        sum(&writes, "events"),
        per_batch(all_writes),
        sum(&writes, "trajectoryruns/status") as f64 / images.max(1) as f64,
        sum(&["get", "list"], ""),
        per_batch(sum(&["get"], "configmaps")),
    );
    let _ = writeln!(
        report,
        "\nThe operator's API requests over the run, by verb and resource:\n\n| verb | resource | requests | per batch |\n|---|---|---:|---:|"
    );
    for ((verb, resource), count) in &requests {
        let _ = writeln!(
            report,
            "| {verb} | {resource} | {count} | {:.2} |",
            per_batch(*count)
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    // `cargo bench` passes `--bench`; this harness has nothing to filter.
    let parts: String = knob("OPERATOR_BENCH_PARTS", "latency,writes,memory".to_owned());
    let client = client().await;
    install_crds(&client).await;
    let model = model().await;
    let base_url = model.base_url();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut report = format!(
        "Operator benchmark: release `trajectory-operator run` as a child process; load average at start: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    for part in parts.split(',') {
        match part.trim() {
            "latency" => {
                // Hundreds of thousands of done markers are made and removed in memory.
                let scratch = if knob("OPERATOR_BENCH_DONE_PERCENT", 0_u32) > 0 {
                    Scratch::in_memory()
                } else {
                    Scratch::new()
                };
                Box::pin(latency(&client, &scratch, &base_url, &mut report)).await;
            }
            "writes" => Box::pin(writes(&client, &base_url, &mut report)).await,
            "memory" => Box::pin(memory(&client, &base_url, &mut report)).await,
            "images" => Box::pin(images(&client, &base_url, &mut report)).await,
            "kueue" => Box::pin(kueue(&client, &mut report)).await,
            other => panic!("unknown part {other:?}: use latency, writes, memory, images, kueue"),
        }
        eprintln!("part {part} done");
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let _ = writeln!(
        report,
        "\nload average at the end: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!("{report}");
}
