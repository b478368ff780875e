//! A conversation's life in a batch: its workspace lent and taken back, its tools offered, the
//! agent loop run in its sandbox, the row's verifier run in what it left, and its record rendered
//! (a trajectory, a discarded or a failed record). The batch ([`super::batch`]) schedules the
//! conversations and writes what they return; what happens to one conversation is here.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tempfile::TempDir;
use tokio::task::JoinSet;
use tracing::{Instrument, info_span, warn};

use super::engine::Engine;
use super::manifest::Manifest;
use super::resume::{TakenUp, take_up};
use super::sampling::ENOUGH_PASSED;
use super::turns::{Chain, Chains, Start, TurnCommitter, TurnLog};
use super::{RunError, RunLocation};
use crate::agent::{
    Conversation, ConversationError, Hooks, Resumed, Spent, TurnSink, UserSimulation,
    UserSimulationState, continue_conversation,
};
use crate::dataset::Row;
use crate::hermes::{
    Failure, RecordContext, RecordIdentity, reasoning_stats, system_turn, write_discarded_record,
    write_failed_record, write_openai_record, write_trajectory_record,
};
use crate::model::{Circuit, ModelClient, Spending};
use crate::replay::{Recording, Replay};
use crate::storage::StorageError;
use crate::tools::sandbox::{Place, Sandbox};
use crate::tools::{Tool, ToolContext, ToolSpec, Workspace};
use crate::training::append_tokens;
use crate::verify::{Verification, Verifier};

/// The row field describing the user a simulated user plays (tau2-bench's `user_scenario`:
/// `persona` and `instructions`), for runs with `spec.userSimulator`.
pub const USER_SCENARIO: &str = "user_scenario";

/// The outcome of one (prompt, sample), for progress displays; ordered from the best record of a
/// key to the worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ConversationOutcome {
    Succeeded,
    Discarded,
    Failed,
}

