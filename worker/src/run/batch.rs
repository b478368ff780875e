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
//! conversations. What happens to one conversation (its workspace, tools, sandbox, verifier and
//! record) is [`super::conversation`]'s; the engine every batch of a process shares is
//! [`super::engine`]'s.
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
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{info, warn};

pub use super::conversation::{
    BELOW_REWARD, ConversationOutcome, IMAGE_BUILD_FAILED, IMAGE_UNAVAILABLE,
};
use super::conversation::{BatchContext, Item, Shared, lock, record_id, run_item, skipped_line};
pub use super::engine::{Engine, TurnLogging};
use super::ledger::{Admission, Ticket};
use super::manifest::Manifest;
use super::sampling::{Next, Schedule};
use super::segments::segment_digest;
use super::turns::{Chains, TurnLog, TurnLogHandle, read_chains, spawn_signalling};
use super::windows::start_batch_mode;
use super::{RunError, RunLocation};
use crate::contract::{BatchSummary, PodPull};
use crate::dataset::{LineReader, MAX_LINE_BYTES, Row, parse_row, without_bom};
use crate::hermes::timestamp;
use crate::storage::{RecordsWriter, RunDir, StorageError, TurnsWriter, WriterId};

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
    /// What the pod that finished the batch waited for its task image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pull: Option<PodPull>,
}

impl DoneMarker {
    /// The batch's summary as its marker tells it, with `resumed` records found at its start.
    fn summary(self, resumed: u64) -> BatchSummary {
        BatchSummary {
            batch: self.batch,
            succeeded: self.succeeded,
            discarded: self.discarded,
            failed: self.failed,
            resumed,
            stopped: None,
            cost: self.cost,
            run_spent: None,
            landlock: None,
            pull: self.pull,
        }
    }
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

    let (lines, writer, failed) = spawn_writer(records_writer);
    let context = BatchContext::new(location, manifest, batch);
    let turns = start_turn_log(
        engine,
        &run_dir,
        (batch, &writer_id),
        &context,
        &pending,
        failed,
    )?;
    let recordings = read_recordings(location, first_prompt, rows.len())?;
    let mut shared = Shared::new(
        engine,
        rows,
        first_prompt,
        context,
        (turns.log, turns.chains),
    );
    shared.recordings = recordings;
    let batch_mode = start_batch_mode(&mut shared, &run_dir, (batch, &writer_id), pending.len())?;
    let shared = Arc::new(shared);
    let schedule = Schedule::new(pending, engine.passes_per_prompt, passed);
    let stop = run_pending(&shared, schedule, shutdown, lines, &mut summary, progress).await?;
    shared.stop_reusing_workspaces();
    let mut removals = std::mem::take(&mut *lock(&shared.removals));
    writer
        .await
        .map_err(|err| RunError::Internal(format!("record writer panicked: {err}")))??;
    let turn_writer = finish_turn_log(&shared, turns.writer).await?;
    if let Some(error) = stop {
        return Err(error);
    }
    if shutdown.is_triggered() {
        return Err(RunError::Interrupted);
    }
    let expected = shared.rows.len() as u64 * u64::from(engine.samples_per_prompt);
    let pull = pod_pull(engine, manifest, batch);
    let marker = mark_done(&run_dir, (batch, pull), expected, turn_writer)?;
    batch_mode.finish();
    // The batch leaves no workspace behind (most were removed while it ran).
    while removals.join_next().await.is_some() {}
    info!(
        succeeded = marker.succeeded,
        discarded = marker.discarded,
        failed = marker.failed,
        "batch done"
    );
    Ok(marker.summary(summary.resumed))
}

/// What the pod waited for the batch's image, its time counted up to now (the batch's end).
fn pod_pull(engine: &Engine, manifest: &Manifest, batch: u32) -> Option<PodPull> {
    let (start, image) = engine.pod_start.zip(manifest.image_of(batch))?;
    Some(start.pull(image, std::time::SystemTime::now()))
}

/// Writes the `.done` marker of a batch whose every key has a record, then removes this
/// writer's turn log.
fn mark_done(
    run_dir: &RunDir,
    (batch, pull): (u32, Option<PodPull>),
    expected: u64,
    turn_writer: Option<TurnsWriter>,
) -> Result<DoneMarker, RunError> {
    // The marker says what storage holds now, not what this writer counted: records it found at
    // its start may be gone since (a merge that found them missing reopened the batch for them,
    // and a marker written from this writer's count would close it again over the gap).
    let on_storage = existing_records(run_dir, batch)?;
    let recorded = on_storage.keys.len() as u64;
    if recorded < expected {
        return Err(RunError::RecordsLost(format!(
            "batch {batch}: {recorded} of its {expected} keys have a record on storage after \
             this writer ran; records it counted at its start are gone, so the batch is not \
             marked done and runs again for the missing keys"
        )));
    }
    let cost = on_storage.cost.map(crate::contract::usd_text);
    let marker = write_done_marker(
        run_dir,
        (batch, pull),
        (&on_storage.summary, cost),
        expected,
    )?;
    // Every key has its record: no conversation will be taken up from this writer's turns.
    if let Some(turn_writer) = turn_writer
        && let Err(error) = turn_writer.remove()
    {
        warn!(%error, "could not remove the batch's turn log");
    }
    Ok(marker)
}

