//! `batch`: generate the records of one batch, resuming from what storage already holds.
//!
//! The batch's lines are read from their byte range in the dataset (checked against the plan's
//! digest), every (prompt, sample) without a record is run with `concurrency` conversations in
//! flight, and each finished conversation becomes one record line, rendered by [`crate::hermes`]:
//! a trajectory, a discarded record or a failed record (and, when the run asks for the `OpenAI`
//! form, a trajectory's twin in the writer's `.openai.jsonl` file, written just before it and
//! carrying its `finished_at`). One writer thread appends lines whole and fsyncs them (grouping
//! the lines that arrive within a short commit interval). When every (prompt, sample) has a
//! record, the `.done` marker is written atomically. A killed batch loses at most its in-flight
//! conversations.
//!
//! # Two writers of one batch
//!
//! A pod of a partitioned node can still be running while the Job runs its index again, and a
//! re-created run can start while old pods are in their grace period. Each run of a batch is
//! therefore a writer of its own, with a random [`WriterId`], and writes only files it created
//! (`batches/batch-NNNNNN/w-<writer>.jsonl` and its `.openai.jsonl` twin; see
//! [`RunDir::batch_records_of`]): it never opens another writer's file for writing, never cuts a
//! torn tail (a reader skips it), and removes its files again if it wrote no line. Resume and merge
//! read every records file of the batch (and the single `batch-NNNNNN.jsonl` of older workers) and
//! union them by (`prompt_index`, sample).
//!
//! That is chosen over a fencing token: a token must be checked on every commit against a shared
//! record of the current holder, and on NFS that check and the append cannot be made one atomic
//! step, nor can `O_APPEND` keep two clients' writes apart. A file per writer needs no
//! coordination, and merge keeps one record per key anyway. What it costs: two writers that
//! overlap both run the keys neither had recorded when the later one started, so the overlap
//! spends tokens twice (a second writer reads the others' records at its start only), and either
//! `.done` marker, written last, says the same thing: every key has a record. A `local` run also
//! holds a `flock` on its output directory (a second one is refused), and temp names are unique
//! per writer (not per pid: every pod is PID 1).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tempfile::TempDir;
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{Instrument, info, info_span, warn};

use super::ledger::{Admission, Ledger, Ticket};
use super::manifest::Manifest;
use super::sampling::{ENOUGH_PASSED, Next, Schedule};
use super::segments::segment_digest;
use super::{RunError, RunLocation};
use crate::agent::{AgentConfig, Conversation, ConversationError, Spent, run_conversation};
use crate::contract::BatchSummary;
use crate::dataset::{LineReader, MAX_LINE_BYTES, Row, parse_row, without_bom};
use crate::distribution::Distribution;
use crate::hermes::{
    Failure, RecordContext, RecordIdentity, reasoning_stats, system_turn, timestamp,
    write_discarded_record, write_failed_record, write_openai_record, write_trajectory_record,
};
use crate::model::limits::Limits;
use crate::model::{ApiKey, Circuit, ModelClient, ModelSettings, Spending};
use crate::spec::{RunSpec, VerifierSpec};
use crate::storage::{RecordsWriter, RunDir, StorageError, WriterId};
use crate::tools::sandbox::{LandlockMode, Place, Sandbox};
use crate::tools::{Registry, Tool, ToolContext, ToolLimits, ToolSpec, Workspace};
use crate::verify::{Verification, Verifier};

/// What a process needs to run conversations, built once and shared by all batches.
#[derive(Debug, Clone)]
pub struct Engine {
    pub client: ModelClient,
    pub registry: Registry,
    pub distribution: Distribution,
    pub agent: AgentConfig,
    pub limits: ToolLimits,
    pub workspace_root: PathBuf,
    pub keep_workspaces: bool,
    /// How terminal commands are confined: by default this binary as the executor, Landlock
    /// where the kernel has it.
    pub sandbox: Sandbox,
    /// Set in a pod whose task containers run the rows' images: the directory of their sockets
    /// ([`crate::contract::paths::task_socket`]), one container a conversation of the batch.
    pub task_sockets: Option<PathBuf>,
    /// Set in a pod of rows whose image could not be pulled: why. Each of its conversations is
    /// recorded failed (`image_unavailable`) without a model request.
    pub image_unavailable: Option<String>,
    pub require_reasoning: bool,
    /// How rows' verifiers run, and the default one.
    pub verifier: VerifierSpec,
    /// Verified conversations below this reward are discarded (`below_reward`).
    pub min_reward: Option<f64>,
    /// A prompt's sampling stops once this many of its samples passed.
    pub passes_per_prompt: Option<u32>,
    pub openai_format: bool,
    pub seed: u64,
    pub samples_per_prompt: u32,
    pub concurrency: usize,
    /// Time in-flight conversations get to finish after a shutdown request.
    pub grace: Duration,
    /// What the run spends, counted with its other processes when it has prices, and
    /// `spec.model.budget` when it has one: conversations start only while it has room.
    pub ledger: Option<Arc<Ledger>>,
}

impl Engine {
    /// Builds the engine from a spec, finding the API key by the contract's rules.
    pub fn new(spec: &RunSpec, workspace_root: PathBuf) -> Result<Self, RunError> {
        let api_key =
            ApiKey::discover(spec.model.api_key_env.as_deref()).map_err(RunError::Spec)?;
        let settings = ModelSettings::from_spec(&spec.model, api_key)
            .map_err(|err| RunError::Spec(err.to_string()))?;
        Self::with_client(
            spec,
            workspace_root,
            ModelClient::new(settings).map_err(|err| RunError::Spec(err.to_string()))?,
        )
    }

    /// Counts what the run spends in `ledger` (its client adds each completion's cost to it),
    /// and holds it to the ledger's budget: conversations start only while it has room.
    pub fn keep_ledger(&mut self, ledger: Arc<Ledger>) {
        self.client = self.client.with_spending(ledger.spending());
        self.ledger = Some(ledger);
    }

    /// Holds the model's requests to this process's share of `spec.model.limits` and of the
    /// limits the provider tells, as one of `processes` that may run the run's batches at once
    /// (its `workers` on a cluster; a local run is one).
    pub fn keep_limits(&mut self, spec: &RunSpec, processes: u64) {
        if let Some(limits) = Limits::share(spec.model.limits.as_ref(), processes) {
            self.client = self.client.with_limits(Arc::new(limits));
        }
    }

