//! The kill loop (issue 14, "exactly once"): a run of 1,000 prompts on the real control plane
//! while a chaos loop `SIGKILL`s 50 of its batch processes, restarts the operator 3 times and
//! wipes the run's status once, each at a random moment. The run must end `Succeeded` with every
//! prompt exactly once — in the merged output and in the batch files — having asked the model no
//! more than a run without faults does plus what the conversations in flight at the kills had
//! asked.
//!
//! The pods run as real processes of the worker's command line (the test-kubelet with
//! [`Kubelet::worker_binary`]), so a kill lands wherever the process is: between two model calls,
//! inside a tool, half-way through a record line, or while the `.done` marker is written. The
//! kubelet reports the killed container as a kubelet does (`Failed`, exit code 137) and the real
//! Job controller retries the index (`backoffLimitPerIndex`).
//!
//! What is counted, exactly: at each kill, the conversations the killed process had in flight —
//! those whose prompt it had sent to the model with no record of that prompt on storage, so also
//! a finished one whose line the writer had not yet committed (it groups the lines of 20 ms):
//! a kill can cost more conversations than `concurrency` — and the model requests they had made
//! (the "wasted" requests; since the turn log, a conversation killed after its tool turn was
//! committed is taken up and does not ask for that turn again, so fewer are really lost). Every
//! request names its prompt, and only one process works a batch
//! at a time, so the requests for a batch's prompts between one kill of it and the next come
//! from the process killed there.
//!
//! Why it fails if resume redoes finished work: a finished conversation is one with a record on
//! storage. Regenerating it costs model requests for a prompt that is not in flight at any kill,
//! so that prompt's requests exceed its two plus its wasted ones, and writing its record again
//! puts its key twice into the batch files: both are checked, per prompt.
//!
//! Needs a running cluster:
//! `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test kill_loop -- --nocapture`.
//! `TRAJ_KILL_LOOP_SEED=<n>` draws the faults' moments of an earlier run again (the test prints
//! its seed; which processes they hit depends on the run's timing).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::PostParams;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use trajectory_operator::api::{Phase, TrajectoryRun, TrajectoryRunStatus};
use trajectory_testkit::scripted_server::{ScriptedServer, first_user_message};
use trajectory_testkit::versitygw::{ACCESS_KEY, SECRET_KEY, Versitygw};
use trajectory_tests::e2e::{
    ControllerGuard, Kubelet, Scratch, batch_records, job_status, jsonl, model_with_latency,
    phase_of, run_spec, start_controller_in, write_dataset,
};
use trajectory_tests::{TestNamespace, client, install_crds};

const PROMPTS: u64 = 1_000;
const BATCH_SIZE: u64 = 10;
const KILLS: usize = 50;
const RESTARTS: usize = 3;
/// The model calls of a conversation without faults: the terminal tool call, then the answer.
const CALLS_PER_CONVERSATION: u64 = 2;
/// What a run without faults asks the model.
const IDEAL_REQUESTS: u64 = PROMPTS * CALLS_PER_CONVERSATION;
/// The most kills one batch takes. The Job controller holds the n-th retry of an index back for
/// 10 s × 2^(n−1), so a third kill of one batch would add 40 s to the run's tail.
const KILLS_PER_BATCH: usize = 2;
/// The retry budget of an index: an index fails once its pods failed more than `perBatch` times.
/// All 50 kills on one batch is the worst case of any choice of victims, so 50 retries cannot
/// run out however the kills fall (the loop kills a batch at most twice). No batch may fail.
const PER_BATCH_RETRIES: usize = KILLS;
/// A victim has run this long: past its start, into its conversations.
const MIN_RUNNING: Duration = Duration::from_millis(300);
/// When a kill's requests are counted: by then every request the process had sent has reached
/// the model server, and its batch's next pod cannot have started (the Job controller holds a
/// failed index back for at least 10 s, and the kubelet is checked not to have started it).
const SETTLE: Duration = Duration::from_secs(1);
/// The operator runs this long before a restart stops it: past its first list of runs and Jobs.
/// A controller told to stop before its cache is filled never stops (kube-runtime 5.0 holds its
/// reconciles until the cache is ready, and the shutdown has already cut the watch that fills it).
const OPERATOR_UP: Duration = Duration::from_secs(5);
const TIMEOUT: Duration = Duration::from_secs(600);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_through_50_kills_3_operator_restarts_and_a_status_wipe_generates_each_prompt_once() {
    Box::pin(kill_loop(None)).await;
}

