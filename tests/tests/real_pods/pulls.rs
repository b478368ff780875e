//! Pulls off the critical path (`spec.sandbox.prefetch`), on the real node: images of distinct
//! content pushed to the test registry, never on the node before, each the rows of one batch.
//! The pods' own measure of their wait (`.done` markers, `statistics.json`, `status.images.pulls`)
//! shows what pulling ahead saves; the prefetch Jobs are watched as the run goes.

use std::collections::BTreeSet;
use std::io::Read as _;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use trajectory_operator::api::{Phase, TrajectoryRun};
use trajectory_testkit::knob;
use trajectory_tests::e2e::phase_of;
use trajectory_tests::real_pods::{HOW_TO_RUN, jsonl_lines, registry};

use super::{Setup, add_rows, scripted_model};

/// Pushes `count` images of `mib` MiB of random bytes each over the registry's glibc task image,
/// under `<registry>/prefetch/<namespace>/img-<i>:1`, with crane (`scripts/registry/build.sh`):
/// content no node holds, so each is a real pull.
fn push_distinct_images(registry: &str, namespace: &str, count: usize, mib: usize) -> Vec<String> {
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/registry");
    let crane = std::process::Command::new(scripts.join("build.sh"))
        .arg("--print-path")
        .output()
        .expect("scripts/registry/build.sh runs");
    assert!(crane.status.success(), "crane: {crane:?}");
    let crane = String::from_utf8(crane.stdout).unwrap().trim().to_owned();
    let base = format!("{registry}/tasks/glibc:1");
    let mut random = std::fs::File::open("/dev/urandom").unwrap();
    (0..count)
        .map(|i| {
            let dir = tempfile::tempdir().unwrap();
            let pad = dir.path().join("pad");
            std::fs::create_dir(&pad).unwrap();
            let mut file = std::fs::File::create(pad.join(format!("{i}.bin"))).unwrap();
            let bytes = u64::try_from(mib << 20).unwrap();
            std::io::copy(&mut (&mut random).take(bytes), &mut file).unwrap();
            let layer = dir.path().join("layer.tar");
            let tar = std::process::Command::new("tar")
                .arg("-cf")
                .arg(&layer)
                .arg("-C")
                .arg(dir.path())
                .arg("pad")
                .status()
                .unwrap();
            assert!(tar.success());
            let image = format!("{registry}/prefetch/{namespace}/img-{i}:1");
            let pushed = std::process::Command::new(&crane)
                .args(["append", "--insecure", "-b", &base, "-t", &image, "-f"])
                .arg(&layer)
                .output()
                .unwrap();
            assert!(pushed.status.success(), "crane append: {pushed:?}");
            image
        })
        .collect()
}

/// A dataset of `per_image` rows an image, in image order.
fn write_rows(setup: &Setup, images: &[String], per_image: usize) {
    let lines: Vec<String> = images
        .iter()
        .flat_map(|image| std::iter::repeat_n(image, per_image))
        .enumerate()
        .map(|(i, image)| json!({"prompt": format!("row {i}"), "image": image}).to_string())
        .collect();
    add_rows(setup, &lines);
}

/// What a run of the distinct images showed.
struct PullRun {
    run: TrajectoryRun,
    /// Every prefetch Job seen while it ran, and the most at once.
    prefetch_jobs: BTreeSet<String>,
    most_prefetching: usize,
    /// The `.done` markers' pull figures: image → (pull ms, pod ms).
    pulls: Vec<(String, u64, u64)>,
    statistics: Value,
}

