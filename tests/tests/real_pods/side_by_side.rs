//! This project's half of the benchmark beside Harbor itself (`docs/benchmarks.md`, "Side by side
//! with Harbor"): the task directory Harbor's half runs (`trajectory_testkit::side_by_side`; its
//! Dockerfiles name `local/debian:12`, which `spec.sandbox.imageRewrite` serves from the registry's
//! python task image, bash and all), the same scripted model, on the real node, 8, 32 and 128
//! conversations at once, each in a task container of its task's image. Harbor's half:
//! `bench_harbor_itself_on_the_side_by_side_tasks` in `worker/tests/harbor_tasks.rs`.

use std::time::Duration;

use serde_json::json;
use trajectory_operator::api::Phase;
use trajectory_testkit::knob;
use trajectory_testkit::side_by_side::{ANSWER_COMMAND, RunClock, write_answer_tasks};
use trajectory_tests::e2e::phase_of;
use trajectory_tests::real_pods::{HOW_TO_RUN, jsonl_lines, pod_registry};

use super::{Setup, scripted_model};

/// `SIDE_BY_SIDE_TASKS` (128) tasks, two model requests each (`SIDE_BY_SIDE_LATENCY_MS`, 500, a
/// request), at 8, 32 and 128 at once; prints trajectories an hour from the run's creation to
/// `Succeeded` (plan and merge included), the machine's CPU time a trajectory (the idle machine's,
/// control plane running, subtracted), and the time from the run's creation to the first model
/// request.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a benchmark: run it with --ignored (docs/benchmarks.md)"]
async fn bench_side_by_side_with_harbor_at_8_32_and_128() {
    let tasks = knob::<usize>("SIDE_BY_SIDE_TASKS", 128);
    let latency = Duration::from_millis(knob::<u64>("SIDE_BY_SIDE_LATENCY_MS", 500));
    let setup = Setup::new("pods-side-by-side").await;
    let registry = pod_registry(HOW_TO_RUN);
    let scratch = tempfile::tempdir().unwrap();
    write_answer_tasks(scratch.path(), tasks, "local/debian:12");
    setup
        .storage
        .add_dataset_dir(scratch.path(), "side-by-side");
    // (at once, batch size = conversations a pod, pods)
    for (at_once, batch, workers) in [(8, 8, 1), (32, 16, 2), (128, 16, 8)] {
        let model = scripted_model(latency, ANSWER_COMMAND).await;
        let spec = json!({
            "dataset": {"path": "datasets/side-by-side", "format": "HarborTasks"},
            "batchSize": batch, "workers": workers, "concurrency": batch,
            "agent": {"maxTurns": 3, "promptTimeoutSeconds": 60},
            "sandbox": {"imageRewrite": [
                {"from": "local/debian:12", "to": format!("{registry}/tasks/python:1")},
            ]},
        });
        let name = format!("at-{at_once}");
        let clock = RunClock::start().await;
        setup
            .create_scripted(&name, &setup.model_url(&model), 0, &spec)
            .await;
        let run = setup.finished(&name, Duration::from_secs(1800)).await;
        let figures = clock.summary(&model, tasks);
        assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
        let dir = setup.storage.run_dir(setup.ns(), &name);
        let records = jsonl_lines(&dir.join("trajectories.jsonl"));
        let passed = records.iter().filter(|r| r["reward"] == 1.0).count();
        eprintln!(
            "BENCH ours, {at_once} at once ({workers} pods of {batch}): {tasks} trajectories \
             ({passed} passed, model {latency:?} a request) in {figures}"
        );
        assert_eq!(records.len(), tasks, "a record a task");
        assert_eq!(
            model.request_count(),
            2 * tasks,
            "two model requests a task"
        );
        assert_eq!(passed, tasks, "every task passed");
    }
}