    /// Builds the engine around a given client.
    pub fn with_client(
        spec: &RunSpec,
        workspace_root: PathBuf,
        client: ModelClient,
    ) -> Result<Self, RunError> {
        crate::tools::http::check_values(&spec.tools).map_err(RunError::Spec)?;
        let registry =
            Registry::builtin_with(&spec.tools, Sandbox::for_sessions(&spec.sandbox).as_ref());
        let distribution = Distribution::resolve(&spec.distribution, &registry)
            .map_err(|err| RunError::Spec(err.to_string()))?;
        std::fs::create_dir_all(&workspace_root)
            .map_err(|err| StorageError::new("creating", &workspace_root, err))?;
        Ok(Self {
            client,
            registry,
            distribution,
            agent: AgentConfig {
                max_turns: spec.agent.max_turns,
                prompt_timeout: Duration::from_secs(spec.agent.prompt_timeout_seconds),
                ephemeral_system_prompt: spec.agent.ephemeral_system_prompt.clone(),
            },
            limits: ToolLimits {
                command_timeout: Duration::from_secs(spec.tools.terminal.timeout_seconds),
                max_output_bytes: usize::try_from(spec.tools.terminal.max_output_bytes)
                    .unwrap_or(usize::MAX),
                ..ToolLimits::default()
            },
            workspace_root,
            keep_workspaces: spec.tools.keep_workspaces,
            sandbox: Sandbox::local(LandlockMode::Auto),
            task_sockets: None,
            image_unavailable: None,
            require_reasoning: spec.filters.require_reasoning,
            verifier: spec.verifier.clone().unwrap_or_default(),
            min_reward: spec.filters.min_reward,
            passes_per_prompt: spec
                .verifier
                .as_ref()
                .and_then(|verifier| verifier.passes_per_prompt),
            openai_format: spec.openai_format,
            seed: spec.seed,
            samples_per_prompt: spec.samples_per_prompt,
            concurrency: usize::try_from(spec.concurrency).unwrap_or(1),
            grace: Duration::from_secs(20),
            ledger: None,
        })
    }
}

/// Tells running batches to stop taking new work.
#[derive(Debug, Clone)]
pub struct Shutdown(watch::Receiver<bool>);

/// The sending side of [`Shutdown`].
#[derive(Debug)]
pub struct ShutdownTrigger(watch::Sender<bool>);

impl ShutdownTrigger {
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }
}

/// A trigger and its signal.
pub fn shutdown_channel() -> (ShutdownTrigger, Shutdown) {
    let (sender, receiver) = watch::channel(false);
    (ShutdownTrigger(sender), Shutdown(receiver))
}

impl Shutdown {
    pub fn is_triggered(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once shutdown was requested.
    pub async fn wait(&self) {
        let mut receiver = self.0.clone();
        // An error means the trigger was dropped: nobody can ask any more, so never resolve.
        if receiver.wait_for(|triggered| *triggered).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// The outcome of one (prompt, sample), for progress displays; ordered from the best record of a
/// key to the worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ConversationOutcome {
    Succeeded,
    Discarded,
    Failed,
}

/// What a running batch tells its progress display.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// The batch found this many records of an earlier run on storage (told once, at its start,
    /// when there are any), so a display need not read the batch files itself.
    Resumed(u64),
    /// One (prompt, sample) has its record on the way to storage.
    Finished(ConversationOutcome),
}

/// The fields of a record line that bookkeeping needs.
#[derive(Debug, Deserialize)]
pub(crate) struct RecordKey {
    pub prompt_index: u64,
    #[serde(default)]
    pub sample: u32,
    #[serde(default)]
    pub status: Option<String>,
    /// A verified record's verdict.
    #[serde(default)]
    pub verification: Option<Verdict>,
    /// What its model calls cost, when priced or reported.
    #[serde(default)]
    pub cost: Option<RecordCost>,
}

/// A record's `cost`, as bookkeeping reads it.
#[derive(Debug, Deserialize)]
pub(crate) struct RecordCost {
    pub total: f64,
}

/// Whether a verified record passed.
#[derive(Debug, Deserialize)]
pub(crate) struct Verdict {
    #[serde(default)]
    pub passed: bool,
}

/// The `.done` marker.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DoneMarker {
    batch: u32,
    succeeded: u64,
    discarded: u64,
    failed: u64,
    /// What the model calls of the batch's records cost (USD, a decimal string), when any was
    /// priced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cost: Option<String>,
    finished_at: String,
}

