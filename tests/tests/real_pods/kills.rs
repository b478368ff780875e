//! Pods killed in the middle of their conversations (issue 42): a kill costs the turn each
//! conversation was in, not the conversation. A `SIGKILL`ed worker or an evicted pod is replaced
//! by its Job, and the replacement takes every unfinished conversation up from the turn log,
//! rebuilding its workspace or task container by replaying the recorded tool calls.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{EvictParams, ListParams, PostParams};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use trajectory_operator::api::{Phase, TrajectoryRun};
use trajectory_testkit::long_conversation::{self, CALLS_PER_CONVERSATION, Requests, TOOL_TURNS};
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_calls_reply};
use trajectory_tests::e2e::{phase_of, run_spec};
use trajectory_tests::real_pods::{
    batch_records, jsonl_lines, kill_container, kill_container_if_running, pod_template,
    pods_of_index,
};
use trajectory_tests::wait_until;

use super::{Setup, model_replying, terminal_call, write_image_rows};

/// Creates run `name` of two rows in the glibc task image (started in `/testbed`), one batch
/// worked two at a time against `model`; once `model` has had `requests` requests, and `settle`
/// later, calls `before_kill` and kills the worker of the batch's pod.
async fn run_two_rows_and_kill(
    setup: &Setup,
    name: &str,
    model: &ScriptedServer,
    (requests, settle): (usize, Duration),
    before_kill: impl FnOnce(),
) {
    let registry = trajectory_tests::real_pods::registry(trajectory_tests::real_pods::HOW_TO_RUN);
    let glibc = Some(format!("{registry}/tasks/glibc:1"));
    write_image_rows(
        setup,
        &[
            (glibc.clone(), None, "glibc", "/testbed"),
            (glibc, None, "glibc", "/testbed"),
        ],
    );
    let spec = json!({
        "dataset": {"path": "datasets/rows.jsonl"},
        "batchSize": 2, "workers": 1, "concurrency": 2,
    });
    setup
        .create_scripted(name, &setup.model_url(model), 0, &spec)
        .await;
    let job = format!("{name}-gen-1");
    let victim = wait_until(
        "the conversations at the kill's moment",
        Duration::from_secs(180),
        || async {
            let pod = pods_of_index(&setup.pods, &job, 0)
                .await
                .into_iter()
                .next()?;
            (model.request_count() >= requests).then_some(pod)
        },
    )
    .await;
    tokio::time::sleep(settle).await;
    let victim = setup.pods.get(&victim.name_any()).await.unwrap();
    before_kill();
    kill_container(&victim);
}

/// A pod of task containers whose worker is killed (SIGKILL) mid-batch is replaced by its Job's
/// retry, and the batch's conversations start over in fresh containers of their image: nothing the
/// killed pod's conversations wrote into the image is there. The new conversations look with the
/// file tools, which read the container's files by their absolute paths. Two requests for the
/// killed conversations, four for their new runs, no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_image_pod_killed_mid_batch_restarts_its_conversations_in_fresh_containers() {
    let setup = Setup::new("pods-task-kill").await;
    let leave = "echo killed-pod > /testbed/left-by-killed; echo written; sleep 100";
    let read = |path: &str| {
        (
            "read_file",
            Value::String(json!({ "path": path }).to_string()),
        )
    };
    let look = tool_calls_reply(&[read("/testbed/left-by-killed"), read("/task/marker")]);
    let model = model_replying([
        terminal_call(leave),
        terminal_call(leave),
        look.clone(),
        look,
    ])
    .await;
    // Both conversations asked for their command, which wrote its file and sleeps.
    run_two_rows_and_kill(
        &setup,
        "task-kill",
        &model,
        (2, Duration::from_secs(3)),
        || {},
    )
    .await;

    let records = succeeded_records(&setup, "task-kill", Duration::from_secs(300)).await;
    assert_eq!(records.len(), 2, "{records:#?}");
    for record in &records {
        let results: String = record["conversations"]
            .as_array()
            .expect("conversations")
            .iter()
            .filter(|turn| turn["from"] == "tool")
            .filter_map(|turn| turn["value"].as_str())
            .collect();
        assert!(
            results.contains("file not found: /testbed/left-by-killed")
                && !results.contains("killed-pod"),
            "a fresh container: {results}"
        );
        assert!(
            results.contains("1|glibc"),
            "read_file read the image's marker: {results}"
        );
    }
    assert_eq!(
        model.request_count(),
        6,
        "two killed, two redone with their answers"
    );
}