/// The same on a bucket of a real S3 server: a kill there also loses the records of the part
/// its writer had not written yet, which the ledger counts as in flight (they have no record on
/// storage), so the same bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_bucket_a_run_through_50_kills_3_operator_restarts_and_a_wipe_generates_each_prompt_once()
 {
    let server = Versitygw::start("127.0.0.1");
    server.create_bucket("trajectories");
    Box::pin(kill_loop(Some(&server))).await;
}

/// The kill loop, on a volume, or on `bucket`'s bucket `trajectories` when given.
async fn kill_loop(bucket: Option<&Versitygw>) {
    let seed = std::env::var("TRAJ_KILL_LOOP_SEED")
        .ok()
        .map_or_else(rand::random, |seed| {
            seed.parse().expect("TRAJ_KILL_LOOP_SEED is a number")
        });
    eprintln!("kill loop: seed {seed} (TRAJ_KILL_LOOP_SEED={seed} draws these faults again)");
    let client = client().await;
    install_crds(&client).await;
    let namespace = TestNamespace::create(&client, "e2e-kill-loop").await;
    let ns = namespace.name();
    let scratch = Scratch::new();
    let (storage, spec_storage) = storage_of_the_run(bucket, &client, ns, &scratch).await;
    write_dataset(&storage, usize::try_from(PROMPTS).expect("a count"));
    // Each call takes a while, so that kills find conversations in flight.
    let model = model_with_latency(Duration::from_millis(100)).await;
    let mut kubelet = Kubelet::new(&client, ns, "chaos", &scratch);
    kubelet.worker_binary = Some(PathBuf::from(env!("CARGO_BIN_EXE_e2e-worker")));
    let mut chaos = Chaos {
        runs: Api::namespaced(client.clone(), ns),
        client: &client,
        ns,
        kubelet: &kubelet,
        model: &model,
        out: storage.join(format!("runs/{ns}/chaos")),
        rng: StdRng::seed_from_u64(seed),
        faults: Faults(VecDeque::new()),
        ledger: Ledger::default(),
        controller: None,
        operator_back_at: None,
        operator_up_since: Instant::now(),
        started: Instant::now(),
        timeline: Vec::new(),
    };
    chaos.faults = Faults::draw(&mut chaos.rng);
    chaos.controller = Some(start_controller_in(&client, ns));
    let spec = run_spec(
        &model.base_url(),
        &json!({
            "batchSize": BATCH_SIZE,
            "workers": 6,
            "concurrency": 4,
            "retry": {"perBatch": PER_BATCH_RETRIES, "maxFailedBatches": 0},
            "storage": spec_storage,
        }),
    );
    chaos
        .runs
        .create(&PostParams::default(), &TrajectoryRun::new("chaos", spec))
        .await
        .expect("create the run");
    let run = Box::pin(chaos.run_to_the_end()).await;
    let wall = chaos.started.elapsed();
    chaos.controller.take();
    let ledger = chaos.ledger;
    let requests = model.request_count() as u64;
    let in_flight: usize = ledger.kills.iter().map(|k| k.in_flight).sum();
    let wasted: u64 = ledger.kills.iter().map(|k| k.wasted).sum();
    let landed = ledger.kills.iter().filter(|k| k.in_flight > 0).count();
    eprintln!(
        "kill loop: {} in {:.1} s; {requests} model requests, ideal {IDEAL_REQUESTS}, {wasted} \
         of them by the {in_flight} conversations in flight at {} kills ({landed} kills found \
         some; at most {} kills a batch); {}",
        phase_of(&run).map_or("no phase", Phase::as_str),
        wall.as_secs_f64(),
        ledger.kills.len(),
        ledger.kills_of.values().max().copied().unwrap_or(0),
        chaos.timeline.join(", "),
    );
    let each: Vec<String> = ledger
        .kills
        .iter()
        .map(|k| format!("{}:{}/{}", k.batch, k.in_flight, k.wasted))
        .collect();
    eprintln!(
        "kill loop: kills as batch:in-flight/wasted: {}",
        each.join(" ")
    );

    let status = run.status.clone().expect("a status");
    assert_eq!(status.phase, Some(Phase::Succeeded), "{status:#?}");
    assert_eq!(ledger.kills.len(), KILLS, "kills");
    assert_eq!(
        chaos.timeline.len(),
        RESTARTS + 1,
        "restarts and the wipe: {:?}",
        chaos.timeline
    );
    assert!(landed > 0, "no kill found a conversation in flight");
    assert_eq!(status.progress.as_deref(), Some("100/100"));
    assert_eq!(status.attempt, Some(1), "one generation Job did it all");
    assert_every_prompt_merged_once(&chaos.out);
    assert_every_record_written_once(&chaos.out);
    assert_requests_were_not_redone(&ledger, requests, wasted);
    assert_each_kill_was_a_failed_pod_and_every_other_pod_succeeded(&client, ns, &kubelet).await;
}