/// Runs one batch to completion (or until shutdown or a permanent error): reads its rows, finds
/// the records every earlier or concurrent writer left, runs every (prompt, sample) without one
/// while this writer appends their records to its own files, then marks the batch done.
#[tracing::instrument(
    name = "batch",
    skip_all,
    fields(run = %location.plan.name, batch, writer = tracing::field::Empty)
)]
pub async fn run_batch(
    engine: &Engine,
    location: &RunLocation,
    manifest: &Manifest,
    batch: u32,
    shutdown: &Shutdown,
    progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<BatchSummary, RunError> {
    let run_dir = location.run_dir();
    let Some(layout) = manifest.batches.get(batch as usize) else {
        return Err(RunError::BadBatchInput(format!(
            "batch {batch} does not exist; the plan has {} batches",
            manifest.batch_count()
        )));
    };
    if let Some(summary) = done_summary(&run_dir, batch) {
        info!("batch already done");
        return Ok(summary);
    }
    let first_prompt = manifest.first_prompt(batch);
    let rows = read_batch_rows(location, manifest, batch, layout)?;

    // Creating its file is the check that the volume takes writes (a read-only volume refuses
    // it), before any conversation starts. The records of other writers are read after it, so a
    // writer that finished in between is seen.
    let writer_id = WriterId::random();
    tracing::Span::current().record("writer", writer_id.as_str());
    let openai_path = engine
        .openai_format
        .then(|| run_dir.batch_openai_records_of(batch, &writer_id));
    let records_writer = run_dir.store().records_writer(
        &run_dir.batch_records_of(batch, &writer_id),
        openai_path.as_deref(),
    )?;
    let Existing {
        keys: existing,
        passed,
        mut summary,
        mean_record_bytes,
        ..
    } = existing_records(&run_dir, batch)?;
    summary.resumed = summary.succeeded + summary.discarded + summary.failed;
    if summary.resumed > 0 {
        progress(Progress::Resumed(summary.resumed));
    }
    let pending = pending_items(
        rows.len(),
        first_prompt,
        engine.samples_per_prompt,
        &existing,
    );
    require_room(
        &run_dir,
        pending.len(),
        mean_record_bytes,
        engine.openai_format,
    )?;
    info!(
        pending = pending.len(),
        resumed = summary.resumed,
        "starting batch"
    );

    let (lines, writer) = spawn_writer(records_writer);
    let context = BatchContext::new(location, manifest, batch);
    let shared = Arc::new(Shared::new(engine, rows, first_prompt, context));
    let schedule = Schedule::new(pending, engine.passes_per_prompt, passed);
    let stop = run_pending(&shared, schedule, shutdown, lines, &mut summary, progress).await?;
    shared.stop_reusing_workspaces();
    let mut removals = std::mem::take(&mut *lock(&shared.removals));
    writer
        .await
        .map_err(|err| RunError::Internal(format!("record writer panicked: {err}")))??;

    if let Some(error) = stop {
        return Err(error);
    }
    if shutdown.is_triggered() {
        return Err(RunError::Interrupted);
    }
    let expected = shared.rows.len() as u64 * u64::from(engine.samples_per_prompt);
    // The marker says what storage holds now, not what this writer counted: records it found at
    // its start may be gone since (a merge that found them missing reopened the batch for them,
    // and a marker written from this writer's count would close it again over the gap).
    let on_storage = existing_records(&run_dir, batch)?;
    let recorded = on_storage.keys.len() as u64;
    if recorded < expected {
        return Err(RunError::RecordsLost(format!(
            "batch {batch}: {recorded} of its {expected} keys have a record on storage after \
             this writer ran; records it counted at its start are gone, so the batch is not \
             marked done and runs again for the missing keys"
        )));
    }
    let cost = on_storage.cost.map(crate::contract::usd_text);
    let marker = write_done_marker(&run_dir, batch, (&on_storage.summary, cost), expected)?;
    // The batch leaves no workspace behind (most were removed while it ran).
    while removals.join_next().await.is_some() {}
    info!(
        succeeded = marker.succeeded,
        discarded = marker.discarded,
        failed = marker.failed,
        "batch done"
    );
    Ok(BatchSummary {
        batch,
        succeeded: marker.succeeded,
        discarded: marker.discarded,
        failed: marker.failed,
        resumed: summary.resumed,
        stopped: None,
        cost: marker.cost,
        run_spent: None,
        landlock: None,
    })
}

/// What the batch's `.done` marker records, if it has one (an unreadable marker counts as none:
/// the batch runs again, resuming from its records).
fn done_summary(run_dir: &RunDir, batch: u32) -> Option<BatchSummary> {
    let bytes = run_dir.store().read(&run_dir.batch_done(batch)).ok()?;
    let marker = serde_json::from_slice::<DoneMarker>(&bytes).ok()?;
    Some(BatchSummary {
        batch,
        succeeded: marker.succeeded,
        discarded: marker.discarded,
        failed: marker.failed,
        resumed: marker.succeeded + marker.discarded + marker.failed,
        stopped: None,
        cost: marker.cost,
        run_spent: None,
        landlock: None,
    })
}

/// The batch's (prompt, sample)s without a record on storage, in dataset order.
fn pending_items(
    prompts: usize,
    first_prompt: u64,
    samples_per_prompt: u32,
    existing: &HashSet<(u64, u32)>,
) -> Vec<(u64, u32)> {
    (0..prompts as u64)
        .flat_map(|offset| {
            (0..samples_per_prompt).map(move |sample| (first_prompt + offset, sample))
        })
        .filter(|key| !existing.contains(key))
        .collect()
}

/// Starts the single writer of the batch's files on the blocking pool; it stops when the sender
/// is dropped, or at its first error.
fn spawn_writer(records: RecordsWriter) -> (RecordSender, WriterHandle) {
    let (sender, receiver) = mpsc::unbounded_channel::<Lines>();
    let (failed, failure) = watch::channel(false);
    let writer = tokio::task::spawn_blocking(move || {
        let result = write_lines(receiver, records);
        if result.is_err() {
            failed.send_replace(true);
        }
        result
    });
    (
        RecordSender {
            lines: sender,
            failure,
        },
        writer,
    )
}

type WriterHandle = JoinHandle<Result<(), RunError>>;

/// The way to the writer, and the signal that it stopped at an error (a full or failing volume):
/// the batch then stops at once, rather than spend tokens on records it cannot save.
struct RecordSender {
    lines: mpsc::UnboundedSender<Lines>,
    failure: watch::Receiver<bool>,
}

impl RecordSender {
    /// Resolves once the writer failed.
    async fn failed(&self) {
        let mut failure = self.failure.clone();
        // An error means the writer ended without failing: nothing to report, ever.
        if failure.wait_for(|failed| *failed).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Runs the pending (prompt, sample)s, `concurrency` at a time, and sends each record to the
/// writer. After a shutdown request, or an error that no other prompt can get past, it starts no
/// more; it returns that error (a configuration error outranks an unreachable server).
async fn run_pending(
    shared: &Arc<Shared>,
    mut pending: Schedule,
    shutdown: &Shutdown,
    lines: RecordSender,
    summary: &mut BatchSummary,
    progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<Option<RunError>, RunError> {
    let mut running = JoinSet::new();
    let mut stop: Option<RunError> = None;
    let mut over_budget = false;
    loop {
        while stop.is_none()
            && !over_budget
            && !shared.circuit.is_open()
            && running.len() < shared.engine.concurrency.max(1)
        {
            if shutdown.is_triggered() {
                break;
            }
            let ticket = match admit(&shared.engine, &pending).await? {
                None => None,
                Some(Admission::Start(ticket)) => Some(ticket),
                Some(Admission::Wait) if running.is_empty() => {
                    // Another batch of this process runs the conversation that tells what one
                    // costs: look again shortly.
                    tokio::time::sleep(ADMISSION_RECHECK).await;
                    continue;
                }
                Some(Admission::Wait) => break,
                Some(Admission::Exhausted) => {
                    over_budget = true;
                    break;
                }
            };
            match pending.take_next() {
                Next::Run(prompt_index, sample) => {
                    spawn_item(
                        &mut running,
                        shared,
                        shutdown,
                        (prompt_index, sample),
                        ticket,
                    );
                }
                Next::Skip(prompt_index, sample) => {
                    let line = skipped_line(shared, prompt_index, sample);
                    summary.discarded += 1;
                    if lines
                        .lines
                        .send(Lines {
                            main: line,
                            openai: None,
                        })
                        .is_err()
                    {
                        break;
                    }
                    progress(Progress::Finished(ConversationOutcome::Discarded));
                }
                Next::Wait => break,
                Next::Done => {
                    // No conversation will start any more: idle workspaces can go now, during
                    // the batch's tail, rather than all at its end.
                    shared.stop_reusing_workspaces();
                    break;
                }
            }
        }
        let joined = tokio::select! {
            joined = running.join_next() => joined,
            // Dropping the set abandons the conversations in flight; the writer's error is the
            // batch's.
            () = lines.failed() => break,
        };
        let Some(joined) = joined else {
            break;
        };
        let (prompt_index, result) =
            joined.map_err(|err| RunError::Internal(format!("a conversation panicked: {err}")))?;
        pending.finished(
            prompt_index,
            matches!(result, Some(Item::Record { passed: true, .. })),
        );
        match result {
            Some(Item::Record {
                outcome,
                line,
                openai,
                ..
            }) => {
                match outcome {
                    ConversationOutcome::Succeeded => summary.succeeded += 1,
                    ConversationOutcome::Discarded => summary.discarded += 1,
                    ConversationOutcome::Failed => summary.failed += 1,
                }
                if lines.lines.send(Lines { main: line, openai }).is_err() {
                    // The writer stopped on an error, which it reports to the batch; dropping the
                    // set abandons the conversations in flight.
                    break;
                }
                progress(Progress::Finished(outcome));
            }
            // A configuration error outranks an unreachable server.
            Some(Item::Stop(error))
                if stop
                    .as_ref()
                    .is_none_or(|first| matches!(first, RunError::ModelUnavailable(_))) =>
            {
                stop = Some(error);
            }
            // A shutdown dropped the conversation, or a weightier stop came first.
            None | Some(Item::Stop(_)) => {}
        }
    }
    Ok(stop.or_else(|| stopped_early(shared, &pending, over_budget)))
}

/// Why a batch left conversations unstarted though none of them stopped it: the run's budget
/// had no room for more, or the circuit opened on a failing server.
fn stopped_early(shared: &Shared, pending: &Schedule, over_budget: bool) -> Option<RunError> {
    if pending.is_empty() {
        return None;
    }
    if let (true, Some(ledger)) = (over_budget, &shared.engine.ledger) {
        return Some(super::ledger::exhausted(ledger, pending.len()));
    }
    shared.circuit.is_open().then(|| {
        RunError::ModelUnavailable(format!(
            "{} model calls in a row failed, so the batch started no more conversations \
             ({} not started)",
            shared.circuit.threshold(),
            pending.len()
        ))
    })
}

/// How soon a batch with nothing in flight asks the budget again after it said to wait.
const ADMISSION_RECHECK: Duration = Duration::from_millis(100);

/// Whether the budget lets the next conversation start (`None`: the run keeps no budget, or
/// nothing is pending). Asked before the conversation leaves the schedule, so that one the budget
/// has no room for stays pending (and runs once the budget is raised).
async fn admit(engine: &Engine, pending: &Schedule) -> Result<Option<Admission>, RunError> {
    match &engine.ledger {
        Some(budget) if !pending.is_empty() => budget.admit().await.map(Some),
        _ => Ok(None),
    }
}

/// Starts one (prompt, sample) as a task of its own, so that conversations (and rendering their
/// records) use every core. After a shutdown request it gets the engine's grace period to
/// finish, then ends without a record (`None`).
fn spawn_item(
    running: &mut JoinSet<(u64, Option<Item>)>,
    shared: &Arc<Shared>,
    shutdown: &Shutdown,
    (prompt_index, sample): (u64, u32),
    ticket: Option<Ticket>,
) {
    let (shared, shutdown) = (Arc::clone(shared), shutdown.clone());
    running.spawn(async move {
        let work = run_item(
            &shared,
            prompt_index,
            sample,
            ticket.as_ref().map(Ticket::spending),
        );
        let result = tokio::select! {
            result = work => Some(result),
            () = async { shutdown.wait().await; tokio::time::sleep(shared.engine.grace).await } => None,
        };
        // What it cost is in the run's spending by now; its reservation goes back, and the next
        // conversations' estimate learns from it.
        if let Some(ticket) = ticket {
            ticket.end(match &result {
                Some(Item::Record { cost, .. }) => *cost,
                _ => None,
            });
        }
        (prompt_index, result)
    });
}

/// Writes the `.done` marker of a batch whose writer stopped without an error. Every line it was
/// sent is then on storage: the records found there at the start and those counted as they were
/// sent are what storage holds (no need to read the file again); fewer than `expected` is a bug.
fn write_done_marker(
    run_dir: &RunDir,
    batch: u32,
    (summary, cost): (&BatchSummary, Option<String>),
    expected: u64,
) -> Result<DoneMarker, RunError> {
    let marker = DoneMarker {
        batch,
        succeeded: summary.succeeded,
        discarded: summary.discarded,
        failed: summary.failed,
        cost,
        finished_at: timestamp(chrono::Utc::now()),
    };
    let recorded = marker.succeeded + marker.discarded + marker.failed;
    if recorded < expected {
        return Err(RunError::Internal(format!(
            "batch {batch} has {recorded} records of {expected} after its run"
        )));
    }
    let marker_json =
        serde_json::to_vec(&marker).map_err(|err| RunError::Internal(err.to_string()))?;
    let store = run_dir.store();
    if store.is_bucket() {
        // Of two writers that finished the batch at once, the first one's marker stays (both
        // counted the same records). An object is never torn, so there is no unreadable marker
        // to replace, as there can be on a volume.
        store.create_once(&run_dir.batch_done(batch), &marker_json)?;
    } else {
        store.write_atomic(&run_dir.batch_done(batch), &marker_json)?;
    }
    Ok(marker)
}

/// Reads the batch's rows from its byte range, after checking the dataset segments the range
/// touches against the plan's digests.
fn read_batch_rows(
    location: &RunLocation,
    manifest: &Manifest,
    batch: u32,
    layout: &super::manifest::BatchLayout,
) -> Result<Vec<Row>, RunError> {
    let path = location.dataset_path();
    let bad = |message: String| RunError::BadBatchInput(format!("{}: {message}", path.display()));
    let changed = |what: String| {
        bad(format!(
            "the dataset changed since the plan: {what} (batch {batch}, bytes {}..{})",
            layout.start(),
            layout.end()
        ))
    };
    let dataset = &manifest.dataset;
    let segment = dataset.segment_bytes.max(1);
    // The whole segments around the range: [first_segment * segment, window_end).
    let first_segment = layout.start() / segment;
    let window_start = first_segment * segment;
    let window_end = layout
        .end()
        .div_ceil(segment)
        .saturating_mul(segment)
        .min(dataset.bytes);
    let window = location
        .store
        .read_range(&path, window_start..window_end)
        .map_err(|err| {
            dataset_read_error(&path, err.source, |err| bad(format!("cannot open: {err}")))
        })?;
    if window.len() as u64 != window_end - window_start {
        return Err(changed(format!(
            "cannot read bytes {window_start}..{window_end}: the file ends at byte {}",
            window_start + window.len() as u64
        )));
    }
    for (index, bytes) in window
        .chunks(usize::try_from(segment).unwrap_or(usize::MAX))
        .enumerate()
    {
        let number = first_segment + index as u64;
        let offset = number * segment;
        let expected = usize::try_from(number)
            .ok()
            .and_then(|number| dataset.segment_digests.get(number));
        let digest = segment_digest(offset, bytes);
        if expected != Some(&digest) {
            return Err(changed(format!(
                "segment {number} (bytes {offset}..{}) has digest {digest}, the plan recorded {}",
                offset + bytes.len() as u64,
                expected.map_or("none", String::as_str)
            )));
        }
    }
    let range = usize::try_from(layout.start() - window_start).unwrap_or(usize::MAX)
        ..usize::try_from(layout.end() - window_start).unwrap_or(usize::MAX);
    let mut reader = LineReader::new(&window[range], MAX_LINE_BYTES);
    let mut buffer = Vec::new();
    let mut rows = Vec::new();
    let field = &location.plan.spec.dataset.prompt_field;
    while let Some(info) = reader
        .next_line(&mut buffer, &mut |_| {})
        .map_err(|err| bad(format!("cannot read: {err}")))?
    {
        if info.too_long {
            continue;
        }
        let line = without_bom(layout.start() + info.offset, &buffer);
        if let Ok(row) = parse_row(line, field) {
            rows.push(row);
        }
    }
    let expected = manifest.prompts_in(batch);
    if rows.len() as u64 != expected {
        return Err(changed(format!(
            "it has {} valid lines where the plan counted {expected}",
            rows.len()
        )));
    }
    Ok(rows)
}

/// What storage holds of a batch when it starts.
struct Existing {
    keys: HashSet<(u64, u32)>,
    /// Samples whose verifier passed, by prompt.
    passed: HashMap<u64, u32>,
    summary: BatchSummary,
    /// Mean size of its record lines, when it has any.
    mean_record_bytes: Option<u64>,
    /// What the model calls of all its records cost (every line, a key's records in several
    /// files each counted: each was paid for), when any was priced.
    cost: Option<f64>,
}

/// A dataset read error as the batch reports it: a dataset gone or shorter than the plan recorded
/// has changed (`changed`: bad input, exit 65); any other error (EIO, ESTALE on NFS, a timeout) is
/// the storage's, and transient: the batch's input may be fine on the next attempt.
fn dataset_read_error(
    path: &std::path::Path,
    error: std::io::Error,
    changed: impl FnOnce(std::io::Error) -> RunError,
) -> RunError {
    match error.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::UnexpectedEof => changed(error),
        _ => StorageError::new("reading the dataset", path, error).into(),
    }
}

/// Keys of the records already on storage, in every records file of the batch, and their counts
/// by outcome. A key with records in several files counts once, by its best record (a trajectory,
/// then a discarded, then a failed one: the record merge keeps).
fn existing_records(run_dir: &RunDir, batch: u32) -> Result<Existing, RunError> {
    let files = run_dir.records_files(batch)?;
    let read = run_dir
        .store()
        .read_files_lines_into(files.iter().map(|file| file.records.as_path()), Vec::new())?;
    let (data, lines) = (&read.data, &read.lines);
    let mean_record_bytes = (!lines.is_empty()).then(|| {
        let bytes: usize = lines.iter().map(|(start, end)| end - start + 1).sum();
        (bytes / lines.len()) as u64
    });
    let mut keys: HashMap<(u64, u32), ConversationOutcome> = HashMap::with_capacity(lines.len());
    let mut passed_keys: HashSet<(u64, u32)> = HashSet::new();
    let mut cost: Option<f64> = None;
    for (index, &(start, end)) in lines.iter().enumerate() {
        let Ok(key) = serde_json::from_slice::<RecordKey>(&data[start..end]) else {
            let file = files[read.file_of(index)].records.display();
            warn!(batch, %file, "skipping an unreadable record line");
            continue;
        };
        if let Some(record_cost) = &key.cost {
            *cost.get_or_insert(0.0) += record_cost.total;
        }
        let outcome = match key.status.as_deref() {
            None => ConversationOutcome::Succeeded,
            Some("discarded") => ConversationOutcome::Discarded,
            Some(_) => ConversationOutcome::Failed,
        };
        keys.entry((key.prompt_index, key.sample))
            .and_modify(|best| *best = (*best).min(outcome))
            .or_insert(outcome);
        // A failed record's verdict (a conversation out of time) is no kept pass.
        if outcome != ConversationOutcome::Failed
            && key.verification.is_some_and(|verdict| verdict.passed)
        {
            passed_keys.insert((key.prompt_index, key.sample));
        }
    }
    let mut passed: HashMap<u64, u32> = HashMap::new();
    for (prompt_index, _) in passed_keys {
        *passed.entry(prompt_index).or_default() += 1;
    }
    let mut summary = BatchSummary {
        batch,
        ..BatchSummary::default()
    };
    for outcome in keys.values() {
        match outcome {
            ConversationOutcome::Succeeded => summary.succeeded += 1,
            ConversationOutcome::Discarded => summary.discarded += 1,
            ConversationOutcome::Failed => summary.failed += 1,
        }
    }
    Ok(Existing {
        keys: keys.into_keys().collect(),
        passed,
        summary,
        mean_record_bytes,
        cost,
    })
}

/// Bytes a record is expected to take when the batch has none yet to measure: a typical
/// trajectory of a few turns with tool output (the size the renderer reserves for one).
const TYPICAL_RECORD_BYTES: u64 = 16 * 1024;

/// Checks, before a token is spent, that the batch's output fits: twice the expected size of its
/// pending records (the mean of its records so far, or [`TYPICAL_RECORD_BYTES`], whichever is
/// larger; doubled again for the `OpenAI` form), plus 64 KiB for the marker and the filesystem's
/// own rounding. Twice, because record sizes vary with the conversation: the margin turns most
/// "full halfway through" into "full before starting"; what it misses, the writer's first ENOSPC
/// stops at once.
fn require_room(
    run_dir: &RunDir,
    pending: usize,
    mean_record_bytes: Option<u64>,
    openai: bool,
) -> Result<(), StorageError> {
    let record = mean_record_bytes
        .unwrap_or(0)
        .max(TYPICAL_RECORD_BYTES)
        .saturating_mul(if openai { 2 } else { 1 });
    let needed = (pending as u64)
        .saturating_mul(record)
        .saturating_mul(2)
        .saturating_add(64 * 1024);
    if run_dir.store().is_bucket() {
        return Ok(());
    }
    crate::storage::require_free_space(&run_dir.batches_dir(), needed)
}

/// What every conversation task of a batch reads.
struct Shared {
    engine: Engine,
    rows: Vec<Row>,
    first_prompt: u64,
    context: BatchContext,
    /// What is offered for each combination of toolsets drawn so far.
    offered: Mutex<HashMap<Vec<String>, Arc<Offered>>>,
    /// Workspaces that conversations left as they were made, for the next ones.
    idle_workspaces: Mutex<Vec<WorkspaceDir>>,
    /// Set once no conversation will start: workspaces are removed rather than kept idle.
    draining: AtomicBool,
    /// Workspace removals on the blocking pool (awaited before the batch returns).
    removals: Mutex<JoinSet<()>>,
    /// Sees every model call of the batch; once open, no conversation starts.
    circuit: Arc<Circuit>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The tools of one combination of toolsets, with what every record offered them repeats.
struct Offered {
    toolsets: Vec<String>,
    tools: Vec<Arc<dyn Tool>>,
    specs: Vec<ToolSpec>,
    system_turn: String,
}

impl Shared {
    /// One copy, for all the batch's conversation tasks, of what they read.
    fn new(engine: &Engine, rows: Vec<Row>, first_prompt: u64, context: BatchContext) -> Self {
        let circuit = Arc::new(Circuit::for_concurrency(engine.concurrency.max(1)));
        let mut engine = engine.clone();
        engine.client = engine.client.with_circuit(Arc::clone(&circuit));
        engine.registry = engine.registry.with_frozen_mcp(&context.mcp_tools);
        Self {
            circuit,
            engine,
            rows,
            first_prompt,
            offered: Mutex::default(),
            idle_workspaces: Mutex::default(),
            draining: AtomicBool::new(false),
            removals: Mutex::default(),
            context,
        }
    }

    /// Where the conversation's commands run: the engine's sandbox, or in a pod of task
    /// containers the one of the conversation (its slot is its place in the batch), starting in
    /// the row's `cwd`.
    fn sandbox_of(&self, prompt_index: u64, sample: u32, row: &Row) -> Sandbox {
        let engine = &self.engine;
        match &engine.task_sockets {
            Some(dir) => {
                let slot = (prompt_index - self.first_prompt)
                    * u64::from(engine.samples_per_prompt)
                    + u64::from(sample);
                engine.sandbox.clone().in_task_container(
                    crate::contract::paths::task_socket(dir, slot),
                    crate::dataset::row_cwd(&row.source),
                )
            }
            None => engine.sandbox.clone(),
        }
    }

    fn offered(&self, toolsets: &[String]) -> Arc<Offered> {
        let mut known = lock(&self.offered);
        if let Some(offered) = known.get(toolsets) {
            return Arc::clone(offered);
        }
        let tools = self.engine.registry.tools_for(toolsets);
        let specs: Vec<ToolSpec> = tools.iter().map(|tool| tool.spec().clone()).collect();
        let offered = Arc::new(Offered {
            toolsets: toolsets.to_vec(),
            system_turn: system_turn(&specs),
            tools,
            specs,
        });
        known.insert(toolsets.to_vec(), Arc::clone(&offered));
        offered
    }

    /// An empty workspace: an idle one, or a new directory. Creating (and removing) directories
    /// blocks on the filesystem, so it runs off the async threads.
    async fn workspace(&self, prompt_index: u64, sample: u32) -> std::io::Result<WorkspaceDir> {
        let keep = self.engine.keep_workspaces;
        if !keep && let Some(idle) = lock(&self.idle_workspaces).pop() {
            return Ok(idle);
        }
        // Kept workspaces are named after their conversation; reused ones cannot be.
        let prefix = if keep {
            format!("p{prompt_index}-s{sample}-")
        } else {
            "conversation-".to_owned()
        };
        let root = self.engine.workspace_root.clone();
        tokio::task::spawn_blocking(move || {
            let dir = tempfile::Builder::new().prefix(&prefix).tempdir_in(&root)?;
            let workspace = Workspace::new(dir.path())?;
            let made = DirStamp::of(dir.path())?;
            Ok(WorkspaceDir {
                dir,
                workspace,
                made,
            })
        })
        .await
        .unwrap_or_else(|err| Err(std::io::Error::other(err)))
    }

    /// Keeps, reuses or removes a finished conversation's workspace. `untouched`: only tools that
    /// change nothing ran; `ended`: the conversation ended by itself (not by its time budget),
    /// so every tool call in it returned.
    fn release_workspace(&self, lent: WorkspaceDir, untouched: bool, ended: bool) {
        if self.engine.keep_workspaces {
            let _kept = lent.dir.keep();
        } else if !self.draining.load(Ordering::SeqCst)
            && (untouched || ended && self.left_as_made(&lent))
        {
            lock(&self.idle_workspaces).push(lent);
        } else {
            self.remove(lent.dir);
        }
    }

    /// Whether a workspace in which commands ran is still as it was made, so that the next
    /// conversation cannot tell it from a new one: empty, with the same mode and change time.
    /// Creating, removing or renaming an entry, and changing the mode, owner, ACLs or extended
    /// attributes, all set the change time, which no call can set back. (On a kernel without
    /// multigrain timestamps a change within the same clock tick as the directory's creation
    /// could keep the old time; the emptiness and mode checks do not depend on it.)
    ///
    /// Reusing matters: removing a directory and making the next one cost 0.1–0.3 ms of CPU per
    /// conversation on ext4 (more on one without a journal, which skips inodes freed in the last
    /// minute), a third of the terminal path's client CPU besides the executor (issue 13).
    ///
    /// Only where the terminal's executor runs under this worker: a call returns once the
    /// executor has reaped every process the command started (a timed-out command included), so
    /// nothing can still write into the directory. In a pod the sandbox container ends a
    /// timed-out command on its own time, so those workspaces are never reused. Two syscalls of
    /// metadata on a directory just used, cheap enough for the async thread.
    fn left_as_made(&self, lent: &WorkspaceDir) -> bool {
        matches!(self.engine.sandbox.place, Place::Local { .. })
            && DirStamp::of(lent.dir.path()).is_ok_and(|now| now == lent.made)
            && std::fs::read_dir(lent.dir.path()).is_ok_and(|mut entries| entries.next().is_none())
    }

    /// Removes a workspace on the blocking pool (the record need not wait for it).
    fn remove(&self, dir: TempDir) {
        let mut removals = lock(&self.removals);
        while removals.try_join_next().is_some() {}
        removals.spawn_blocking(move || drop(dir));
    }

    fn stop_reusing_workspaces(&self) {
        self.draining.store(true, Ordering::SeqCst);
        let idle = std::mem::take(&mut *lock(&self.idle_workspaces));
        for lent in idle {
            self.remove(lent.dir);
        }
    }
}

/// A conversation's workspace directory (removed when dropped), and how it looked when made.
struct WorkspaceDir {
    dir: TempDir,
    workspace: Workspace,
    made: DirStamp,
}

/// What [`Shared::left_as_made`] compares: the directory's inode, mode and change time.
#[derive(Debug, PartialEq, Eq)]
struct DirStamp {
    inode: u64,
    mode: u32,
    changed: (i64, i64),
}

impl DirStamp {
    fn of(path: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::symlink_metadata(path)?;
        Ok(Self {
            inode: meta.ino(),
            mode: meta.mode(),
            changed: (meta.ctime(), meta.ctime_nsec()),
        })
    }
}

/// Whether every tool the conversation ran leaves the workspace as it found it (a call of an
/// unknown tool runs nothing).
fn only_read_only_tools_ran(conversation: &Conversation, tools: &[Arc<dyn Tool>]) -> bool {
    conversation.messages.iter().all(|message| match message {
        crate::model::Message::Assistant(assistant) => assistant.tool_calls.iter().all(|call| {
            tools
                .iter()
                .find(|tool| tool.spec().name == call.name)
                .is_none_or(|tool| tool.read_only())
        }),
        _ => true,
    })
}

/// What every record of the batch repeats.
struct BatchContext {
    id_prefix: String,
    batch: u32,
    catalog: Vec<String>,
    /// The MCP tools the plan froze.
    mcp_tools: Vec<crate::tools::mcp::FrozenServer>,
    model: String,
}

impl BatchContext {
    fn new(location: &RunLocation, manifest: &Manifest, batch: u32) -> Self {
        Self {
            id_prefix: manifest
                .spec_hash
                .trim_start_matches("blake3:")
                .chars()
                .take(12)
                .collect(),
            batch,
            catalog: manifest.tool_catalog.clone(),
            mcp_tools: manifest.mcp_tools.clone(),
            model: location.plan.spec.model.name.clone(),
        }
    }
}

enum Item {
    Record {
        outcome: ConversationOutcome,
        line: Vec<u8>,
        openai: Option<Vec<u8>>,
        /// The row's verifier passed it.
        passed: bool,
        /// What its model calls cost (USD), when priced or reported.
        cost: Option<f64>,
    },
    /// Stop the batch: no other prompt can succeed now.
    Stop(RunError),
}

struct Lines {
    main: Vec<u8>,
    openai: Option<Vec<u8>>,
}

/// Commits of the batch file are at least this far apart. Each fsync costs a journal commit and a
/// disk round trip, CPU taken from the conversations on the same cores; under load one commit now
/// covers every record finished in the interval. A record reaches storage at most this much later
/// (a kill loses it like any in-flight conversation: it is run again on resume); when records are
/// rare, each is committed as soon as it arrives.
const COMMIT_INTERVAL: Duration = Duration::from_millis(20);

/// The single writer: appends what arrived since the last commit with one write and one fsync per
/// file (on a bucket, gathers it into the part being filled, written when full or old enough).
fn write_lines(
    mut receiver: mpsc::UnboundedReceiver<Lines>,
    mut records: RecordsWriter,
) -> Result<(), RunError> {
    let runtime = tokio::runtime::Handle::current();
    let mut last_commit: Option<Instant> = None;
    loop {
        let first = match records.deadline() {
            None => receiver.blocking_recv(),
            Some(deadline) => {
                let next = tokio::time::timeout_at(deadline.into(), receiver.recv());
                match runtime.block_on(next) {
                    Ok(next) => next,
                    Err(_elapsed) => {
                        records.flush()?;
                        continue;
                    }
                }
            }
        };
        let Some(first) = first else { break };
        if let Some(wait) = last_commit.and_then(|at| COMMIT_INTERVAL.checked_sub(at.elapsed())) {
            std::thread::sleep(wait);
        }
        last_commit = Some(Instant::now());
        let mut group = vec![first];
        while let Ok(more) = receiver.try_recv() {
            group.push(more);
        }
        let group: Vec<(&[u8], Option<&[u8]>)> = group
            .iter()
            .map(|lines| (lines.main.as_slice(), lines.openai.as_deref()))
            .collect();
        records.append(&group)?;
    }
    // The batch ended (done, stopped or interrupted): what is gathered is written.
    records.flush()?;
    Ok(())
}

/// The failure class of a conversation whose row's image could not be pulled.
pub const IMAGE_UNAVAILABLE: &str = "image_unavailable";

/// Runs one (prompt, sample) and renders its record line; its model calls count into
/// `spending` (its budget's ticket's) when the run has a budget.
async fn run_item(
    shared: &Shared,
    prompt_index: u64,
    sample: u32,
    spending: Option<Arc<Spending>>,
) -> Item {
    let (engine, context) = (&shared.engine, &shared.context);
    let row =
        &shared.rows[usize::try_from(prompt_index - shared.first_prompt).unwrap_or(usize::MAX)];
    let id = format!("{}-{prompt_index}-{sample}", context.id_prefix);
    let identity = RecordIdentity {
        id: &id,
        prompt_index,
        sample,
        batch: context.batch,
    };
    let started_at = chrono::Utc::now();
    if let Some(message) = &engine.image_unavailable {
        let failure = Failure {
            class: IMAGE_UNAVAILABLE,
            message,
        };
        return failed_item(&identity, failure, (None, None), started_at);
    }
    let offered = shared.offered(
        &engine
            .distribution
            .sample(engine.seed, prompt_index, sample),
    );
    let lent = match shared.workspace(prompt_index, sample).await {
        Ok(lent) => lent,
        // Not the prompt's fault: every conversation needs a workspace.
        Err(err) => {
            let root = &engine.workspace_root;
            return Item::Stop(StorageError::new("creating a workspace in", root, err).into());
        }
    };
    let sandbox = shared.sandbox_of(prompt_index, sample, row);
    // Every turn on one endpoint, named by the record's id: the same in every attempt and pod.
    let client = engine.client.for_conversation(&id);
    let client = match spending {
        Some(spending) => client.with_spending(spending),
        None => client,
    };
    let (result, verification) = converse(shared, &offered, &client, row, lent, sandbox)
        .instrument(info_span!("conversation", prompt_index, sample))
        .await;
    let finished_at = chrono::Utc::now();
    let conversation = match result {
        Ok(conversation) => conversation,
        Err(error) if error.is_model_missing() => {
            return Item::Stop(RunError::ModelNotFound(error.to_string()));
        }
        Err(error) if error.is_permanent() => {
            return Item::Stop(RunError::ModelConfiguration(error.to_string()));
        }
        // A budget that ran out while the server was failing was spent waiting on the outage.
        Err(error)
            if error.is_transient()
                || error.is_budget_exhausted() && shared.circuit.is_failing() =>
        {
            return Item::Stop(RunError::ModelUnavailable(error.to_string()));
        }
        Err(error) => {
            let message = error.to_string();
            let failure = Failure {
                class: error.class(),
                message: &message,
            };
            let details = (Some(error.spent()), verification.as_ref());
            return failed_item(&identity, failure, details, started_at);
        }
    };
    if engine.require_reasoning && !reasoning_stats(&conversation.messages).has_any_reasoning() {
        let mut line = Vec::new();
        write_discarded_record(
            &mut line,
            &identity,
            "require_reasoning",
            conversation.api_calls,
            finished_at,
        );
        return Item::Record {
            outcome: ConversationOutcome::Discarded,
            line,
            openai: None,
            passed: false,
            cost: conversation.cost.map(|cost| cost.total),
        };
    }
    let conversation = Verified {
        conversation: &conversation,
        verification: verification.as_ref(),
    };
    trajectory_item(
        shared,
        &identity,
        &offered,
        row,
        &conversation,
        started_at,
        finished_at,
    )
}

/// A finished conversation and what its verifier found, if the row has one.
struct Verified<'a> {
    conversation: &'a Conversation,
    verification: Option<&'a Verification>,
}

/// Runs the conversation in its workspace, then the row's verifier (if it has one) in what the
/// conversation left, then keeps, reuses or removes the workspace. A conversation that ran out
/// of time is verified too (what it changed is there, as terminal-bench's harness verifies an
/// agent it stopped); one that ended in an error of the model's server is not: its prompt runs
/// again.
async fn converse(
    shared: &Shared,
    offered: &Offered,
    client: &ModelClient,
    row: &Row,
    lent: WorkspaceDir,
    sandbox: Sandbox,
) -> (
    Result<Conversation, ConversationError>,
    Option<Verification>,
) {
    let engine = &shared.engine;
    let WorkspaceDir {
        dir,
        workspace,
        made,
    } = lent;
    let tool_context = ToolContext {
        workspace,
        limits: engine.limits.clone(),
        sandbox,
        browser: crate::tools::browser::ConversationBrowser::default(),
        terminal: crate::tools::terminal::Terminal::default(),
    };
    let result = run_conversation(
        client,
        &offered.tools,
        &tool_context,
        &row.prompt,
        &engine.agent,
    )
    .await;
    // Nothing of the conversation may run on once its workspace is handed on or removed, or
    // while its verifier runs.
    tool_context.close().await;
    let out_of_time =
        |error: &ConversationError| error.is_budget_exhausted() && !shared.circuit.is_failing();
    let verification = match &result {
        Ok(_) => verify_row(engine, row, &tool_context).await,
        Err(error) if out_of_time(error) => verify_row(engine, row, &tool_context).await,
        Err(_) => None,
    };
    let untouched = verification.is_none()
        && result
            .as_ref()
            .is_ok_and(|conversation| only_read_only_tools_ran(conversation, &offered.tools));
    let lent = WorkspaceDir {
        dir,
        workspace: tool_context.workspace,
        made,
    };
    shared.release_workspace(lent, untouched, result.is_ok());
    (result, verification)
}

/// Runs the row's verifier, if it has one, where the conversation of `tool_context` ran.
async fn verify_row(
    engine: &Engine,
    row: &Row,
    tool_context: &ToolContext,
) -> Option<Verification> {
    let started = std::time::Instant::now();
    match Verifier::of_row(&row.source, &engine.verifier) {
        Ok(None) => None,
        Ok(Some(verifier)) => Some(
            crate::verify::verify(
                &tool_context.sandbox,
                tool_context.workspace.root(),
                &verifier,
                &engine.verifier,
            )
            .instrument(info_span!("verifier"))
            .await,
        ),
        Err(error) => Some(Verification::failed(error, started)),
    }
}

/// The trajectory record of a finished conversation (and its `OpenAI`-format twin, if the run
/// asks for one); discarded (`below_reward`, the whole record kept) when its verifier's reward is
/// below the run's `minReward`.
fn trajectory_item(
    shared: &Shared,
    identity: &RecordIdentity<'_>,
    offered: &Offered,
    row: &Row,
    verified: &Verified<'_>,
    started_at: chrono::DateTime<chrono::Utc>,
    finished_at: chrono::DateTime<chrono::Utc>,
) -> Item {
    let passed = verified
        .verification
        .is_some_and(|verification| verification.passed);
    let cost = verified.conversation.cost.map(|cost| cost.total);
    let below_reward = match (shared.engine.min_reward, verified.verification) {
        (Some(min_reward), Some(verification)) => verification.reward < min_reward,
        _ => false,
    };
    let record_context = RecordContext {
        id: identity.id,
        prompt_index: identity.prompt_index,
        sample: identity.sample,
        batch: identity.batch,
        model: &shared.context.model,
        toolsets_used: &offered.toolsets,
        tools_offered: &offered.specs,
        system_turn: Some(&offered.system_turn),
        catalog: &shared.context.catalog,
        started_at,
        finished_at,
        source: &row.source,
        verification: verified.verification,
        discarded_by: below_reward.then_some(BELOW_REWARD),
    };
    // Sized for a typical record at once: growing a buffer of kilobytes step by step is costly.
    let mut line = Vec::with_capacity(16 * 1024);
    write_trajectory_record(&mut line, verified.conversation, &record_context);
    if below_reward {
        return Item::Record {
            outcome: ConversationOutcome::Discarded,
            line,
            openai: None,
            passed,
            cost,
        };
    }
    let openai = shared.engine.openai_format.then(|| {
        let mut openai = Vec::new();
        write_openai_record(&mut openai, verified.conversation, &record_context);
        openai
    });
    Item::Record {
        outcome: ConversationOutcome::Succeeded,
        line,
        openai,
        passed,
        cost,
    }
}

/// The filter of a verified conversation whose reward is below `spec.filters.minReward`.
pub const BELOW_REWARD: &str = "below_reward";

/// The record of a (prompt, sample) that was not run because enough samples of its prompt passed
/// ([`ENOUGH_PASSED`]).
fn skipped_line(shared: &Shared, prompt_index: u64, sample: u32) -> Vec<u8> {
    let id = format!("{}-{prompt_index}-{sample}", shared.context.id_prefix);
    let identity = RecordIdentity {
        id: &id,
        prompt_index,
        sample,
        batch: shared.context.batch,
    };
    let mut line = Vec::new();
    write_discarded_record(&mut line, &identity, ENOUGH_PASSED, 0, chrono::Utc::now());
    line
}

/// The failed record of a (prompt, sample) that started at `started_at`.
/// A failed record; with what the conversation spent before it ended, and `verification` when
/// it ran out of time and was verified. It never counts as a pass towards `passesPerPrompt`:
/// only trajectories are kept data.
fn failed_item(
    identity: &RecordIdentity<'_>,
    failure: Failure<'_>,
    (spent, verification): (Option<&Spent>, Option<&Verification>),
    started_at: chrono::DateTime<chrono::Utc>,
) -> Item {
    let mut line = Vec::new();
    let times = (started_at, chrono::Utc::now());
    write_failed_record(&mut line, identity, failure, (spent, verification), times);
    let (prompt_index, sample, class) = (identity.prompt_index, identity.sample, failure.class);
    warn!(prompt_index, sample, class, "prompt failed");
    Item::Record {
        outcome: ConversationOutcome::Failed,
        line,
        openai: None,
        passed: false,
        cost: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test double of a failing disk: errors as the kernel reports them, injected where the
    /// batch reads its dataset (no filesystem here can be made to answer EIO or ESTALE).
    #[test]
    fn a_failing_read_of_the_dataset_is_transient_and_a_shorter_dataset_is_bad_input() {
        let path = std::path::Path::new("/data/d.jsonl");
        let changed = |err: std::io::Error| RunError::BadBatchInput(err.to_string());
        for errno in [nix::errno::Errno::EIO, nix::errno::Errno::ESTALE] {
            let error = dataset_read_error(
                path,
                std::io::Error::from_raw_os_error(errno as i32),
                changed,
            );
            assert_eq!(
                error.exit_code(),
                crate::contract::exit::TRANSIENT,
                "{error}"
            );
            assert_eq!(error.reason(), "StorageError");
            assert!(error.to_string().contains("/data/d.jsonl"), "{error}");
        }
        for kind in [
            std::io::ErrorKind::UnexpectedEof,
            std::io::ErrorKind::NotFound,
        ] {
            let error = dataset_read_error(path, kind.into(), changed);
            assert_eq!(error.exit_code(), crate::contract::exit::BAD_BATCH_INPUT);
        }
    }

    #[test]
    fn shutdown_is_observed_by_every_clone() {
        let (trigger, shutdown) = shutdown_channel();
        let clone = shutdown.clone();
        assert!(!clone.is_triggered());
        trigger.trigger();
        assert!(shutdown.is_triggered() && clone.is_triggered());
    }
}
