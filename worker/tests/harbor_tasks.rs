//! Harbor task directories as a dataset (`spec.dataset.format: HarborTasks`), over the tasks
//! of `examples/harbor-tasks`: a prebuilt image, a Dockerfile that only names its base, a
//! solution that does not pass, named rewards in `reward.json`, resources and timeouts, three
//! Dockerfiles that need a build (two of one context), and two a run cannot honour (a compose
//! file, a verifier environment of its own). The plan makes rows of the first five and names
//! the others (the three built ones too, when the run builds no images);
//! Harbor's own task model (`harbor` 0.25 from the Python package index) reads every
//! `task.toml` as the plan does.

mod common;

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::Path;

use base64::Engine as _;
use common::{RunFixture, copy_dir, harbor_examples as examples};
use serde_json::{Value, json};
use trajectory_testkit::{knob, side_by_side};
use trajectory_worker::harbor::config::TaskConfig;
use trajectory_worker::run::oracle::OracleOutcome;
use trajectory_worker::run::plan;

/// The files of a row's packed directory (base64 of a gzipped tar): name → (mode, content).
fn unpacked(base64: &Value) -> BTreeMap<String, (u32, String)> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(base64.as_str().unwrap())
        .unwrap();
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(bytes.as_slice()));
    let mut files = BTreeMap::new();
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        let name = entry.path().unwrap().display().to_string();
        let mode = entry.header().mode().unwrap();
        let mut text = String::new();
        entry.read_to_string(&mut text).unwrap();
        files.insert(name, (mode, text));
    }
    files
}

/// A run over a copy of the example tasks, planned as a pod run would plan it.
fn planned() -> (RunFixture, trajectory_worker::contract::PlanSummary) {
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 1)
        .with(
            "/dataset",
            json!({"path": "tasks", "format": "HarborTasks"}),
        )
        .with("/batchSize", json!(2));
    copy_dir(&examples(), &fixture.root().join("tasks"));
    let (_, summary) = plan::plan(&fixture.location()).expect("the tasks are planned");
    (fixture, summary)
}

