//! Trajectories per node per hour (`docs/benchmarks.md`): the same conversations on the real node
//! (one node of 2 cores), three ways: rows naming no image, whose commands run in the pod's
//! confined shell; rows naming a task image, 16 task containers a pod; and the same rows one pod
//! a row, as a pod-per-conversation system runs them.

use std::time::{Duration, Instant};

use serde_json::json;
use trajectory_operator::api::Phase;
use trajectory_testkit::knob;
use trajectory_tests::e2e::phase_of;
use trajectory_tests::real_pods::{HOW_TO_RUN, jsonl_lines, registry};

use super::{Setup, add_rows, scripted_model};

/// Writes `rows` prompts, each naming `image` when given.
fn write_rows(setup: &Setup, rows: usize, image: Option<&str>) {
    let lines: Vec<String> = (0..rows)
        .map(|i| {
            let mut row = json!({"prompt": format!("row {i}")});
            if let Some(image) = image {
                row["image"] = json!(image);
            }
            row.to_string()
        })
        .collect();
    add_rows(setup, &lines);
}

/// `THROUGHPUT_BENCH_ROWS` (96) conversations of two model requests (`THROUGHPUT_BENCH_LATENCY_MS`,
/// 500, each; the first calls the terminal), at most 32 at once, each way in turn; prints the
/// trajectories an hour and the wall time from the run's creation to `Succeeded` (plan and merge
/// included).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a benchmark: run it with --ignored (docs/benchmarks.md)"]
async fn bench_trajectories_per_node_hour() {
    let rows = knob::<usize>("THROUGHPUT_BENCH_ROWS", 96);
    let latency = Duration::from_millis(knob::<u64>("THROUGHPUT_BENCH_LATENCY_MS", 500));
    let setup = Setup::new("pods-throughput").await;
    let image = format!("{}/tasks/glibc:1", registry(HOW_TO_RUN));
    let model = scripted_model(latency, "echo hi from $(pwd)").await;
    let ways = [
        ("shell", None, 16, 2),
        ("tasks", Some(image.as_str()), 16, 2),
        ("podperrow", Some(image.as_str()), 1, 32),
    ];
    for (name, image, batch_size, workers) in ways {
        write_rows(&setup, rows, image);
        let spec = json!({
            "dataset": {"path": "datasets/rows.jsonl"},
            "batchSize": batch_size, "workers": workers, "concurrency": batch_size,
        });
        let started = Instant::now();
        setup
            .create_scripted(name, &setup.model_url(&model), 0, &spec)
            .await;
        let run = setup.finished(name, Duration::from_secs(1800)).await;
        let wall = started.elapsed().as_secs_f64();
        assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
        let dir = setup.storage.run_dir(setup.ns(), name);
        let kept = jsonl_lines(&dir.join("trajectories.jsonl")).len();
        assert_eq!(kept, rows, "{name}");
        eprintln!(
            "BENCH {name}: {rows} conversations (batch {batch_size}, {workers} workers, model \
             {latency:?} a request) in {wall:.1} s: {:.0} trajectories per node-hour",
            rows as f64 / wall * 3600.0
        );
    }
}
