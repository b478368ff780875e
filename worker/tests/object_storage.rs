//! Runs on object storage, against a real S3 server (versitygw with its POSIX backend, built from
//! its Go module by `scripts/versitygw/build.sh`): the bucket operations the write path relies
//! on, a whole `local` run on a bucket against the same run on a volume, and the errors a
//! missing bucket or refused credentials give.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{RunFixture, WORKER, copy_dir, harbor_examples, parse_lines, terminal_server};
use serde_json::Value;
use trajectory_testkit::s3_faults::{Fault, FaultProxy, Kind, Rule};
use trajectory_testkit::versitygw::{ACCESS_KEY, SECRET_KEY, Versitygw};
use trajectory_testkit::without_timing;
use trajectory_worker::contract::exit;
use trajectory_worker::storage::{
    AccessKeys, Bucket, BucketOptions, ObjectUrl, RunDir, StorageError, StorageFault, Store,
};

const BUCKET: &str = "trajectories";

fn options(server: &Versitygw) -> BucketOptions {
    BucketOptions {
        endpoint: Some(server.endpoint.clone()),
        region: None,
        path_style: true,
        keys: Some(AccessKeys {
            id: ACCESS_KEY.into(),
            secret: SECRET_KEY.into(),
        }),
    }
}

fn bucket(server: &Versitygw, url: &str) -> Arc<Bucket> {
    let url = ObjectUrl::parse(url).unwrap();
    Arc::new(Bucket::open(&url, &options(server)).unwrap())
}

#[test]
fn a_real_s3_server_gives_conditional_puts_ranges_listings_and_whole_multipart_uploads() {
    let server = Versitygw::start("127.0.0.1");
    server.create_bucket(BUCKET);
    let bucket = bucket(&server, "s3://trajectories/runs");
    let store = Store::Bucket(bucket.clone());
    let path = |key: &str| PathBuf::from(format!("s3://trajectories/runs/{key}"));

    // Created once: the second writer's put is refused and the first one's object stays.
    assert!(
        store
            .create_once(&path("b/batch-1.done"), b"first")
            .unwrap()
    );
    assert!(
        !store
            .create_once(&path("b/batch-1.done"), b"second")
            .unwrap()
    );
    assert_eq!(store.read(&path("b/batch-1.done")).unwrap(), b"first");

    store
        .write_atomic(&path("b/x.jsonl"), b"0123456789")
        .unwrap();
    assert_eq!(store.read_range(&path("b/x.jsonl"), 3..7).unwrap(), b"3456");
    let mut names = store.list(&path("b")).unwrap();
    names.sort();
    assert_eq!(names, ["batch-1.done", "x.jsonl"]);
    assert!(store.list(&path("nothing-here")).unwrap().is_empty());
    assert!(store.read(&path("absent")).unwrap_err().is_not_found());
    store.remove(&path("b/x.jsonl")).unwrap();
    store.remove(&path("b/x.jsonl")).unwrap();
    assert!(store.read_optional(&path("b/x.jsonl")).unwrap().is_none());

    // Past one part (16 MiB) an output is a multipart upload: nothing is there until it
    // completes, and then all of it is; one dropped unfinished leaves nothing.
    let line = [b'x'; 1023];
    let mut output = store.output(&path("big.jsonl")).unwrap();
    for _ in 0..(40 << 10) {
        output.write_all(&line).unwrap();
        output.write_all(b"\n").unwrap();
    }
    assert!(store.read_optional(&path("big.jsonl")).unwrap().is_none());
    output.finish().unwrap();
    let mut streamed = Vec::new();
    store
        .open(&path("big.jsonl"))
        .unwrap()
        .read_to_end(&mut streamed)
        .unwrap();
    assert_eq!(streamed.len(), 40 << 20);
    assert!(streamed.chunks(1024).all(|chunk| chunk[..1023] == line));
    let mut abandoned = store.output(&path("abandoned.jsonl")).unwrap();
    abandoned.write_all(&vec![b'y'; 20 << 20]).unwrap();
    drop(abandoned);
    assert!(
        store
            .read_optional(&path("abandoned.jsonl"))
            .unwrap()
            .is_none()
    );
}