#[test]
fn a_directory_of_harbor_tasks_is_planned_as_rows_and_what_cannot_run_is_named() {
    let (fixture, summary) = planned();
    assert_eq!((summary.prompts, summary.invalid), (5, 0));
    let rows = fixture.lines("harbor-tasks.jsonl");
    let by_task: BTreeMap<&str, &Value> = rows
        .iter()
        .map(|row| (row["harbor"]["task"].as_str().unwrap(), row))
        .collect();
    assert_eq!(
        by_task.keys().copied().collect::<Vec<_>>(),
        [
            "answer-dockerfile",
            "answer-prebuilt",
            "resources-timeouts",
            "reward-json",
            "wrong-solution"
        ],
        "in name order"
    );

    let prebuilt = by_task["answer-prebuilt"];
    let instruction =
        std::fs::read_to_string(examples().join("answer-prebuilt/instruction.md")).unwrap();
    assert_eq!(prebuilt["prompt"], json!(instruction));
    assert_eq!(prebuilt["image"], "python:3.12-slim");
    assert_eq!(prebuilt["cwd"], "/app", "[environment] workdir");
    assert_eq!(prebuilt["verifier_timeout_sec"], 60.0);
    assert_eq!(prebuilt["harbor"]["agent_timeout_sec"], 120.0);
    assert_eq!(prebuilt["harbor"]["name"], "examples/answer-prebuilt");
    assert_eq!(
        prebuilt["metadata"],
        json!({"category": "files", "difficulty": "easy"})
    );
    let tests = unpacked(&prebuilt["tests_tar"]);
    let test_sh =
        std::fs::read_to_string(examples().join("answer-prebuilt/tests/test.sh")).unwrap();
    assert_eq!(tests["test.sh"], (0o755, test_sh));
    let solution = unpacked(&prebuilt["solution_tar"]);
    assert_eq!(solution.keys().collect::<Vec<_>>(), ["solve.sh"]);

    // A Dockerfile of FROM and WORKDIR runs in its base image, where it said.
    let dockerfile = by_task["answer-dockerfile"];
    assert_eq!(
        (&dockerfile["image"], &dockerfile["cwd"]),
        (&json!("python:3.12-slim"), &json!("/app"))
    );
    assert_eq!(dockerfile["verifier_timeout_sec"], 60.0);
    let resources = &by_task["resources-timeouts"]["harbor"];
    assert_eq!(
        (
            &resources["cpus"],
            &resources["memory_mb"],
            &resources["storage_mb"]
        ),
        (&json!(2.0), &json!(2048), &json!(4096))
    );
    assert_eq!(by_task["resources-timeouts"]["verifier_timeout_sec"], 20.0);

    let refused: BTreeMap<String, String> = fixture
        .lines("harbor-refused.jsonl")
        .iter()
        .map(|line| {
            (
                line["task"].as_str().unwrap().to_owned(),
                line["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(refused.len(), 5, "{refused:?}");
    for (task, says) in [
        (
            "compose-services",
            "docker-compose.yaml: compose-based tasks",
        ),
        (
            "needs-build",
            "line 2: RUN needs an image build: set spec.sandbox.builds",
        ),
        ("build-copy", "line 3: COPY needs an image build"),
        ("separate-verifier", "verifier.environment"),
    ] {
        assert!(refused[task].contains(says), "{task}: {}", refused[task]);
    }

    // Planned again (a resumed run's plan), the rows are the same bytes.
    let first = std::fs::read(fixture.out().join("harbor-tasks.jsonl")).unwrap();
    let (again, _) = plan::plan(&fixture.location()).expect("planned again");
    assert_eq!(
        std::fs::read(fixture.out().join("harbor-tasks.jsonl")).unwrap(),
        first
    );
    assert_eq!(again.dataset.prompts, 5);
    assert_eq!(again.images.len(), 1, "{:?}", again.images);
}

/// `spec.dataset.excludeOracleFailures` leaves out the tasks an oracle run did not pass, by
/// their directory name, and names each in `harbor-refused.jsonl`; a task the report does not
/// hold is kept. The report is written here as merge writes one (the oracle on the real node
/// writes a real one: `tests/tests/real_pods/harbor.rs`).
#[test]
fn the_tasks_an_oracle_run_failed_are_left_out_by_name() {
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 1).with(
        "/dataset",
        json!({"path": "tasks", "format": "HarborTasks",
               "excludeOracleFailures": "runs/oracle"}),
    );
    copy_dir(&examples(), &fixture.root().join("tasks"));
    let missing = plan::plan(&fixture.location()).unwrap_err().to_string();
    assert!(
        missing.contains("spec.dataset.excludeOracleFailures")
            && missing.contains("runs/oracle/oracle.jsonl does not exist"),
        "{missing}"
    );

    let outcomes = [
        OracleOutcome::new(0, 0, (Some("answer-dockerfile"), None), Some(1.0), None),
        OracleOutcome::new(1, 0, (Some("answer-prebuilt"), None), Some(1.0), None),
        OracleOutcome::new(2, 0, (Some("wrong-solution"), None), Some(0.0), None),
    ];
    let report: String = outcomes
        .iter()
        .map(|outcome| serde_json::to_string(outcome).unwrap() + "\n")
        .collect();
    std::fs::create_dir_all(fixture.root().join("runs/oracle")).unwrap();
    std::fs::write(fixture.root().join("runs/oracle/oracle.jsonl"), report).unwrap();
    let (_, summary) = plan::plan(&fixture.location()).expect("planned with the report");
    assert_eq!(summary.prompts, 4, "the failed task is left out");
    let tasks: Vec<Value> = fixture
        .lines("harbor-tasks.jsonl")
        .iter()
        .map(|row| row["harbor"]["task"].clone())
        .collect();
    assert_eq!(
        tasks,
        [
            "answer-dockerfile",
            "answer-prebuilt",
            "resources-timeouts",
            "reward-json"
        ],
        "tasks the report does not hold are kept"
    );
    let refused = fixture.lines("harbor-refused.jsonl");
    let wrong = refused
        .iter()
        .find(|line| line["task"] == "wrong-solution")
        .unwrap_or_else(|| panic!("{refused:?}"));
    assert!(
        wrong["reason"]
            .as_str()
            .unwrap()
            .contains("failed the oracle in")
            && wrong["reason"]
                .as_str()
                .unwrap()
                .contains("(reward 0, not 1)"),
        "{wrong}"
    );
    assert_eq!(
        refused.len(),
        6,
        "the five that cannot run (three need a build), and the failed one"
    );
}

#[test]
fn a_path_without_tasks_is_refused_by_name() {
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 1).with(
        "/dataset",
        json!({"path": "datasets", "format": "HarborTasks"}),
    );
    let error = plan::plan(&fixture.location()).unwrap_err().to_string();
    assert!(
        error.contains("spec.dataset.path") && error.contains("holds no Harbor task"),
        "{error}"
    );
}

/// Harbor's own model (`harbor.models.task.config.TaskConfig`, through
/// `scripts/formats/harbor_tasks.py` in the formats venv) reads each example `task.toml` with
/// the values the plan reads: timeouts, image, working directory, resources, network, name,
/// verifier mode.
#[test]
fn harbors_own_task_model_reads_the_tasks_as_the_plan_does() {
    let python =
        trajectory_testkit::installed("TRAJ_FORMATS_PYTHON", "formats/install.sh", "--print-path");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/formats/harbor_tasks.py");
    let output = std::process::Command::new(&python)
        .arg(&script)
        .arg(examples())
        .output()
        .expect("the formats venv's python runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let harbor: Vec<Value> = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(harbor.len(), 10, "{harbor:?}");
    for line in &harbor {
        let task = line["task"].as_str().unwrap();
        let theirs = &line["config"];
        assert!(theirs.is_object(), "Harbor refused {task}: {line}");
        let text = std::fs::read_to_string(examples().join(task).join("task.toml")).unwrap();
        let (ours, ignored) = TaskConfig::parse(&text).unwrap();
        assert!(ignored.is_empty(), "{task}: {ignored:?}");
        let pairs = [
            (
                "verifier.timeout_sec",
                json!(ours.verifier.timeout_sec),
                &theirs["verifier"]["timeout_sec"],
            ),
            (
                "agent.timeout_sec",
                json!(ours.agent.timeout_sec),
                &theirs["agent"]["timeout_sec"],
            ),
            (
                "environment.docker_image",
                json!(ours.environment.docker_image),
                &theirs["environment"]["docker_image"],
            ),
            (
                "environment.workdir",
                json!(ours.environment.workdir),
                &theirs["environment"]["workdir"],
            ),
            (
                "environment.memory_mb",
                json!(ours.environment.memory_mb),
                &theirs["environment"]["memory_mb"],
            ),
            (
                "environment.storage_mb",
                json!(ours.environment.storage_mb),
                &theirs["environment"]["storage_mb"],
            ),
            (
                "environment.build_timeout_sec",
                json!(ours.environment.build_timeout_sec),
                &theirs["environment"]["build_timeout_sec"],
            ),
            (
                "environment.network_mode",
                json!(ours.network_mode()),
                &theirs["environment"]["network_mode"],
            ),
            ("task.name", json!(ours.name()), &theirs["task"]["name"]),
        ];
        for (field, ours, theirs) in pairs {
            let same = match (ours.as_f64(), theirs.as_f64()) {
                (Some(ours), Some(theirs)) => (ours - theirs).abs() < 1e-9,
                _ => &ours == theirs,
            };
            assert!(same, "{task} {field}: ours {ours}, Harbor's {theirs}");
        }
        // Harbor leaves the mode unset or says what it means: separate with an environment.
        let mode = theirs["verifier"]["environment_mode"].as_str().unwrap_or(
            if theirs["verifier"]["environment"].is_null() {
                "shared"
            } else {
                "separate"
            },
        );
        assert_eq!(
            ours.verifier_mode(),
            mode,
            "{task} verifier.environment_mode"
        );
        assert_eq!(
            json!(ours.environment.cpus).as_f64(),
            theirs["environment"]["cpus"].as_f64(),
            "{task} environment.cpus"
        );
    }
}

/// With `spec.sandbox.builds`, a task whose Dockerfile needs a build runs in the image of its
/// context: one line of the build list a distinct `environment/` (two tasks share one), its
/// context packed once under its digest, the rows naming `<repository>:<digest>`, the plan's
/// image groups marked with their line. `build-context` readies a line for the build container:
/// the context unpacked as packed, its bases rewritten as the run pulls images; a context changed
/// after the plan is refused by its digest.
#[test]
fn the_images_of_tasks_that_need_a_build_are_listed_once_per_context() {
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 1)
        .with("/dataset", json!({"path": "tasks", "format": "HarborTasks"}))
        .with(
            "/sandbox",
            json!({
                "builds": {"repository": "registry.test:5000/envs", "insecure": true},
                "imageRewrite": [{"from": "python:3.12-slim", "to": "registry.test:5000/tasks/python:1"}],
            }),
        );
    copy_dir(&examples(), &fixture.root().join("tasks"));
    let summary = plan::plan_for_operator(&fixture.location()).expect("planned");
    assert_eq!(summary.prompts, 8, "five, and three built");

    let builds = fixture.lines("harbor-builds.jsonl");
    assert_eq!(builds.len(), 2, "{builds:?}");
    assert_eq!(builds[0]["tasks"], json!(["build-copy", "build-copy-twin"]));
    assert_eq!(
        builds[0]["timeout_sec"], 300.0,
        "the tasks' build_timeout_sec"
    );
    assert_eq!(builds[1]["tasks"], json!(["needs-build"]));
    let hash = builds[0]["hash"].as_str().unwrap();
    let image = format!("registry.test:5000/envs:{hash}");
    assert_eq!(builds[0]["image"], json!(image));
    let packed = std::fs::read(fixture.out().join(format!("builds/{hash}.tar.gz"))).unwrap();
    let mut tar = Vec::new();
    flate2::read::GzDecoder::new(packed.as_slice())
        .read_to_end(&mut tar)
        .unwrap();
    assert_eq!(trajectory_worker::harbor::hex_sha256(&tar), hash);

    let rows = fixture.lines("harbor-tasks.jsonl");
    let row = |task: &str| {
        rows.iter()
            .find(|row| row["harbor"]["task"] == task)
            .unwrap_or_else(|| panic!("no row of {task}"))
    };
    assert_eq!(row("build-copy")["image"], json!(image));
    assert_eq!(row("build-copy-twin")["image"], json!(image));
    assert_eq!(row("build-copy")["cwd"], "/app", "the Dockerfile's WORKDIR");
    assert_eq!(row("answer-prebuilt")["image"], "python:3.12-slim");

    let groups = summary.images.expect("rows name images").listed;
    let line_of = |image: &str| {
        groups
            .iter()
            .find(|group| group.image == image)
            .unwrap_or_else(|| panic!("no group of {image}"))
            .build
    };
    assert_eq!(line_of(&image), Some(0));
    assert_eq!(line_of(builds[1]["image"].as_str().unwrap()), Some(1));
    assert_eq!(line_of("python:3.12-slim"), None, "pulled, not built");

    // Readied for the build container.
    let build_dir = tempfile::tempdir().unwrap();
    let order = trajectory_worker::run::builds::prepare(&fixture.location(), 0, build_dir.path())
        .expect("readied");
    assert_eq!(order.line, 0);
    assert_eq!(order.insecure_registries, ["registry.test:5000"]);
    let dockerfile = std::fs::read_to_string(build_dir.path().join("context/Dockerfile")).unwrap();
    assert!(
        dockerfile.starts_with("FROM registry.test:5000/tasks/python:1\n"),
        "{dockerfile}"
    );
    assert_eq!(
        std::fs::read_to_string(build_dir.path().join("context/word.txt")).unwrap(),
        "lighthouse\n"
    );
    let missing = trajectory_worker::run::builds::prepare(&fixture.location(), 2, build_dir.path())
        .unwrap_err()
        .to_string();
    assert!(missing.contains("has no line 3"), "{missing}");

    // A context changed after the plan is not built.
    let mut tampered = tar.clone();
    let at = tampered
        .windows(10)
        .position(|w| w == b"lighthouse")
        .unwrap();
    tampered[at] = b'L';
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, &tampered).unwrap();
    std::fs::write(
        fixture.out().join(format!("builds/{hash}.tar.gz")),
        gz.finish().unwrap(),
    )
    .unwrap();
    let refused = trajectory_worker::run::builds::prepare(
        &fixture.location(),
        0,
        tempfile::tempdir().unwrap().path(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        refused.contains("the context changed after the plan"),
        "{refused}"
    );
}

/// What the tasks ask of their containers (`cpus`, `memory_mb`, `storage_mb`) is kept per image,
/// the most any task of the image asks (resources-timeouts' here, the other tasks of
/// `python:3.12-slim` asking nothing), for the operator to set as the task containers' limits.
#[test]
fn the_tasks_resources_are_kept_per_image() {
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 1).with(
        "/dataset",
        json!({"path": "tasks", "format": "HarborTasks"}),
    );
    copy_dir(&examples(), &fixture.root().join("tasks"));
    let summary = plan::plan_for_operator(&fixture.location()).expect("planned");
    let groups = summary.images.expect("rows name images").listed;
    let asked: Vec<_> = groups
        .iter()
        .map(|group| (group.image.as_str(), group.resources))
        .collect();
    assert_eq!(
        asked,
        [(
            "python:3.12-slim",
            Some(trajectory_worker::contract::TaskResources {
                millicpus: Some(2000),
                memory_mb: Some(2048),
                storage_mb: Some(4096),
            })
        )]
    );
}

/// The tasks of the benchmark beside Harbor itself (`trajectory_testkit::side_by_side`) are
/// rows here, none refused: a Dockerfile that only names its base runs in that base.
#[test]
fn the_side_by_side_tasks_are_all_planned_as_rows() {
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 1)
        .with(
            "/dataset",
            json!({"path": "tasks", "format": "HarborTasks"}),
        )
        .with("/batchSize", json!(4));
    let names = side_by_side::write_answer_tasks(&fixture.root().join("tasks"), 6, "debian:12");
    plan::plan(&fixture.location()).expect("the tasks are planned");
    let rows = fixture.lines("harbor-tasks.jsonl");
    let planned: Vec<&str> = rows
        .iter()
        .map(|row| row["harbor"]["task"].as_str().unwrap())
        .collect();
    assert_eq!(planned, names);
    assert!(fixture.lines("harbor-refused.jsonl").is_empty());
    assert!(
        rows.iter().all(|row| row["image"] == "debian:12"),
        "{rows:?}"
    );
}