/// A pod of task containers killed (SIGKILL) in the middle of its conversations costs the turn
/// each was in, not the conversations (issue 42): the Job's next pod takes each up from the turn
/// log, replays its finished turn in a fresh container of its image (the file it wrote is there
/// again) and asks the model only for the rest. Four requests before the kill (each
/// conversation's first turn, then the turn the kill cut), four after (that turn again, then the
/// answer); starting the conversations over would have made six.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_image_pod_killed_mid_conversation_takes_it_up_in_fresh_containers() {
    let setup = Setup::new("pods-turn-kill").await;
    let killed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let after_kill = Arc::clone(&killed);
    let model =
        ScriptedServer::start_responding_on(IpAddr::V4(Ipv4Addr::UNSPECIFIED), move |body| {
            let turn = body["messages"].as_array().map_or(0, |messages| {
                messages
                    .iter()
                    .filter(|message| message["role"] == "assistant")
                    .count()
            });
            let command = match turn {
                0 => "echo from-turn-0 > /testbed/state && echo written",
                // Before the kill the second turn hangs, so the kill lands in it.
                1 if !after_kill.load(std::sync::atomic::Ordering::SeqCst) => "sleep 100",
                1 => "cat /testbed/state",
                _ => return Step::ok(text_reply("done")),
            };
            Step::ok(terminal_call(command))
        })
        .await;
    // Both conversations asked for their second turn: their first is in the turn log (a turn is
    // durable before the next model call).
    let before_kill = || killed.store(true, std::sync::atomic::Ordering::SeqCst);
    run_two_rows_and_kill(
        &setup,
        "turn-kill",
        &model,
        (4, Duration::from_secs(1)),
        before_kill,
    )
    .await;

    let records = succeeded_records(&setup, "turn-kill", Duration::from_secs(300)).await;
    assert_eq!(records.len(), 2, "{records:#?}");
    for record in &records {
        assert_eq!(record["resumed_from_turn"], 1, "{record}");
        assert_eq!(record["resume"]["replayed_calls"], 1, "{record}");
        let results: Vec<&str> = record["conversations"]
            .as_array()
            .expect("conversations")
            .iter()
            .filter(|turn| turn["from"] == "tool")
            .filter_map(|turn| turn["value"].as_str())
            .collect();
        assert_eq!(results.len(), 2, "{record}");
        assert!(
            results[1].contains("from-turn-0"),
            "the replay wrote the file again in the fresh container: {record}"
        );
    }
    assert_eq!(
        model.request_count(),
        8,
        "four before the kill; after it, the cut turn and the answer of each"
    );
}

/// Conversations of the long-conversation kill tests, two to a batch.
const LONG_TASKS: usize = 16;
const LONG_BATCH: usize = 2;
const KILLS: usize = 10;
/// What the model takes to answer each call.
const LONG_LATENCY: Duration = Duration::from_millis(100);

/// Long conversations (24 tool turns each: terminal and file tools changing the workspace, a
/// background job started in the first turn and checked in the last) in generation pods whose
/// worker is killed ten times at random moments, by `SIGKILL` or by an eviction with a second's
/// grace (a spot node's notice): every record once and whole, and the model asked at most once
/// per turn plus once per conversation in flight at each kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_conversations_in_pods_killed_ten_times_cost_a_turn_per_kill() {
    Box::pin(kill_long_conversations("pods-long-kills", None)).await;
}