/// The recordings `spec.replay.from` holds for the batch's prompts (none when the run replays
/// nothing). Each batch reads the whole file once and keeps its own prompts' records.
fn read_recordings(
    location: &RunLocation,
    first_prompt: u64,
    prompts: usize,
) -> Result<HashMap<(u64, u32), Arc<crate::replay::Recording>>, RunError> {
    let Some(data) = location.read_replay_source(None)? else {
        return Ok(HashMap::new());
    };
    let range = first_prompt..first_prompt + prompts as u64;
    Ok(crate::replay::read_recordings(&data, range)
        .into_iter()
        .map(|(key, recording)| (key, Arc::new(recording)))
        .collect())
}

/// A batch's turn log: the way to its writer, the writer's thread, and the chains earlier
/// attempts left (all empty when the engine keeps no log).
struct BatchTurns {
    log: Option<TurnLog>,
    writer: Option<TurnLogHandle>,
    chains: Chains,
}

/// Reads the chains earlier attempts left for the `pending` keys and starts this writer's turn
/// log, whose failure `failed` signals.
fn start_turn_log(
    engine: &Engine,
    run_dir: &RunDir,
    (batch, writer_id): (u32, &WriterId),
    context: &BatchContext,
    pending: &[(u64, u32)],
    failed: Arc<watch::Sender<bool>>,
) -> Result<BatchTurns, RunError> {
    if engine.turns == TurnLogging::Off {
        return Ok(BatchTurns {
            log: None,
            writer: None,
            chains: Chains::new(),
        });
    }
    let pending: HashSet<(u64, u32)> = pending.iter().copied().collect();
    let prefix = &context.id_prefix;
    let chains = read_chains(run_dir, batch, &pending, |prompt_index, sample| {
        record_id(prefix, prompt_index, sample)
    })?;
    if !chains.is_empty() {
        let turns: usize = chains.values().map(|chain| chain.entries.len()).sum();
        info!(
            conversations = chains.len(),
            turns, "taking up conversations from the turn log"
        );
    }
    let writer = run_dir
        .store()
        .turns_writer(&run_dir.batch_turns_of(batch, writer_id));
    let (log, handle) = TurnLog::spawn(writer, failed);
    Ok(BatchTurns {
        log: Some(log),
        writer: Some(handle),
        chains,
    })
}

/// Ends the turn log's writer once the batch sends no more turns; returns it, for removing the
/// log once the batch is done.
async fn finish_turn_log(
    shared: &Shared,
    writer: Option<TurnLogHandle>,
) -> Result<Option<TurnsWriter>, RunError> {
    if let Some(log) = &shared.turns {
        log.close();
    }
    match writer {
        Some(handle) => Ok(Some(handle.await.map_err(|err| {
            RunError::Internal(format!("turn log writer panicked: {err}"))
        })??)),
        None => Ok(None),
    }
}

/// What the pod that finished `batch` waited for its image, as its `.done` marker says (`None`
/// without a marker, or one that says nothing of it).
pub(crate) fn done_pull(run_dir: &RunDir, batch: u32) -> Option<PodPull> {
    let bytes = run_dir.store().read(&run_dir.batch_done(batch)).ok()?;
    serde_json::from_slice::<DoneMarker>(&bytes).ok()?.pull
}

/// What the batch's `.done` marker records, if it has one (an unreadable marker counts as none:
/// the batch runs again, resuming from its records).
fn done_summary(run_dir: &RunDir, batch: u32) -> Option<BatchSummary> {
    let bytes = run_dir.store().read(&run_dir.batch_done(batch)).ok()?;
    let marker = serde_json::from_slice::<DoneMarker>(&bytes).ok()?;
    let resumed = marker.succeeded + marker.discarded + marker.failed;
    Some(BatchSummary {
        batch,
        ..marker.summary(resumed)
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
/// Its failure signal is shared with the turn log's writer: either failing stops the batch.
fn spawn_writer(records: RecordsWriter) -> (RecordSender, WriterHandle, Arc<watch::Sender<bool>>) {
    let (sender, receiver) = mpsc::unbounded_channel::<Lines>();
    let (failed, failure) = watch::channel(false);
    let failed = Arc::new(failed);
    let writer = spawn_signalling(Arc::clone(&failed), move || write_lines(receiver, records));
    (
        RecordSender {
            lines: sender,
            failure,
        },
        writer,
        failed,
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
/// Sends the record of a key skipped (its prompt had enough passes); false when the writer
/// has stopped.
fn send_skipped(shared: &Shared, lines: &RecordSender, (prompt_index, sample): (u64, u32)) -> bool {
    let main = skipped_line(shared, prompt_index, sample);
    lines.lines.send(Lines { main, openai: None }).is_ok()
}

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
                    summary.discarded += 1;
                    if !send_skipped(shared, &lines, (prompt_index, sample)) {
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
        (shared.engine.client).batch_running(pending.is_empty(), running.len());
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
/// finish, then ends without a record (`None`); its finished turns stay in the turn log. The
/// grace ends before the pod's task and sandbox containers are stopped (the operator sets it
/// below the pod's): a conversation must not go on with an environment that is going away.
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
        let grace = shared.engine.grace;
        let result = tokio::select! {
            // A conversation that would end just as the request comes is stopped all the same.
            biased;
            () = async {
                shutdown.wait().await;
                if !grace.is_zero() {
                    tokio::time::sleep(grace).await;
                }
            } => None,
            result = work => Some(result),
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
    (batch, pull): (u32, Option<PodPull>),
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
        pull,
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