/// Runs `name` over `images` (`per_image` rows each, `workers`, `prefetch`) to its end, watching
/// its prefetch Jobs.
async fn run_images(
    setup: &Setup,
    name: &str,
    (images, per_image): (&[String], usize),
    (workers, prefetch): (u32, u32),
) -> PullRun {
    write_rows(setup, images, per_image);
    let model = scripted_model(Duration::from_millis(1500), "echo hi").await;
    let spec = json!({
        "dataset": {"path": "datasets/rows.jsonl"},
        "batchSize": per_image, "workers": workers, "concurrency": per_image,
        "sandbox": {"prefetch": prefetch},
    });
    setup
        .create_scripted(name, &setup.model_url(&model), 0, &spec)
        .await;
    let jobs: Api<Job> = Api::namespaced(setup.client.clone(), setup.ns());
    let selector = format!("trajectories.dev/run={name},app.kubernetes.io/component=prefetch");
    let deadline = Instant::now() + Duration::from_secs(900);
    let (mut prefetch_jobs, mut most_prefetching) = (BTreeSet::new(), 0);
    let run = loop {
        let listed = jobs
            .list(&ListParams::default().labels(&selector))
            .await
            .unwrap()
            .items;
        most_prefetching = most_prefetching.max(listed.len());
        prefetch_jobs.extend(listed.iter().map(ResourceExt::name_any));
        let run = setup.runs.get(name).await.unwrap();
        if phase_of(&run).is_some_and(Phase::is_finished) {
            break run;
        }
        assert!(
            Instant::now() < deadline,
            "{name} did not finish: {:#?}",
            run.status
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
    let left = jobs
        .list(&ListParams::default().labels(&selector))
        .await
        .unwrap();
    assert!(
        left.items.is_empty(),
        "prefetch Jobs left: {:?}",
        left.items.len()
    );
    let dir = setup.storage.run_dir(setup.ns(), name);
    let pulls = std::fs::read_dir(dir.join("batches"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "done"))
        .map(|path| {
            let marker: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
            let pull = &marker["pull"];
            (
                pull["image"].as_str().expect("a pull figure").to_owned(),
                pull["pullMs"].as_u64().unwrap(),
                pull["podMs"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        jsonl_lines(&dir.join("trajectories.jsonl")).len(),
        images.len() * per_image
    );
    let statistics =
        serde_json::from_slice(&std::fs::read(dir.join("statistics.json")).unwrap()).unwrap();
    PullRun {
        run,
        prefetch_jobs,
        most_prefetching,
        pulls,
        statistics,
    }
}

/// Mean pull wait (ms) of the pods of `images`.
fn mean_pull(pulls: &[(String, u64, u64)], images: &[String]) -> f64 {
    let of: Vec<u64> = pulls
        .iter()
        .filter(|(image, ..)| images.contains(image))
        .map(|(_, pull, _)| *pull)
        .collect();
    assert!(!of.is_empty(), "no pod of {images:?} in {pulls:?}");
    of.iter().sum::<u64>() as f64 / of.len() as f64
}

/// Eight images of 64 MiB of fresh content, one batch each, two workers, `prefetch: 2`: the two
/// images the window starts with are pulled by their Jobs' pods; each of the six others is pulled
/// ahead by a prefetch Job (never more than two at once, none left at the end), so that its pod
/// starts on an image the node holds and waits less than half as long as the first two did. The
/// pods' waits are in the `.done` markers, summed alike in `statistics.json` and the status.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn images_next_in_line_are_pulled_ahead_and_their_pods_wait_less() {
    let setup = Setup::new("pods-prefetch").await;
    let images = push_distinct_images(&registry(HOW_TO_RUN), setup.ns(), 8, 64);
    let seen = run_images(&setup, "ahead", (&images, 2), (2, 2)).await;
    let expected: BTreeSet<String> = (2..8).map(|shard| format!("ahead-pull-{shard}")).collect();
    assert_eq!(
        seen.prefetch_jobs, expected,
        "each image past the first window, once"
    );
    assert!(
        seen.most_prefetching <= 2,
        "{} at once",
        seen.most_prefetching
    );
    let (first, ahead) = (
        mean_pull(&seen.pulls, &images[..2]),
        mean_pull(&seen.pulls, &images[2..]),
    );
    eprintln!("pull wait: first window {first:.0} ms a pod, pulled ahead {ahead:.0} ms a pod");
    assert!(
        ahead < first / 2.0,
        "pulled ahead {ahead:.0} ms, first window {first:.0} ms: {:?}",
        seen.pulls
    );
    let reported = &seen.statistics["task_images"]["pulls"];
    assert_eq!(reported["pods"], 8, "{reported}");
    let status = seen
        .run
        .status
        .as_ref()
        .and_then(|s| s.images.as_ref())
        .and_then(|i| i.pulls.clone())
        .expect("status.images.pulls");
    assert_eq!(status.pods, 8);
    assert_eq!(
        status.pull_millis,
        seen.pulls.iter().map(|(_, pull, _)| pull).sum::<u64>()
    );
}

/// The benchmark of `docs/benchmarks.md` ("Pulls off the critical path"): the share of the pods'
/// time spent waiting for pulls over `PULL_BENCH_IMAGES` (40) images of `PULL_BENCH_MIB` (64) MiB,
/// `PULL_BENCH_ROWS` (2) rows an image, 4 workers, without prefetch and with `prefetch: 4`, in one
/// run of the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a benchmark: run it with --ignored (docs/benchmarks.md)"]
async fn bench_pull_share_with_and_without_prefetch() {
    let (count, mib, rows) = (
        knob::<usize>("PULL_BENCH_IMAGES", 40),
        knob::<usize>("PULL_BENCH_MIB", 64),
        knob::<usize>("PULL_BENCH_ROWS", 2),
    );
    let setup = Setup::new("pods-pull-bench").await;
    for (name, prefetch) in [("without", 0), ("with", 4)] {
        let images = push_distinct_images(
            &registry(HOW_TO_RUN),
            &format!("{}-{name}", setup.ns()),
            count,
            mib,
        );
        let started = Instant::now();
        let seen = run_images(&setup, name, (&images, rows), (4, prefetch)).await;
        let wall = started.elapsed().as_secs_f64();
        let pulls = &seen.statistics["task_images"]["pulls"];
        eprintln!(
            "BENCH prefetch={prefetch}: {count} images x {mib} MiB, {rows} rows each, 4 workers: run {wall:.1} s; \
             pods {} waited {} s for pulls of {} s ({}), starting task containers {} s; prefetch Jobs {}",
            pulls["pods"],
            pulls["pull_seconds"],
            pulls["pod_seconds"],
            pulls["pull_share"],
            pulls["start_seconds"],
            seen.prefetch_jobs.len()
        );
    }
}