/// As [`long_conversations_in_pods_killed_ten_times_cost_a_turn_per_kill`], each conversation in
/// a task container of its row's image (busybox, started in `/work`): a replacement rebuilds it
/// in a fresh container by replaying the recorded calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_conversations_in_task_containers_killed_ten_times_cost_a_turn_per_kill() {
    let registry = trajectory_tests::real_pods::registry(trajectory_tests::real_pods::HOW_TO_RUN);
    let image = format!("{registry}/tasks/busybox:1");
    Box::pin(kill_long_conversations(
        "pods-long-task-kills",
        Some((&image, "/work")),
    ))
    .await;
}

/// Runs [`LONG_TASKS`] long conversations, [`LONG_BATCH`] to a batch and one pod at a time, and
/// kills a pod [`KILLS`] times; then checks every record and counts the requests.
async fn kill_long_conversations(prefix: &str, image: Option<(&str, &str)>) {
    let setup = Setup::new(prefix).await;
    let requests = Requests::default();
    let counted = Arc::clone(&requests);
    let model =
        ScriptedServer::start_responding_on(IpAddr::V4(Ipv4Addr::UNSPECIFIED), move |body| {
            long_conversation::respond(&counted, LONG_LATENCY, body)
        })
        .await;
    let name = "long-kills";
    create_long_run(&setup, name, &model, image).await;
    let started = Instant::now();
    let (kills, in_flight_at_kills) = Box::pin(kill_ten_times(&setup, name, &requests)).await;

    let records = succeeded_records(&setup, name, Duration::from_secs(600)).await;
    let resumed = long_conversation::assert_every_task_once(&records, LONG_TASKS);
    let made: u64 = requests.lock().unwrap().values().sum();
    let ideal = LONG_TASKS as u64 * CALLS_PER_CONVERSATION;
    eprintln!(
        "{prefix}: {} kills {kills:?} in {:.0} s: {made} model requests for {ideal} turns; \
         {in_flight_at_kills} conversations in flight at the kills; {} taken up, from turns \
         {resumed:?}",
        kills.len(),
        started.elapsed().as_secs_f64(),
        resumed.len(),
    );
    assert!(
        made <= ideal + in_flight_at_kills,
        "{made} requests: more than the {ideal} turns plus one per conversation in flight at \
         each kill ({in_flight_at_kills})"
    );
}

/// Creates run `name` of the long conversations' rows (in `image`'s task containers, started in
/// its directory, when given) against `model`.
async fn create_long_run(
    setup: &Setup,
    name: &str,
    model: &ScriptedServer,
    image: Option<(&str, &str)>,
) {
    let rows: Vec<String> = (0..LONG_TASKS)
        .map(|task| {
            let mut row = long_conversation::row(task);
            if let Some((image, cwd)) = image {
                row["image"] = json!(image);
                row["cwd"] = json!(cwd);
            }
            row.to_string()
        })
        .collect();
    let dataset = tempfile::tempdir().unwrap();
    let file = dataset.path().join("long.jsonl");
    std::fs::write(&file, rows.join("\n") + "\n").unwrap();
    setup.storage.add_dataset(&file);
    let mut template = pod_template();
    // An eviction is a spot node's notice: the worker gets a second, then SIGKILL.
    template["terminationGracePeriodSeconds"] = json!(1);
    let spec = run_spec(
        &setup.model_url(model),
        &json!({
            "dataset": {"path": "datasets/long.jsonl"},
            "batchSize": LONG_BATCH, "workers": 1, "concurrency": LONG_BATCH,
            "agent": {"maxTurns": TOOL_TURNS + 5, "promptTimeoutSeconds": 600},
            // Every kill may land on one batch; a SIGKILL counts against its index.
            "retry": {"perBatch": KILLS + 2},
            "storage": setup.storage.spec(),
            "podTemplate": template,
        }),
    );
    setup
        .runs
        .create(&PostParams::default(), &TrajectoryRun::new(name, spec))
        .await
        .expect("create the run");
}