/// Where the run's files are as this test sees them, and the spec's `storage` for it: the
/// scratch volume, or the bucket `trajectories` of `bucket` (its keys in a Secret of `ns`).
async fn storage_of_the_run(
    bucket: Option<&Versitygw>,
    client: &kube::Client,
    ns: &str,
    scratch: &Scratch,
) -> (PathBuf, Value) {
    let Some(server) = bucket else {
        return (scratch.storage(), json!({"volume": {"emptyDir": {}}}));
    };
    let prefix = server.bucket_dir("trajectories").join("chaos");
    std::fs::create_dir_all(prefix.join("datasets")).expect("the dataset's prefix");
    let keys: Secret = serde_json::from_value(json!({
        "metadata": {"name": "bucket-keys"},
        "stringData": {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY},
    }))
    .expect("a Secret");
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &keys)
        .await
        .expect("create the bucket's Secret");
    let object = json!({"object": {
        "url": "s3://trajectories/chaos",
        "endpoint": server.endpoint,
        "pathStyle": true,
        "credentialsSecret": "bucket-keys",
    }});
    (prefix, object)
}

/// The run and the faults done to it.
struct Chaos<'a> {
    runs: Api<TrajectoryRun>,
    client: &'a kube::Client,
    ns: &'a str,
    kubelet: &'a Kubelet,
    model: &'a ScriptedServer,
    /// The run's output directory.
    out: PathBuf,
    rng: StdRng,
    faults: Faults,
    ledger: Ledger,
    controller: Option<ControllerGuard>,
    /// When the operator stopped by a restart starts again.
    operator_back_at: Option<Instant>,
    operator_up_since: Instant,
    started: Instant,
    /// When the operator restarts and the wipe happened.
    timeline: Vec<String>,
}