fn local(fixture: &RunFixture, storage: &str, server: &Versitygw) -> std::process::Output {
    local_through(fixture, storage, server, &server.endpoint)
}

/// `local` on `storage`, reaching `server` at `endpoint` (the server's own, or a proxy's).
fn local_through(
    fixture: &RunFixture,
    storage: &str,
    server: &Versitygw,
    endpoint: &str,
) -> std::process::Output {
    Command::new(WORKER)
        .arg("local")
        .arg(fixture.run_file())
        .args(["--storage", storage, "--no-progress-bar"])
        .args(["--s3-endpoint", endpoint, "--s3-path-style"])
        .arg("--workspace-root")
        .arg(fixture.workspaces())
        .envs(server.credentials())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("the worker binary starts")
}

fn copy_dataset(fixture: &RunFixture, server: &Versitygw, prefix: &str) {
    let target = server
        .bucket_dir(BUCKET)
        .join(prefix)
        .join("datasets/prompts.jsonl");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    std::fs::copy(fixture.dataset(), target).unwrap();
}

/// The shipped quickstart run, locally on a bucket of a real S3 server and on a volume, against
/// the same scripted model (so that both runs see the same replies): the same records but for
/// when they ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_locally_on_a_bucket_writes_the_records_it_writes_on_a_volume() {
    let model = terminal_server(Duration::ZERO).await;
    let server = Versitygw::start("127.0.0.1");
    server.create_bucket(BUCKET);
    let fixture = RunFixture::quickstart(&model.base_url());
    copy_dataset(&fixture, &server, "experiments/a");

    let on_volume =
        tokio::task::block_in_place(|| local(&fixture, &fixture.root().to_string_lossy(), &server));
    assert!(
        on_volume.status.success(),
        "{}",
        String::from_utf8_lossy(&on_volume.stderr)
    );
    let requests_on_volume = model.request_count();
    assert_eq!(
        requests_on_volume,
        2 * 8,
        "a tool call and an answer per prompt"
    );
    let on_bucket = local(&fixture, "s3://trajectories/experiments/a", &server);
    let report = String::from_utf8_lossy(&on_bucket.stdout);
    assert!(
        on_bucket.status.success(),
        "{}",
        String::from_utf8_lossy(&on_bucket.stderr)
    );
    assert!(
        report.contains("s3://trajectories/experiments/a/out/trajectories.jsonl"),
        "{report}"
    );
    // Every conversation ran once more, no more.
    assert_eq!(model.request_count(), 2 * requests_on_volume);

    let run = server.bucket_dir(BUCKET).join("experiments/a/out");
    for name in ["trajectories.jsonl", "failures.jsonl"] {
        let volume: Vec<Value> = parse_lines(&fixture.out().join(name))
            .into_iter()
            .map(without_timing)
            .collect();
        let bucket: Vec<Value> = parse_lines(&run.join(name))
            .into_iter()
            .map(without_timing)
            .collect();
        assert_eq!(bucket, volume, "{name}");
    }
    assert_eq!(parse_lines(&run.join("trajectories.jsonl")).len(), 8);
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(run.join("statistics.json")).unwrap()).unwrap();
    assert_eq!(statistics["counts"]["succeeded"], 8);
    // Each batch's records are parts of at most PART_RECORDS records, beside its marker.
    let batch = run.join("batches/batch-000000");
    let parts: Vec<String> = std::fs::read_dir(&batch)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(parts.len(), 1, "{parts:?}");
    assert!(parts[0].ends_with("-000000.jsonl"), "{parts:?}");
    assert!(run.join("batches/batch-000000.done").exists());

    // Run again: everything is done, nothing is asked of the model.
    let again = local(&fixture, "s3://trajectories/experiments/a", &server);
    assert!(again.status.success());
    assert_eq!(model.request_count(), 2 * requests_on_volume);
}

