//! Harbor task directories on the real node (issue 44): the tasks of `examples/harbor-tasks`,
//! planned by the run's plan pod, each run in a task container of its image that the node pulls
//! from the registry (their `python:3.12-slim` served by the registry's python task image, as a
//! mirror would serve it, through `spec.sandbox.imageRewrite`), verified there by the task's own
//! `tests/test.sh`. The images of the tasks whose Dockerfile needs a build are built by the run's
//! build Job with buildah, in the worker image, and pushed to that registry.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use trajectory_operator::api::{Phase, TrajectoryRun, VerificationStatus};
use trajectory_testkit::scripted_server::text_reply;
use trajectory_tests::e2e::phase_of;
use trajectory_tests::real_pods::{HOW_TO_RUN, jsonl_lines, pod_registry};

use super::{Seen, Setup, model_scripting, terminal_call};

/// The run's spec over the example tasks (`datasets/harbor` on the volume), with `agent` and
/// `dataset` keys added; the built images go to `repository` (one of the test's own, so that the
/// first run finds none built). `debian:12` is served by the registry's glibc image, which has
/// no `apt-get`: the build of `needs-build` fails.
fn harbor_spec(registry: &str, repository: &str, agent: &Value, dataset: &Value) -> Value {
    let mut spec = json!({
        "dataset": {"path": "datasets/harbor", "format": "HarborTasks"},
        "batchSize": 8, "workers": 2, "concurrency": 4,
        "agent": {"maxTurns": 3, "promptTimeoutSeconds": 60},
        "sandbox": {
            "imageRewrite": [
                {"from": "python:3.12-slim", "to": format!("{registry}/tasks/python:1")},
                {"from": "debian:12", "to": format!("{registry}/tasks/glibc:1")},
            ],
            "builds": {"repository": repository, "insecure": true},
        },
    });
    for (section, keys) in [("agent", agent), ("dataset", dataset)] {
        for (key, value) in keys.as_object().into_iter().flatten() {
            spec[section][key] = value.clone();
        }
    }
    spec
}

/// Each record's Harbor task (its directory name) and reward; a failed record, which keeps no
/// `source`, by its row.
fn rewards_by_task(run_dir: &Path) -> BTreeMap<String, Value> {
    let rows = jsonl_lines(&run_dir.join("harbor-tasks.jsonl"));
    jsonl_lines(&run_dir.join("trajectories.jsonl"))
        .into_iter()
        .chain(jsonl_lines(&run_dir.join("failures.jsonl")))
        .map(|record| {
            let row = usize::try_from(record["prompt_index"].as_u64().unwrap_or(u64::MAX))
                .ok()
                .and_then(|index| rows.get(index));
            let task = record["source"]["harbor"]["task"]
                .as_str()
                .or_else(|| row.and_then(|row| row["harbor"]["task"].as_str()))
                .unwrap_or_else(|| panic!("a Harbor record names its task: {record}"))
                .to_owned();
            (task, record["reward"].clone())
        })
        .collect()
}