impl Chaos<'_> {
    /// Plays the run's pods and does each fault when it is due, until the run has finished;
    /// then counts the requests of the last kills.
    async fn run_to_the_end(&mut self) -> TrajectoryRun {
        loop {
            self.kubelet.play_pending().await;
            let run = self.runs.get("chaos").await.expect("get the run");
            if matches!(phase_of(&run), Some(Phase::Succeeded | Phase::Failed)) {
                // Every kill was counted long ago: its batch had to run again since.
                assert!(self.ledger.unsettled.is_empty());
                self.ledger.catch_up(self.model);
                return run;
            }
            assert!(
                self.started.elapsed() < TIMEOUT,
                "the run did not finish within {TIMEOUT:?}: {:#?}; {} kills so far",
                run.status,
                self.ledger.kills.len()
            );
            if self.operator_back_at.is_some_and(|at| Instant::now() >= at) {
                self.operator_back_at = None;
                self.controller = Some(start_controller_in(self.client, self.ns));
                self.operator_up_since = Instant::now();
            }
            self.ledger.settle(self.model, &self.out, self.kubelet);
            if let Some(fault) = self.faults.due(self.model.request_count() as u64)
                && self.fault(fault).await
            {
                self.faults.done();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Does the fault; false when it cannot be done now (no process to kill, the operator down or
    /// just started).
    async fn fault(&mut self, fault: Fault) -> bool {
        let when = format!(
            "{:.1} s, {} requests",
            self.started.elapsed().as_secs_f64(),
            self.model.request_count()
        );
        match fault {
            Fault::Kill => self.ledger.kill_one(self.kubelet, &mut self.rng).await,
            // An operator restart: the process gone, and back a little later (a new pod).
            Fault::Restart => {
                if self.operator_up_since.elapsed() < OPERATOR_UP {
                    return false;
                }
                let Some(controller) = self.controller.take() else {
                    return false;
                };
                controller.stop().await;
                self.operator_back_at = Some(Instant::now() + Duration::from_secs(2));
                self.timeline.push(format!("operator restarted at {when}"));
                true
            }
            Fault::Wipe => {
                wipe_status(&self.runs, "chaos").await;
                self.timeline.push(format!("status wiped at {when}"));
                true
            }
        }
    }
}

/// What the chaos loop does at a moment it drew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill,
    Restart,
    Wipe,
}

/// The faults to come, each at a random point of the run's progress, measured in model requests
/// (the ideal run makes [`IDEAL_REQUESTS`]): the kills spread over most of it, the restarts and
/// the wipe over its middle.
struct Faults(VecDeque<(u64, Fault)>);

impl Faults {
    fn draw(rng: &mut StdRng) -> Self {
        // A point between two percentages of the ideal run.
        let mut at = |from: u64, to: u64| {
            rng.random_range(IDEAL_REQUESTS * from / 100..IDEAL_REQUESTS * to / 100)
        };
        let mut faults = Vec::new();
        faults.extend((0..KILLS).map(|_| (at(2, 85), Fault::Kill)));
        faults.extend((0..RESTARTS).map(|_| (at(10, 90), Fault::Restart)));
        faults.push((at(20, 80), Fault::Wipe));
        faults.sort_by_key(|(at, _)| *at);
        Self(faults.into())
    }

    /// The next fault, once the run has made `requests` model requests.
    fn due(&self, requests: u64) -> Option<Fault> {
        self.0
            .front()
            .and_then(|&(at, fault)| (requests >= at).then_some(fault))
    }

    fn done(&mut self) {
        self.0.pop_front();
    }
}

/// The model's requests by prompt, and what each kill cost.
#[derive(Debug, Default)]
struct Ledger {
    /// The prompt of every model request so far, in arrival order.
    prompts: Vec<u64>,
    /// Per batch, how many of `prompts` its kills accounted for (the later ones of its prompts
    /// are its next process's).
    accounted: BTreeMap<u32, usize>,
    /// Kills whose requests are not counted yet: the batch, when, and its plays then.
    unsettled: Vec<(u32, Instant, usize)>,
    kills: Vec<Kill>,
    kills_of: BTreeMap<u32, usize>,
    /// The requests of each prompt that kills wasted.
    wasted_of: BTreeMap<u64, u64>,
}

/// What one kill cost.
#[derive(Debug)]
struct Kill {
    batch: u32,
    /// Conversations the process had started (a request for the prompt) and not recorded.
    in_flight: usize,
    /// The model requests those conversations had made.
    wasted: u64,
}

impl Ledger {
    /// `SIGKILL`s a random batch process that has run a while, whose batch took fewer than
    /// [`KILLS_PER_BATCH`] kills; false when there is none, or when it ended by itself first.
    async fn kill_one(&mut self, kubelet: &Kubelet, rng: &mut StdRng) -> bool {
        let victims: Vec<_> = kubelet
            .running_batches()
            .into_iter()
            .filter(|running| running.running_for >= MIN_RUNNING)
            .filter(|running| {
                self.kills_of.get(&running.batch).copied().unwrap_or(0) < KILLS_PER_BATCH
            })
            .collect();
        let Some(victim) = victims.choose(rng) else {
            return false;
        };
        let Some(ended) = kubelet.kill(&victim.pod).await else {
            return false;
        };
        if ended.exit_code != 137 {
            return false;
        }
        *self.kills_of.entry(victim.batch).or_default() += 1;
        self.unsettled.push((
            victim.batch,
            Instant::now(),
            kubelet.started_pods(victim.batch),
        ));
        true
    }

    /// Counts the requests of the kills at least [`SETTLE`] ago: the conversations each killed
    /// process had in flight, and their requests.
    fn settle(&mut self, model: &ScriptedServer, out: &Path, kubelet: &Kubelet) {
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.unsettled)
            .into_iter()
            .partition(|(_, at, _)| at.elapsed() >= SETTLE);
        self.unsettled = later;
        if due.is_empty() {
            return;
        }
        self.catch_up(model);
        for (batch, _, plays) in due {
            assert!(
                kubelet.started_pods(batch) == plays,
                "batch {batch} ran again within {SETTLE:?} of its kill: its requests cannot be \
                 told apart"
            );
            let recorded: BTreeSet<u64> = batch_records(out, Some(batch))
                .iter()
                .map(|record| record.prompt_index)
                .collect();
            let from = self.accounted.get(&batch).copied().unwrap_or(0);
            let mut requests_of: BTreeMap<u64, u64> = BTreeMap::new();
            for &prompt in &self.prompts[from..] {
                if prompt / BATCH_SIZE == u64::from(batch) && !recorded.contains(&prompt) {
                    *requests_of.entry(prompt).or_default() += 1;
                }
            }
            self.accounted.insert(batch, self.prompts.len());
            for (&prompt, &requests) in &requests_of {
                *self.wasted_of.entry(prompt).or_default() += requests;
            }
            self.kills.push(Kill {
                batch,
                in_flight: requests_of.len(),
                wasted: requests_of.values().sum(),
            });
        }
    }

    /// Reads the requests the model server received since the last look.
    fn catch_up(&mut self, model: &ScriptedServer) {
        self.prompts.extend(
            model
                .requests_since(self.prompts.len())
                .iter()
                .map(|request| prompt_of(&request.body)),
        );
    }
}

/// The prompt a request is about: its user message is the dataset's "task number N".
fn prompt_of(body: &Value) -> u64 {
    first_user_message(body)
        .strip_prefix("task number ")
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("a request without a dataset prompt: {body}"))
}