/// What one kill hit: how (`SIGKILL` or evicted), the pod, and its conversations in flight.
type Kill = (&'static str, String, usize);

/// Kills a generation pod of run `name` [`KILLS`] times, each a random moment after the model's
/// first request since the kill before, alternately by `SIGKILL` of its worker and by eviction;
/// returns the kills and the conversations in flight at them, summed.
async fn kill_ten_times(setup: &Setup, name: &str, requests: &Requests) -> (Vec<Kill>, u64) {
    let job = format!("{name}-gen-1");
    let run_dir = setup.storage.run_dir(setup.ns(), name);
    let batches = u32::try_from(LONG_TASKS.div_ceil(LONG_BATCH)).unwrap();
    let recorded = || -> HashSet<usize> {
        (0..batches)
            .flat_map(|batch| batch_records(&run_dir, batch))
            .filter_map(|record| record["prompt_index"].as_u64())
            .map(|index| usize::try_from(index).unwrap())
            .collect()
    };
    let seed: u64 = std::env::var("TRAJ_TURN_KILL_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!(
        "{}: kill moments drawn from seed {seed} (TRAJ_TURN_KILL_SEED)",
        setup.ns()
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut in_flight_at_kills = 0;
    let mut kills = Vec::new();
    let mut asked_before: HashMap<usize, u64> = HashMap::new();
    while kills.len() < KILLS {
        let total_before: u64 = asked_before.values().sum();
        let victim = wait_until(
            &format!("a pod of {job} asking the model after kill {}", kills.len()),
            Duration::from_secs(300),
            || async {
                let run = setup.runs.get(name).await.expect("get the run");
                assert!(
                    !phase_of(&run).is_some_and(Phase::is_finished),
                    "the run ended before kill {}: make the conversations longer",
                    kills.len() + 1
                );
                let asked: u64 = requests.lock().unwrap().values().sum();
                if asked <= total_before {
                    return None;
                }
                running_pod(setup, &job).await
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..2_000))).await;
        let Some(victim) = running_pod(setup, &job)
            .await
            .filter(|pod| pod.name_any() == victim.name_any())
        else {
            // Its batch ended first: no kill.
            continue;
        };
        let by_eviction = kills.len() % 2 == 1;
        if by_eviction {
            setup
                .pods
                .evict(&victim.name_any(), &EvictParams::default())
                .await
                .expect("evict the running pod");
        } else if kill_container_if_running(&victim) == 0 {
            // Its worker ended in the moment since it was seen running: no kill.
            continue;
        }
        gone(setup, &victim).await;
        // In flight at this kill: the conversations that asked the model since the kill before
        // and have no record.
        let asked = requests.lock().unwrap().clone();
        let done = recorded();
        let in_flight = asked
            .iter()
            .filter(|(task, count)| asked_before.get(task) != Some(count) && !done.contains(task))
            .count();
        in_flight_at_kills += in_flight as u64;
        let how = if by_eviction { "evicted" } else { "SIGKILL" };
        kills.push((how, victim.name_any(), in_flight));
        asked_before = asked;
    }
    (kills, in_flight_at_kills)
}

/// The records of run `name`, once it has succeeded (within `timeout`).
async fn succeeded_records(setup: &Setup, name: &str, timeout: Duration) -> Vec<Value> {
    let run = setup.finished(name, timeout).await;
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
    jsonl_lines(
        &setup
            .storage
            .run_dir(setup.ns(), name)
            .join("trajectories.jsonl"),
    )
}

/// A running pod of `job` that is not being deleted, if there is one.
async fn running_pod(setup: &Setup, job: &str) -> Option<Pod> {
    setup
        .pods
        .list(&ListParams::default().labels(&format!("job-name={job}")))
        .await
        .expect("list the Job's pods")
        .items
        .into_iter()
        .find(|pod| {
            pod.metadata.deletion_timestamp.is_none()
                && pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
}

/// Waits until `pod`'s worker has ended: the pod failed, or is gone.
async fn gone(setup: &Setup, pod: &Pod) {
    wait_until(
        &format!("pod {} to end", pod.name_any()),
        Duration::from_secs(60),
        || async {
            match setup
                .pods
                .get_opt(&pod.name_any())
                .await
                .expect("get the pod")
            {
                None => Some(()),
                Some(pod) => {
                    let phase = pod.status.as_ref().and_then(|s| s.phase.clone());
                    matches!(phase.as_deref(), Some("Failed" | "Succeeded")).then_some(())
                }
            }
        },
    )
    .await;
}