/// The plan on `storage`, as a pod runs it: its exit code and termination message.
fn plan_on(fixture: &RunFixture, storage: &str, server: &Versitygw, secret: &str) -> (i32, Value) {
    let log = fixture.root().join("termination-log");
    let status = Command::new(WORKER)
        .arg("plan")
        .arg("--run-file")
        .arg(fixture.run_file())
        .args(["--storage-root", storage])
        .args(["--s3-endpoint", &server.endpoint, "--s3-path-style"])
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", secret)
        .env("TRAJ_TERMINATION_LOG", &log)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("the worker binary starts");
    let message = std::fs::read(&log).unwrap();
    (
        status.code().unwrap(),
        serde_json::from_slice(&message).unwrap(),
    )
}

/// Harbor task directories on a bucket (`spec.dataset.format: HarborTasks`): the plan, as a pod
/// runs it, reads the example tasks from the bucket and makes the rows and refusals it makes of
/// the same tasks on a volume, byte for byte (the scripts, executable on the volume, are so in
/// the rows from the bucket, which keeps no modes); a path with nothing under it is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harbor_tasks_on_a_bucket_are_planned_as_on_a_volume() {
    let server = Versitygw::start("127.0.0.1");
    server.create_bucket(BUCKET);
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 1)
        .with(
            "/dataset",
            serde_json::json!({"path": "tasks", "format": "HarborTasks"}),
        )
        .with("/batchSize", serde_json::json!(2));
    copy_dir(&harbor_examples(), &fixture.root().join("tasks"));
    copy_dir(
        &harbor_examples(),
        &server.bucket_dir(BUCKET).join("harbor/tasks"),
    );
    let (code, message) = plan_on(&fixture, "s3://trajectories/harbor", &server, SECRET_KEY);
    assert_eq!(code, exit::OK, "{message}");
    let location = fixture.location();
    let (_, on_volume) = trajectory_worker::run::plan::plan(&location).expect("planned");
    assert_eq!(message["prompts"], on_volume.prompts, "{message}");
    let run_dir = location.run_dir();
    for file in [run_dir.harbor_rows(), run_dir.harbor_refused()] {
        let relative = file.strip_prefix(&location.storage_root).unwrap();
        let from_bucket = std::fs::read(server.bucket_dir(BUCKET).join("harbor").join(relative));
        assert_eq!(
            from_bucket.unwrap(),
            std::fs::read(&file).unwrap(),
            "{}",
            relative.display()
        );
    }

    let empty = RunFixture::new("http://127.0.0.1:9/v1", 1).with(
        "/dataset",
        serde_json::json!({"path": "none", "format": "HarborTasks"}),
    );
    let (code, message) = plan_on(&empty, "s3://trajectories/harbor", &server, SECRET_KEY);
    assert_ne!(code, exit::OK);
    assert!(
        message
            .to_string()
            .contains("nothing on the bucket under s3://trajectories/harbor/none"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_or_refused_credentials_fail_with_a_reason_that_names_the_bucket() {
    let model = terminal_server(Duration::ZERO).await;
    let server = Versitygw::start("127.0.0.1");
    server.create_bucket(BUCKET);
    let fixture = RunFixture::new(&model.base_url(), 3);
    copy_dataset(&fixture, &server, "x");

    let (code, message) = plan_on(&fixture, "s3://no-such-bucket/x", &server, SECRET_KEY);
    assert_eq!(code, exit::PERMANENT_CONFIG, "{message}");
    assert_eq!(message["reason"], "StorageMissing", "{message}");
    assert!(
        message["error"]
            .as_str()
            .unwrap()
            .contains("\"no-such-bucket\""),
        "{message}"
    );

    let (code, message) = plan_on(&fixture, "s3://trajectories/x", &server, "not-the-secret");
    assert_eq!(code, exit::PERMANENT_CONFIG, "{message}");
    assert_eq!(message["reason"], "StoragePermissionDenied", "{message}");
    assert!(
        message["error"]
            .as_str()
            .unwrap()
            .contains("s3://trajectories/x"),
        "{message}"
    );

    let (code, message) = plan_on(&fixture, "s3://trajectories/x", &server, SECRET_KEY);
    assert_eq!(code, 0, "{message}");
    assert_eq!(message["prompts"], 3, "{message}");
    let run_dir = RunDir::on(
        Store::Bucket(bucket(&server, "s3://trajectories/x")),
        "s3://trajectories/x/out",
    );
    assert!(
        run_dir
            .store()
            .read_optional(&run_dir.manifest())
            .unwrap()
            .is_some()
    );
    let fault = |error: StorageError| error.fault();
    assert_eq!(
        fault(
            Store::Bucket(bucket(&server, "s3://no-such-bucket"))
                .read(Path::new("s3://no-such-bucket/a"))
                .unwrap_err()
        ),
        StorageFault::Missing
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_cut_connections_and_a_stall_are_retried_and_lose_or_redo_nothing() {
    let model = terminal_server(Duration::ZERO).await;
    let server = Versitygw::start("127.0.0.1");
    server.create_bucket(BUCKET);
    let proxy = FaultProxy::start(&server.endpoint).await;
    let fixture = RunFixture::new(&model.base_url(), 23);
    copy_dataset(&fixture, &server, "faults");
    let rules = [
        // The plan's listing of done markers, and a part of batch 1: throttled.
        (Kind::List, "", Fault::SlowDown),
        (Kind::Put, "batch-000001/w-", Fault::SlowDown),
        // A part of batch 2 and batch 3's marker land, and their answers are lost: the retry
        // finds its own object, not another writer's.
        (Kind::Put, "batch-000002/w-", Fault::ResetAfter),
        (Kind::Put, "batch-000003.done", Fault::ResetAfter),
        // A batch's read of its rows waits 5 s.
        (
            Kind::Get,
            "datasets/prompts.jsonl",
            Fault::Stall(Duration::from_secs(5)),
        ),
        // The merged output's upload: throttled.
        (Kind::Put, "out/trajectories.jsonl", Fault::SlowDown),
    ];
    for (kind, key_part, fault) in rules {
        proxy.fault(Rule {
            kind,
            key_part: key_part.into(),
            fault,
        });
    }
    // The proxy and the model answer on this runtime while the worker runs.
    let run = tokio::task::block_in_place(|| {
        local_through(
            &fixture,
            "s3://trajectories/faults",
            &server,
            &proxy.endpoint,
        )
    });
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(
        proxy.pending(),
        0,
        "every fault was done: {:?}",
        proxy.faulted()
    );
    // No conversation ran twice, none is missing.
    assert_eq!(model.request_count(), 2 * 23);
    let out = server.bucket_dir(BUCKET).join("faults/out");
    let records = parse_lines(&out.join("trajectories.jsonl"));
    let mut keys: Vec<u64> = records
        .iter()
        .map(|record| record["prompt_index"].as_u64().unwrap())
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, (0..23).collect::<Vec<u64>>());
}

/// Waits for a step to end well; returns its termination message.
fn finished(fixture: &RunFixture, name: &str, child: std::process::Child) -> Value {
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let log = fixture.root().join(format!("termination-log-{name}"));
    serde_json::from_slice(&std::fs::read(log).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_plans_and_two_writers_at_once_on_a_bucket_overwrite_nothing_and_keep_each_key_once() {
    const N: u64 = 24;
    let model = terminal_server(Duration::from_millis(30)).await;
    let server = Versitygw::start("127.0.0.1");
    server.create_bucket(BUCKET);
    let fixture = RunFixture::new(&model.base_url(), 24)
        .with("/batchSize", serde_json::json!(N))
        .with("/concurrency", serde_json::json!(2));
    copy_dataset(&fixture, &server, "two");
    let out = server.bucket_dir(BUCKET).join("two/out");
    // Counts what the server answered each request.
    let proxy = FaultProxy::start(&server.endpoint).await;
    let step = |name: &str, args: &[&str]| {
        common::spawn_on_bucket(&fixture, (&server, &proxy.endpoint), "two", name, args)
    };

    // Two plans at once: the first one's manifest stays, and both report the same plan. The
    // first manifest write is held 2 s, so that the other plan finds no manifest either.
    proxy.fault(Rule {
        kind: Kind::Put,
        key_part: "/manifest.json".into(),
        fault: Fault::Stall(Duration::from_secs(2)),
    });
    let plans = tokio::task::block_in_place(|| {
        let a = step("plan-a", &["plan"]);
        let b = step("plan-b", &["plan"]);
        [
            finished(&fixture, "plan-a", a),
            finished(&fixture, "plan-b", b),
        ]
    });
    assert_eq!(plans[0]["prompts"], N);
    assert_eq!(plans[0]["datasetDigest"], plans[1]["datasetDigest"]);
    assert_eq!(plans[0]["specHash"], plans[1]["specHash"]);
    let manifest = std::fs::read(out.join("manifest.json")).unwrap();
    let manifest_puts: Vec<u16> = proxy
        .answered()
        .into_iter()
        .filter(|(kind, path, _)| *kind == Kind::Put && path.ends_with("/manifest.json"))
        .map(|(_, _, status)| status)
        .collect();
    assert_eq!(
        manifest_puts
            .iter()
            .filter(|status| **status == 200)
            .count(),
        1,
        "one plan wrote the manifest, the other was refused: {manifest_puts:?}"
    );

    // Two writers of the one batch at once: each its own parts, one marker.
    let summaries = tokio::task::block_in_place(|| {
        let a = step("a", &["batch", "0"]);
        let b = step("b", &["batch", "0"]);
        [finished(&fixture, "a", a), finished(&fixture, "b", b)]
    });
    let started: u64 = summaries
        .iter()
        .map(|summary| N - summary["resumed"].as_u64().unwrap())
        .sum();
    // Every conversation a writer started ran to its end: two requests each, none lost.
    assert_eq!(model.request_count() as u64, 2 * started);
    assert!(started <= 2 * N, "{started}");
    let writers: std::collections::BTreeSet<String> =
        std::fs::read_dir(out.join("batches/batch-000000"))
            .unwrap()
            .map(|entry| {
                let name = entry.unwrap().file_name().to_string_lossy().into_owned();
                // w-<writer>-<part>.jsonl
                name.split('-').nth(1).unwrap().to_owned()
            })
            .collect();
    assert_eq!(
        writers.len(),
        2,
        "both wrote parts of their own: {writers:?}"
    );

    let merged = tokio::task::block_in_place(|| {
        let merge = step("merge", &["merge"]);
        finished(&fixture, "merge", merge)
    });
    assert_eq!(merged["trajectories"], N, "{merged}");
    let mut keys: Vec<u64> = parse_lines(&out.join("trajectories.jsonl"))
        .iter()
        .map(|record| record["prompt_index"].as_u64().unwrap())
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, (0..N).collect::<Vec<u64>>(), "each key once");
    // Nothing written once was written twice: parts, the marker, the manifest.
    let mut created = std::collections::BTreeMap::<String, usize>::new();
    for (kind, path, status) in proxy.answered() {
        if kind == Kind::Put && status == 200 && !path.contains("/out/trajectories") {
            *created.entry(path).or_default() += 1;
        }
    }
    let twice: Vec<&String> = created
        .iter()
        .filter(|(path, count)| **count > 1 && !path.ends_with("invalid.jsonl"))
        .map(|(path, _)| path)
        .collect();
    assert!(twice.is_empty(), "written twice: {twice:?}");
    assert_eq!(
        std::fs::read(out.join("manifest.json")).unwrap(),
        manifest,
        "no step wrote the manifest again"
    );
}