/// Replaces the run's status with an empty one, as a user of `kubectl edit --subresource=status`
/// or a backup restored without status would.
async fn wipe_status(runs: &Api<TrajectoryRun>, name: &str) {
    for _ in 0..10 {
        let mut run = runs.get_status(name).await.expect("get the run's status");
        run.status = Some(TrajectoryRunStatus::default());
        match runs
            .replace_status(name, &PostParams::default(), &run)
            .await
        {
            Ok(_) => return,
            // The operator wrote the status meanwhile.
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(e) => panic!("wiping the status of {name}: {e}"),
        }
    }
    panic!("the status of {name} kept changing under the wipe");
}

/// `trajectories.jsonl` and `failures.jsonl` hold every prompt exactly once between them.
fn assert_every_prompt_merged_once(out: &Path) {
    let mut merged: Vec<u64> = jsonl(&out.join("trajectories.jsonl"))
        .iter()
        .map(|line| line["prompt_index"].as_u64().expect("prompt_index"))
        .collect();
    let trajectories = merged.len();
    let failures = out.join("failures.jsonl");
    if failures.exists() {
        merged.extend(
            jsonl(&failures)
                .iter()
                .map(|line| line["prompt_index"].as_u64().expect("prompt_index")),
        );
    }
    let records = merged.len();
    merged.sort_unstable();
    merged.dedup();
    assert_eq!(
        (records as u64, merged),
        (PROMPTS, (0..PROMPTS).collect::<Vec<u64>>()),
        "{trajectories} trajectories, {} failures",
        records - trajectories
    );
}