/// The tasks `harbor-refused.jsonl` names, each with why.
fn refused(run_dir: &Path) -> BTreeMap<String, String> {
    jsonl_lines(&run_dir.join("harbor-refused.jsonl"))
        .iter()
        .map(|line| {
            (
                line["task"].as_str().unwrap_or_default().to_owned(),
                line["reason"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// The oracle over the example tasks, then a model over those it passed. The oracle asks no
/// model: first the build Job builds the two images the tasks need, once each (`build-copy` and
/// `build-copy-twin` share one context): one is built and pushed, the other fails (no `apt-get`
/// in its base), and its task's conversation is recorded `image_build_failed`. Then each task's
/// `solution/solve.sh` runs in the task's container (unpacked into `/solution`, which the image
/// does not have) and its tests judge it: six rewards of 1 (the two in the built image, which
/// its `COPY` and `RUN` made), and the task whose solution is wrong named with 0 in
/// `oracle.jsonl` and the statistics, beside the one whose build failed; the two tasks a run
/// cannot honour are refused by name. The model's run names the oracle's report in
/// `spec.dataset.excludeOracleFailures`: the two failed tasks are left out, the built image is
/// found in the registry (not built again), and the six others run with two model requests each,
/// their rewards as the model's commands earn them (one wrong answer, 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn harbor_tasks_run_in_their_images_and_the_oracle_names_the_broken_one() {
    let setup = Setup::new("pods-harbor").await;
    // Where the build pods reach it too.
    let registry = pod_registry(HOW_TO_RUN);
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/harbor-tasks");
    setup.storage.add_dataset_dir(&examples, "harbor");
    let (model, url) = model_scripting(&setup, answer_some).await;

    let repository = format!("{registry}/harbor-builds/{}", setup.ns());
    let oracle = harbor_spec(&registry, &repository, &json!({"oracle": true}), &json!({}));
    setup
        .create_scripted("harbor-oracle", &url, 0, &oracle)
        .await;
    let run = setup
        .finished("harbor-oracle", Duration::from_secs(300))
        .await;
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
    assert_eq!(model.requests().len(), 0, "the oracle asks no model");
    let dir = setup.storage.run_dir(setup.ns(), "harbor-oracle");
    let expected = check_oracle_run(&dir, &run);
    assert_eq!(builds_of(&run), (1, 0, 1), "built once, one failed");
    check_pulls(&dir, &run);

    let spec = harbor_spec(
        &registry,
        &repository,
        &json!({}),
        &json!({"excludeOracleFailures": format!("runs/{}/harbor-oracle", setup.ns())}),
    );
    setup.create_scripted("harbor-model", &url, 0, &spec).await;
    let run = setup
        .finished("harbor-model", Duration::from_secs(300))
        .await;
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
    let dir = setup.storage.run_dir(setup.ns(), "harbor-model");
    let mut expected = expected;
    expected.remove("wrong-solution");
    expected.remove("needs-build");
    expected.insert("answer-dockerfile".into(), json!(0.0));
    assert_eq!(rewards_by_task(&dir), expected);
    let refusals = refused(&dir);
    for task in ["wrong-solution", "needs-build"] {
        assert!(
            refusals
                .get(task)
                .is_some_and(|why| why.contains("failed the oracle")),
            "{task}: {refusals:?}"
        );
    }
    assert_eq!(builds_of(&run), (0, 1, 0), "found in the registry");
    assert_eq!(model.requests().len(), 12, "two requests a conversation");
    check_pulls(&dir, &run);
}

/// What the pods waited for their images: each pod that finished a batch says it in the batch's
/// `.done` marker; the report sums the markers, per image, and the status sums the pods' summaries
/// as it records their batches, each once (a figure counted at two reconciles would show here).
fn check_pulls(dir: &Path, run: &TrajectoryRun) {
    let markers: Vec<Value> = std::fs::read_dir(dir.join("batches"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "done"))
        .map(|path| serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap())
        .collect();
    let pulls: Vec<&Value> = markers.iter().filter_map(|m| m.get("pull")).collect();
    assert!(
        !pulls.is_empty(),
        "the pods said what they waited: {markers:?}"
    );
    for pull in &pulls {
        let (wait, pod) = (&pull["pullMs"], &pull["podMs"]);
        assert!(wait.as_u64().unwrap() <= pod.as_u64().unwrap(), "{pull}");
    }
    let pull_ms: u64 = pulls.iter().map(|p| p["pullMs"].as_u64().unwrap()).sum();
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(dir.join("statistics.json")).unwrap()).unwrap();
    let reported = &statistics["task_images"]["pulls"];
    assert_eq!(reported["pods"], pulls.len(), "{reported}");
    let images: std::collections::BTreeSet<&str> =
        pulls.iter().map(|p| p["image"].as_str().unwrap()).collect();
    let per_image = reported["images"].as_object().unwrap();
    assert_eq!(
        per_image
            .keys()
            .map(String::as_str)
            .collect::<std::collections::BTreeSet<_>>(),
        images
    );
    let status = run
        .status
        .as_ref()
        .and_then(|status| status.images.as_ref())
        .and_then(|images| images.pulls.clone())
        .unwrap_or_else(|| panic!("the status shows the waits: {:#?}", run.status));
    assert_eq!(status.pods, pulls.len() as u64, "{status:?}");
    assert_eq!(status.pull_millis, pull_ms, "{status:?}");
    assert!(status.pull_share.ends_with('%'), "{status:?}");
    assert!(
        !status.longest.is_empty() && status.longest.len() <= 5,
        "{status:?}"
    );
}

/// The run's `status.images.builds`: built, reused, failed.
fn builds_of(run: &TrajectoryRun) -> (u32, u32, u32) {
    let builds = run
        .status
        .as_ref()
        .and_then(|status| status.images.as_ref())
        .and_then(|images| images.builds.clone())
        .unwrap_or_else(|| panic!("the status counts the builds: {:#?}", run.status));
    (builds.built, builds.reused, builds.failed)
}

/// A model that answers four of the example tasks with one command, one of them wrong (the
/// verifier must see it), and then says it is done.
fn answer_some(seen: &Seen) -> Value {
    if !seen.results.is_empty() {
        return text_reply("done");
    }
    let command = if seen.prompt.contains("the word harbor") {
        "echo harbour > /app/answer.txt"
    } else if seen.prompt.contains("number 42") {
        "echo 42 > /app/answer.txt"
    } else if seen.prompt.contains("/app/out/done") {
        "mkdir -p /app/out && touch /app/out/done"
    } else if seen.prompt.contains("/opt/task/word.txt") {
        "cat /opt/task/word.txt > /app/answer.txt"
    } else if seen.prompt.contains("add(a, b)") {
        "printf 'def add(a, b):\\n    return a + b\\n' > /app/add.py"
    } else {
        "true"
    };
    terminal_call(command)
}

/// The oracle run's outputs in `dir` and its status: each task's reward (returned, by task),
/// the report and the statistics naming the broken task, the tasks refused, the solution shown.
fn check_oracle_run(dir: &Path, run: &TrajectoryRun) -> BTreeMap<String, Value> {
    let full = json!(1.0);
    let expected: BTreeMap<String, Value> = [
        ("answer-dockerfile", &full),
        ("answer-prebuilt", &full),
        ("build-copy", &full),
        ("build-copy-twin", &full),
        ("needs-build", &Value::Null),
        ("resources-timeouts", &full),
        ("reward-json", &full),
        ("wrong-solution", &json!(0.0)),
    ]
    .into_iter()
    .map(|(task, reward)| (task.to_owned(), reward.clone()))
    .collect();
    assert_eq!(rewards_by_task(dir), expected);
    let passed: Vec<(Value, Value)> = jsonl_lines(&dir.join("oracle.jsonl"))
        .iter()
        .map(|line| (line["task"].clone(), line["passed"].clone()))
        .collect();
    assert_eq!(
        passed,
        [
            (json!("answer-dockerfile"), json!(true)),
            (json!("answer-prebuilt"), json!(true)),
            (json!("build-copy"), json!(true)),
            (json!("build-copy-twin"), json!(true)),
            (json!("needs-build"), json!(false)),
            (json!("resources-timeouts"), json!(true)),
            (json!("reward-json"), json!(true)),
            (json!("wrong-solution"), json!(false)),
        ]
    );
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(dir.join("statistics.json")).unwrap()).unwrap();
    assert_eq!(
        statistics["oracle"]["failed_rows"],
        json!(["needs-build", "wrong-solution"])
    );
    assert_eq!(statistics["task_images"]["build_failed"], 1);
    assert_eq!(
        statistics["task_images"]["conversations"]["image_build_failed"],
        1
    );
    // Recorded without a model request or a container, naming the build's failure.
    let failures = jsonl_lines(&dir.join("failures.jsonl"));
    assert_eq!(
        failures.len(),
        1,
        "only the task whose build failed: {failures:?}"
    );
    let unbuilt = &failures[0];
    assert_eq!(unbuilt["error_class"], "image_build_failed", "{unbuilt}");
    let reported: Vec<Value> = jsonl_lines(&dir.join("oracle.jsonl"))
        .into_iter()
        .filter(|line| line["task"] == "needs-build")
        .map(|line| line["error_class"].clone())
        .collect();
    assert_eq!(
        reported,
        [json!("image_build_failed")],
        "named in the report"
    );
    let why = unbuilt.to_string();
    assert!(
        why.contains("could not be built") && why.contains("apt-get"),
        "{why}"
    );
    let refusals = refused(dir);
    assert_eq!(
        refusals.keys().collect::<Vec<_>>(),
        ["compose-services", "separate-verifier"],
        "{refusals:?}"
    );
    assert_eq!(
        run.status
            .as_ref()
            .and_then(|status| status.verification.clone()),
        Some(VerificationStatus {
            verified: 7,
            passed: 6
        })
    );
    // The solution was shown running in the task's image.
    let prebuilt = jsonl_lines(&dir.join("trajectories.jsonl"))
        .into_iter()
        .find(|record| record["source"]["harbor"]["task"] == "answer-prebuilt")
        .expect("the prebuilt task's record");
    let shown = prebuilt["conversations"].to_string();
    assert!(
        shown.contains("bash '/solution/solve.sh'") && shown.contains("exit 0"),
        "{shown}"
    );

    expected
}