/// Harbor itself (`harbor run` with its `docker` environment, 0.25.0) over the benchmark's task
/// directory, its agent `scripts/harbor/scripted_agent.py` asking the same scripted model the
/// real-node half asks (`tests/tests/real_pods/side_by_side.rs`): one tool call, then a final
/// answer. Prints trajectories an hour, the machine's CPU time a trial (the idle machine's
/// subtracted), and the time from `harbor run` to the first model request. Run it under
/// `scripts/harbor/with-docker.sh` (dockerd, Harbor on `PATH`); `SIDE_BY_SIDE_TASKS` (128),
/// `SIDE_BY_SIDE_LATENCY_MS` (500), `SIDE_BY_SIDE_AT_ONCE` (8) and `SIDE_BY_SIDE_INIT` (1: the
/// compose overlay `init: true`, without which each trial waits out Docker's 10 s stop grace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: scripts/harbor/with-docker.sh cargo test ... -- --ignored (docs/benchmarks.md)"]
async fn bench_harbor_itself_on_the_side_by_side_tasks() {
    use std::time::Duration;
    use trajectory_testkit::scripted_server::{
        FixedLatency, ScriptedServer, text_reply, tool_call_reply,
    };
    let tasks = knob::<usize>("SIDE_BY_SIDE_TASKS", 128);
    let latency = Duration::from_millis(knob::<u64>("SIDE_BY_SIDE_LATENCY_MS", 500));
    let at_once = knob::<u64>("SIDE_BY_SIDE_AT_ONCE", 8);
    let harbor = std::env::var("HARBOR").expect(
        "HARBOR names the harbor CLI: run this under scripts/harbor/with-docker.sh, which sets it",
    );
    let model = ScriptedServer::start_fixed_latency(FixedLatency {
        latency,
        tool_call: tool_call_reply(
            "terminal",
            &json!({"command": side_by_side::ANSWER_COMMAND}),
        ),
        final_answer: text_reply("done"),
    })
    .await;
    let scratch = tempfile::tempdir().unwrap();
    side_by_side::write_answer_tasks(&scratch.path().join("tasks"), tasks, "local/debian:12");
    let overlay = scratch.path().join("overlay-init.yaml");
    std::fs::write(&overlay, "services:\n  main:\n    init: true\n").unwrap();
    let agents = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/harbor");
    let mut command = tokio::process::Command::new(&harbor);
    command
        .args(["run", "-p"])
        .arg(scratch.path().join("tasks"))
        .args([
            "-e",
            "docker",
            "-k",
            "1",
            "-y",
            "-q",
            "--job-name",
            "side-by-side",
        ])
        .args(["-n", &at_once.to_string()])
        .args(["-a", "scripted_agent:ScriptedAgent", "-o"])
        .arg(scratch.path().join("jobs"))
        .env("PYTHONPATH", &agents)
        .env("OPENAI_BASE_URL", model.base_url())
        .env("HARBOR_TELEMETRY", "0");
    if knob::<u64>("SIDE_BY_SIDE_INIT", 1) == 1 {
        command.arg("--extra-docker-compose").arg(&overlay);
    }
    let clock = side_by_side::RunClock::start().await;
    let status = command.status().await.expect("starting harbor");
    let figures = clock.summary(&model, tasks);
    assert!(status.success(), "harbor run: {status}");
    let job = scratch.path().join("jobs/side-by-side");
    let rewards: Vec<f64> = std::fs::read_dir(&job)
        .unwrap()
        .filter_map(|entry| {
            let result = entry.unwrap().path().join("result.json");
            let text = std::fs::read_to_string(result).ok()?;
            let result: Value = serde_json::from_str(&text).unwrap();
            Some(
                result["verifier_result"]["rewards"]["reward"]
                    .as_f64()
                    .unwrap_or(0.0),
            )
        })
        .collect();
    assert_eq!(rewards.len(), tasks, "a result for every trial");
    let passed = rewards.iter().filter(|reward| **reward >= 1.0).count();
    assert_eq!(
        model.request_count(),
        2 * tasks,
        "two model requests a trial"
    );
    eprintln!(
        "BENCH harbor, {at_once} at once: {tasks} trials ({passed} passed, model {latency:?} a \
         request) in {figures}"
    );
    assert_eq!(passed, tasks, "every trial passed: {rewards:?}");
}