/// The batch files hold 1,000 records, no (prompt, sample) twice, each in its batch's files: no
/// finished conversation was recorded again.
fn assert_every_record_written_once(out: &Path) {
    let records = batch_records(out, None);
    let mut seen = BTreeSet::new();
    let twice: Vec<_> = records
        .iter()
        .filter(|record| !seen.insert((record.prompt_index, record.sample)))
        .collect();
    assert!(
        twice.is_empty(),
        "{} records written again, the first: {:?}",
        twice.len(),
        &twice[..twice.len().min(10)]
    );
    assert_eq!(
        records.len() as u64,
        PROMPTS,
        "record lines in the batch files"
    );
    assert!(
        records
            .iter()
            .all(|record| record.prompt_index / BATCH_SIZE == u64::from(record.batch)),
        "a record in another batch's file"
    );
}

/// Between the ideal and the ideal plus what the in-flight conversations had asked at the kills
/// — and so, per prompt, at least its two requests and no more than those plus what its kills cut
/// off: no finished conversation was asked for again. (Fewer than that is the turn log's doing: a
/// conversation killed after its tool turn was committed is taken up with only its answer to
/// ask, issue 42.)
fn assert_requests_were_not_redone(ledger: &Ledger, requests: u64, wasted: u64) {
    assert_eq!(ledger.prompts.len() as u64, requests);
    let in_flight: u64 = ledger.kills.iter().map(|k| k.in_flight as u64).sum();
    assert!(
        (IDEAL_REQUESTS..=IDEAL_REQUESTS + wasted).contains(&requests),
        "{requests} model requests; ideal {IDEAL_REQUESTS}, wasted by kills {wasted}"
    );
    assert!(
        wasted <= CALLS_PER_CONVERSATION * in_flight,
        "{wasted} wasted by {in_flight}"
    );
    let mut requests_of: BTreeMap<u64, u64> = BTreeMap::new();
    for &prompt in &ledger.prompts {
        *requests_of.entry(prompt).or_default() += 1;
    }
    let redone: Vec<(u64, u64, u64)> = (0..PROMPTS)
        .filter_map(|prompt| {
            let made = requests_of.get(&prompt).copied().unwrap_or(0);
            let wasted = ledger.wasted_of.get(&prompt).copied().unwrap_or(0);
            (made < CALLS_PER_CONVERSATION || made > CALLS_PER_CONVERSATION + wasted)
                .then_some((prompt, made, wasted))
        })
        .collect();
    assert!(
        redone.is_empty(),
        "prompts whose requests are not between two and two plus those their kills cut off \
         (prompt, requests, cut off): {redone:?}"
    );
}

/// The kubelet reported each kill as a failed pod (exit code 137) and the Job counted each; every
/// other pod ended with exit code 0, and none is left running.
async fn assert_each_kill_was_a_failed_pod_and_every_other_pod_succeeded(
    client: &kube::Client,
    ns: &str,
    kubelet: &Kubelet,
) {
    assert!(kubelet.running_batches().is_empty());
    let played = kubelet.played();
    let failed: Vec<_> = played.iter().filter(|p| p.exit_code != 0).collect();
    assert!(
        failed.len() == KILLS
            && failed
                .iter()
                .all(|p| p.exit_code == 137 && p.mode == "batch"),
        "{failed:#?}"
    );
    let status = job_status(client, ns, "chaos-gen-1").await;
    assert_eq!(
        (
            status.failed,
            status.completed_indexes.as_deref(),
            status.failed_indexes.as_deref()
        ),
        (i32::try_from(KILLS).ok(), Some("0-99"), Some("")),
        "{status:#?}"
    );
}