/// What every conversation task of a batch reads.
pub(super) struct Shared {
    pub(super) engine: Engine,
    pub(super) rows: Vec<Row>,
    pub(super) first_prompt: u64,
    pub(super) context: BatchContext,
    /// What is offered for each combination of toolsets drawn so far.
    offered: Mutex<HashMap<Vec<String>, Arc<Offered>>>,
    /// Workspaces that conversations left as they were made, for the next ones.
    idle_workspaces: Mutex<Vec<WorkspaceDir>>,
    /// Set once no conversation will start: workspaces are removed rather than kept idle.
    draining: AtomicBool,
    /// Workspace removals on the blocking pool (awaited before the batch returns).
    pub(super) removals: Mutex<JoinSet<()>>,
    /// Sees every model call of the batch; once open, no conversation starts.
    pub(super) circuit: Arc<Circuit>,
    /// Where finished turns go (`None`: the engine keeps no turn log).
    pub(super) turns: Option<TurnLog>,
    /// The turns earlier attempts finished of keys without a record, each taken by the
    /// conversation that takes it up.
    chains: Mutex<Chains>,
    /// Another run's tool outputs for this batch's keys (`spec.replay.from`).
    pub(super) recordings: HashMap<(u64, u32), Arc<Recording>>,
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
    pub(super) fn new(
        engine: &Engine,
        rows: Vec<Row>,
        first_prompt: u64,
        context: BatchContext,
        (turns, chains): (Option<TurnLog>, Chains),
    ) -> Self {
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
            turns,
            chains: Mutex::new(chains),
            recordings: HashMap::new(),
        }
    }

    /// The recording of a (prompt, sample) whose prompt is `prompt`, if the run replays one.
    fn recording(&self, key: (u64, u32), prompt: &str) -> Option<Arc<Recording>> {
        let recording = self.recordings.get(&key)?;
        if recording.prompt != prompt {
            warn!(
                prompt_index = key.0,
                sample = key.1,
                "spec.replay.from holds another prompt for this key: its tools run for real"
            );
            return None;
        }
        Some(Arc::clone(recording))
    }

    /// The record id of a (prompt, sample): the same in every attempt and pod.
    pub(super) fn record_id(&self, prompt_index: u64, sample: u32) -> String {
        record_id(&self.context.id_prefix, prompt_index, sample)
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

    pub(super) fn stop_reusing_workspaces(&self) {
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
pub(super) struct BatchContext {
    pub(super) id_prefix: String,
    pub(super) batch: u32,
    pub(super) catalog: Vec<String>,
    /// The MCP tools the plan froze.
    pub(super) mcp_tools: Vec<crate::tools::mcp::FrozenServer>,
    pub(super) model: String,
}

impl BatchContext {
    pub(super) fn new(location: &RunLocation, manifest: &Manifest, batch: u32) -> Self {
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

pub(super) enum Item {
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

/// The failure class of a conversation whose row's image could not be pulled.
pub const IMAGE_UNAVAILABLE: &str = "image_unavailable";
/// The failure class of a conversation whose row's image could not be built.
pub const IMAGE_BUILD_FAILED: &str = "image_build_failed";

/// Runs one (prompt, sample) and renders its record line; its model calls count into
/// `spending` (its budget's ticket's) when the run has a budget.
pub(super) async fn run_item(
    shared: &Shared,
    prompt_index: u64,
    sample: u32,
    spending: Option<Arc<Spending>>,
) -> Item {
    let (engine, context) = (&shared.engine, &shared.context);
    let row =
        &shared.rows[usize::try_from(prompt_index - shared.first_prompt).unwrap_or(usize::MAX)];
    let id = shared.record_id(prompt_index, sample);
    let identity = RecordIdentity {
        id: &id,
        prompt_index,
        sample,
        batch: context.batch,
    };
    let chain = lock(&shared.chains).remove(&(prompt_index, sample));
    let started_at = started_at(chain.as_ref());
    let image_failure = [
        (IMAGE_UNAVAILABLE, &engine.image_unavailable),
        (IMAGE_BUILD_FAILED, &engine.image_build_failed),
    ];
    if let Some((class, Some(message))) = image_failure.iter().find(|(_, why)| why.is_some()) {
        let failure = Failure { class, message };
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
    let conversation = Attempt {
        id: &id,
        key: (prompt_index, sample),
        started_at,
        chain: chain.as_ref(),
    };
    let conversed = converse(
        shared,
        &offered,
        &client,
        row,
        (lent, sandbox),
        &conversation,
    )
    .instrument(info_span!("conversation", prompt_index, sample))
    .await;
    // Not the prompt's fault: every conversation needs a workspace.
    let (result, verification) = match conversed {
        Ok(conversed) => conversed,
        Err(error) => return Item::Stop(error.into()),
    };
    let finished_at = chrono::Utc::now();
    let conversation = match result {
        Ok(conversation) => conversation,
        Err(error) => {
            return unfinished_item(shared, &error, &identity, verification.as_ref(), started_at);
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

/// The record id of a (prompt, sample) of a run whose spec digest begins with `prefix`.
pub(super) fn record_id(prefix: &str, prompt_index: u64, sample: u32) -> String {
    format!("{prefix}-{prompt_index}-{sample}")
}

/// When the conversation started: now, or when the first attempt of a conversation taken up
/// did.
fn started_at(chain: Option<&Chain>) -> chrono::DateTime<chrono::Utc> {
    chain
        .and_then(|chain| chain.entries.first())
        .and_then(|entry| chrono::DateTime::parse_from_rfc3339(&entry.started_at).ok())
        .map_or_else(chrono::Utc::now, |at| at.with_timezone(&chrono::Utc))
}

/// Which conversation runs, and what earlier attempts left of it.
struct Attempt<'a> {
    id: &'a str,
    key: (u64, u32),
    started_at: chrono::DateTime<chrono::Utc>,
    /// The turns to take up, if an earlier attempt left some.
    chain: Option<&'a Chain>,
}

impl Attempt<'_> {
    /// The n-th background job of the conversation is named alike in every attempt, so a
    /// replay starts the jobs its transcript names.
    fn job_seed(&self) -> u64 {
        let hash = blake3::hash(self.id.as_bytes());
        u64::from_le_bytes(hash.as_bytes()[..8].try_into().expect("8 bytes"))
    }
}

/// What a conversation that ended in `error` comes to: the batch stops (an error no other prompt
/// gets past, which its prompt is retried after), or its failed record.
fn unfinished_item(
    shared: &Shared,
    error: &ConversationError,
    identity: &RecordIdentity<'_>,
    verification: Option<&Verification>,
    started_at: chrono::DateTime<chrono::Utc>,
) -> Item {
    if error.is_model_missing() {
        return Item::Stop(RunError::ModelNotFound(error.to_string()));
    }
    if error.is_permanent() {
        return Item::Stop(RunError::ModelConfiguration(error.to_string()));
    }
    // A budget that ran out while the server was failing was spent waiting on the outage.
    if error.is_transient() || error.is_budget_exhausted() && shared.circuit.is_failing() {
        return Item::Stop(RunError::ModelUnavailable(error.to_string()));
    }
    let message = error.to_string();
    let failure = Failure {
        class: error.class(),
        message: &message,
    };
    let details = (Some(error.spent()), verification);
    failed_item(identity, failure, details, started_at)
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
    (lent, sandbox): (WorkspaceDir, Sandbox),
    attempt: &Attempt<'_>,
) -> Result<
    (
        Result<Conversation, ConversationError>,
        Option<Verification>,
    ),
    StorageError,
> {
    let engine = &shared.engine;
    let mut lent = lent;
    let mut tool_context =
        new_tool_context(engine, lent.workspace.clone(), sandbox.clone(), attempt);
    let mut start = Conversation::episode(&row.prompt, row.follow_ups.clone());
    let simulator = engine
        .simulator
        .as_deref()
        .filter(|_| row.source.contains_key(USER_SCENARIO));
    start.user_simulation = simulator.map(|simulator| {
        UserSimulationState::new(row.source[USER_SCENARIO].clone(), simulator.max_turns())
    });
    let mut from = Start::Fresh;
    if let Some(chain) = attempt.chain {
        match take_up(chain, start.clone(), &offered.tools, &tool_context).await {
            TakenUp::Resumed(conversation) => {
                let earlier = conversation
                    .resume
                    .as_ref()
                    .map_or_else(Default::default, |resume| resume.earlier_time);
                start = *conversation;
                from = Start::TakenUp(chain, earlier);
            }
            TakenUp::StartOver(reason) => {
                tracing::info!(%reason, "starting the conversation over");
                // The replay may have changed the workspace: the conversation gets a new one.
                tool_context.close().await;
                shared.release_workspace(lent, false, false);
                lent = shared
                    .workspace(attempt.key.0, attempt.key.1)
                    .await
                    .map_err(|err| {
                        StorageError::new("creating a workspace in", &engine.workspace_root, err)
                    })?;
                tool_context = new_tool_context(engine, lent.workspace.clone(), sandbox, attempt);
                start.resume = Some(Resumed {
                    restarted: Some(reason),
                    ..Resumed::default()
                });
                from = Start::Over(chain);
            }
        }
    }
    let started_at = crate::hermes::timestamp(attempt.started_at);
    let committer = shared
        .turns
        .as_ref()
        .map(|log| TurnCommitter::new(log, attempt.id, attempt.key, started_at, from));
    let replay = shared.recording(attempt.key, &row.prompt).map(|recording| {
        let mut replay = Replay::new(recording);
        // Calls taken up from the turn log already left their environment.
        replay.skip(&tool_calls(&start));
        replay
    });
    let hooks = Hooks {
        sink: committer
            .as_ref()
            .map(|committer| committer as &dyn TurnSink),
        replay,
        simulator: simulator.map(|simulator| simulator as &dyn UserSimulation),
    };
    let result = if let Some(oracle) = &engine.oracle {
        Ok(oracle.run_solution(row, &tool_context).await)
    } else {
        continue_conversation(
            client,
            &offered.tools,
            &tool_context,
            start,
            &engine.agent,
            hooks,
        )
        .await
    };
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
    lent.workspace = tool_context.workspace;
    shared.release_workspace(lent, untouched, result.is_ok());
    Ok((result, verification))
}

/// Every tool call of `conversation`, in order.
fn tool_calls(conversation: &Conversation) -> Vec<crate::model::ToolCall> {
    conversation
        .messages
        .iter()
        .filter_map(|message| match message {
            crate::model::Message::Assistant(assistant) => Some(assistant.tool_calls.iter()),
            _ => None,
        })
        .flatten()
        .cloned()
        .collect()
}

/// The tools' context of one attempt of a conversation, in `workspace`.
fn new_tool_context(
    engine: &Engine,
    workspace: Workspace,
    sandbox: Sandbox,
    attempt: &Attempt<'_>,
) -> ToolContext {
    ToolContext {
        workspace,
        limits: engine.limits.clone(),
        sandbox,
        browser: crate::tools::browser::ConversationBrowser::default(),
        terminal: crate::tools::terminal::Terminal::with_job_seed(attempt.job_seed()),
    }
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
    // A discarded record goes to failures.jsonl, which has no tokens beside it.
    if let Some(tokens) = shared.engine.tokens.as_ref().filter(|_| !below_reward) {
        append_tokens(
            &mut line,
            verified.conversation,
            tokens,
            (identity.id, identity.prompt_index, identity.sample),
        );
    }
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
pub(super) fn skipped_line(shared: &Shared, prompt_index: u64, sample: u32) -> Vec<u8> {
    let id = shared.record_id(prompt_index, sample);
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
