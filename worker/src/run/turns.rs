//! The turn log: every turn a conversation finishes (the model's reply with its reasoning and
//! tool calls, what the call cost, then each tool's result) is durable on the run's storage
//! before the conversation's next model call, so that a killed writer costs the turns in flight,
//! not the conversations.
//!
//! Each writer of a batch appends to a log of its own, beside its records
//! (`batches/batch-NNNNNN/w-<writer>.turns.jsonl`; on a bucket one part per group,
//! `w-<writer>-<n>.turns.jsonl`), with the records' disciplines: it writes only files it
//! created, one line per turn, a torn tail skipped by readers. One thread writes for every
//! conversation of the batch and commits what arrived since its last commit (at least
//! [`COMMIT_INTERVAL`] ago) with one write and one fsync (or one object), then lets the
//! conversations go on: under load many turns share a commit. A batch that finishes removes its
//! own log (every key has its record).
//!
//! # Chains, and why a stale writer cannot mislead a successor
//!
//! A line names its conversation (the record's id, its prompt and sample), its turn number and
//! `prev`: the digest of the line of the turn before it in the same conversation (empty for the
//! first). A successor reads every log of the batch at its start and takes up, for each key with
//! no record, the longest chain of linked turns numbered 0, 1, 2, ... Lines are never changed
//! once written, so the chain it took up cannot change under it: a writer still running on a
//! partitioned node can only append to its own log, and what it appends links to its own earlier
//! lines, a branch beside the successor's, never into it (the successor's next line links to the
//! digest of the line it took up). A third writer picks the longest of the branches; merge keeps
//! one record per key whichever writers finished it. That holds on NFS and a bucket alike,
//! without a lock or a token to check on every append.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tracing::warn;

use super::RunError;
use crate::agent::{SimulatedOpening, Step, Turn, TurnSink};
use crate::model::{ToolMessage, Usage, WireAssistant};
use crate::pricing::Cost;
use crate::storage::{RunDir, TurnsWriter};

/// One line of a turn log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct TurnEntry {
    /// The record id of the conversation (it carries the run's spec digest, so a log of another
    /// spec is never taken up).
    pub(super) id: String,
    pub(super) prompt_index: u64,
    pub(super) sample: u32,
    /// 0-based: the model calls of the conversation before this one.
    pub(super) turn: u32,
    /// The user turn of the row it answers (0: the prompt; more in an episode).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(super) segment: u32,
    /// Its reply answers the loop's request for a final answer (its segment spent `max_turns`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) asked_final: bool,
    /// The simulated user's message its segment began with, on the segment's first turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) simulated_user: Option<SimulatedUserEntry>,
    /// The digest of the line of turn `turn - 1` of this chain; empty for turn 0.
    pub(super) prev: String,
    /// How many times the conversation started over from its prompt because its recorded turns
    /// could not be taken up: a chain of a later start outranks a longer one of an earlier.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(super) restarts: u32,
    /// When the conversation started (its record's `started_at`).
    pub(super) started_at: String,
    /// The conversation's wall-clock time when this turn was committed, over all its attempts.
    pub(super) elapsed_ms: u64,
    /// The reply in the chat-completions wire shape, as it is sent back to the model.
    pub(super) reply: Value,
    pub(super) results: Vec<ToolMessage>,
    pub(super) usage: Usage,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) cost: Option<Cost>,
    pub(super) model_ms: u64,
    /// The call's tokens, when the run keeps them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) step: Option<Step>,
}

/// A simulated user's message that began a segment, as the turn log keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct SimulatedUserEntry {
    pub(super) text: String,
    pub(super) usage: Usage,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) cost: Option<Cost>,
}

/// A [`TurnEntry`] as a conversation writes it: the same fields, borrowed from the turn.
#[derive(Serialize)]
struct TurnLine<'a> {
    id: &'a str,
    prompt_index: u64,
    sample: u32,
    turn: u32,
    #[serde(skip_serializing_if = "is_zero")]
    segment: u32,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    asked_final: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    simulated_user: Option<SimulatedOpening<'a>>,
    prev: &'a str,
    #[serde(skip_serializing_if = "is_zero")]
    restarts: u32,
    started_at: &'a str,
    elapsed_ms: u64,
    reply: WireAssistant<'a>,
    results: &'a [ToolMessage],
    usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    cost: Option<Cost>,
    model_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    step: Option<&'a Step>,
}

/// The digest a line's successor links to: 128 bits of BLAKE3, hex.
fn digest(line: &[u8]) -> String {
    let hash = blake3::hash(line);
    hash.to_hex()[..32].to_owned()
}

/// A key's longest chain of turns, as a successor takes it up.
#[derive(Debug, Clone)]
pub(super) struct Chain {
    pub(super) entries: Vec<TurnEntry>,
    /// The digest of the last entry's line: the next turn links to it.
    pub(super) last: String,
}

/// The chains to take up, by key.
pub(super) type Chains = HashMap<(u64, u32), Chain>;

/// The chains to take up, by key: for each of `pending` (keys without a record) that has turns
/// in any log of the batch under its record id (`ids` gives it), the longest chain.
pub(super) fn read_chains(
    run_dir: &RunDir,
    batch: u32,
    pending: &HashSet<(u64, u32)>,
    id_of: impl Fn(u64, u32) -> String,
) -> Result<Chains, RunError> {
    let logs = run_dir.turn_logs(batch)?;
    if logs.is_empty() || pending.is_empty() {
        return Ok(HashMap::new());
    }
    let read = run_dir
        .store()
        .read_files_lines_into(logs.iter().map(std::path::PathBuf::as_path), Vec::new())?;
    let mut by_key: HashMap<(u64, u32), Vec<(String, TurnEntry)>> = HashMap::new();
    for (index, &(start, end)) in read.lines.iter().enumerate() {
        let line = &read.data[start..end];
        let Ok(entry) = serde_json::from_slice::<TurnEntry>(line) else {
            let file = logs[read.file_of(index)].display();
            warn!(batch, %file, "skipping an unreadable turn log line");
            continue;
        };
        let key = (entry.prompt_index, entry.sample);
        if !pending.contains(&key) || entry.id != id_of(key.0, key.1) {
            continue;
        }
        by_key.entry(key).or_default().push((digest(line), entry));
    }
    Ok(by_key
        .into_iter()
        .filter_map(|(key, entries)| longest_chain(entries).map(|chain| (key, chain)))
        .collect())
}

#[allow(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if passes a reference"
)]
fn is_zero(count: &u32) -> bool {
    *count == 0
}

/// The longest chain of linked entries starting at a turn 0 of the latest start; of equally long
/// ones the first in log order (logs are read in name order, so every reader picks the same one).
fn longest_chain(entries: Vec<(String, TurnEntry)>) -> Option<Chain> {
    // Entries by the digest they link to; a line written twice (the same digest) counts once.
    let mut children: HashMap<&str, Vec<usize>> = HashMap::new();
    let mut seen = HashSet::new();
    for (index, (hash, entry)) in entries.iter().enumerate() {
        if seen.insert(hash.as_str()) {
            children.entry(entry.prev.as_str()).or_default().push(index);
        }
    }
    // Depth-first from every first turn; the path's length is its last turn's number + 1.
    let mut best: Option<Vec<usize>> = None;
    let mut stack: Vec<Vec<usize>> = children
        .get("")
        .into_iter()
        .flatten()
        .filter(|&&index| entries[index].1.turn == 0)
        .rev()
        .map(|&index| vec![index])
        .collect();
    while let Some(path) = stack.pop() {
        let last = *path.last().expect("a path has an entry");
        let next: Vec<usize> = children
            .get(entries[last].0.as_str())
            .into_iter()
            .flatten()
            .copied()
            .filter(|&index| entries[index].1.turn == entries[last].1.turn + 1)
            .collect();
        if next.is_empty() {
            let rank = |path: &[usize]| (entries[path[0]].1.restarts, path.len());
            if best.as_ref().is_none_or(|best| rank(&path) > rank(best)) {
                best = Some(path);
            }
            continue;
        }
        for &index in next.iter().rev() {
            let mut longer = path.clone();
            longer.push(index);
            stack.push(longer);
        }
    }
    let path = best?;
    let last = entries[*path.last()?].0.clone();
    let mut entries: Vec<Option<(String, TurnEntry)>> = entries.into_iter().map(Some).collect();
    Some(Chain {
        entries: path
            .into_iter()
            .filter_map(|index| entries[index].take().map(|(_, entry)| entry))
            .collect(),
        last,
    })
}

/// A turn on its way to the log, with the way to tell its conversation it is durable.
struct Pending {
    line: Vec<u8>,
    durable: oneshot::Sender<()>,
}

/// The batch's way to its turn log writer.
pub(super) struct TurnLog {
    /// Taken at the batch's end, which ends the writer.
    sender: Mutex<Option<mpsc::UnboundedSender<Pending>>>,
}

/// The writer thread's handle: it returns the writer, for removing the log when the batch is
/// done.
pub(super) type TurnLogHandle = JoinHandle<Result<TurnsWriter, RunError>>;

impl TurnLog {
    /// Starts the writer on the blocking pool; it stops when [`TurnLog::close`] was called and
    /// every turn sent is written, or at its first error, which it reports on `failed` (the
    /// batch then stops: a conversation waits for its turn forever rather than go on without
    /// it).
    pub(super) fn spawn(
        writer: TurnsWriter,
        failed: Arc<watch::Sender<bool>>,
    ) -> (Self, TurnLogHandle) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let handle = spawn_signalling(failed, move || write_turns(receiver, writer));
        (
            Self {
                sender: Mutex::new(Some(sender)),
            },
            handle,
        )
    }

    /// No more turns will come: the writer ends once it has written those sent.
    pub(super) fn close(&self) {
        super::conversation::lock(&self.sender).take();
    }

    /// Sends `line` and waits until it is durable; if the writer failed, never resolves (the
    /// batch stops and drops the conversation).
    async fn commit(&self, line: Vec<u8>) {
        let (durable, written) = oneshot::channel();
        let sent = super::conversation::lock(&self.sender)
            .as_ref()
            .is_some_and(|sender| sender.send(Pending { line, durable }).is_ok());
        if !sent || written.await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Commits of the turn log are at least this far apart. Each commit costs a journal commit and
/// a disk round trip (a volume) or a request the client signs and the server stores (a bucket),
/// CPU taken from the conversations on the same cores: under load one commit now covers the turns
/// of many conversations, each waiting at most this much longer for its next model call; when
/// turns are rare, each is committed as soon as it arrives.
const COMMIT_INTERVAL: Duration = Duration::from_millis(20);

/// [`COMMIT_INTERVAL`] on a bucket, where a commit is a PUT: one the store bills (S3 charges per
/// thousand) and a request the client signs and sends, more CPU than an append. At most 10 a
/// second per pod, each turn waiting at most 0.1 s more for its next model call (which takes
/// seconds on the models this serves).
const BUCKET_COMMIT_INTERVAL: Duration = Duration::from_millis(100);

/// Runs a batch's writer on the blocking pool; its error, if it ends in one, is signalled on
/// `failed` (the batch stops at once) as well as returned.
pub(super) fn spawn_signalling<T: Send + 'static>(
    failed: Arc<watch::Sender<bool>>,
    write: impl FnOnce() -> Result<T, RunError> + Send + 'static,
) -> JoinHandle<Result<T, RunError>> {
    tokio::task::spawn_blocking(move || {
        let result = write();
        if result.is_err() {
            failed.send_replace(true);
        }
        result
    })
}

/// The writer: whatever arrived while the last group was written, and until the commit
/// interval since the last commit has passed, is the next group.
fn write_turns(
    mut receiver: mpsc::UnboundedReceiver<Pending>,
    mut writer: TurnsWriter,
) -> Result<TurnsWriter, RunError> {
    let interval = if writer.is_on_bucket() {
        BUCKET_COMMIT_INTERVAL
    } else {
        COMMIT_INTERVAL
    };
    let mut last_commit: Option<Instant> = None;
    while let Some(first) = receiver.blocking_recv() {
        if let Some(wait) = last_commit.and_then(|at| interval.checked_sub(at.elapsed())) {
            std::thread::sleep(wait);
        }
        last_commit = Some(Instant::now());
        let mut group = vec![first];
        while let Ok(more) = receiver.try_recv() {
            group.push(more);
        }
        let lines: Vec<&[u8]> = group
            .iter()
            .map(|pending| pending.line.as_slice())
            .collect();
        writer.append(&lines)?;
        for pending in group {
            // A conversation that stopped waiting (dropped at a shutdown) needs no word.
            let _ = pending.durable.send(());
        }
    }
    Ok(writer)
}

/// Where a conversation's turns go on from.
#[derive(Debug, Clone, Copy)]
pub(super) enum Start<'a> {
    /// Its first turn, with nothing recorded.
    Fresh,
    /// The end of this chain, which took this long until its last turn.
    TakenUp(&'a Chain, Duration),
    /// Its first turn again: this chain could not be taken up.
    Over(&'a Chain),
}

/// One conversation's link to the turn log: renders each turn it finishes as a line that links
/// to the one before.
pub(super) struct TurnCommitter<'a> {
    log: &'a TurnLog,
    id: &'a str,
    key: (u64, u32),
    started_at: String,
    /// The digest of the last line of this conversation's chain (empty before its first turn).
    prev: Mutex<String>,
    /// Wall-clock time of the conversation before this attempt, and when this attempt began.
    earlier: Duration,
    began: Instant,
    restarts: u32,
}

impl<'a> TurnCommitter<'a> {
    /// A committer for the conversation `id` of `key`, started at `started_at`, going on from
    /// `start`.
    pub(super) fn new(
        log: &'a TurnLog,
        id: &'a str,
        key: (u64, u32),
        started_at: String,
        start: Start<'_>,
    ) -> Self {
        let (prev, earlier, restarts) = match start {
            Start::Fresh => (String::new(), Duration::ZERO, 0),
            Start::TakenUp(chain, earlier) => (
                chain.last.clone(),
                earlier,
                chain.entries.first().map_or(0, |entry| entry.restarts),
            ),
            Start::Over(chain) => (
                String::new(),
                Duration::ZERO,
                chain.entries.first().map_or(0, |entry| entry.restarts) + 1,
            ),
        };
        Self {
            log,
            id,
            key,
            started_at,
            prev: Mutex::new(prev),
            earlier,
            began: Instant::now(),
            restarts,
        }
    }
}

impl TurnSink for TurnCommitter<'_> {
    fn commit<'b>(&'b self, turn: Turn<'b>) -> BoxFuture<'b, ()> {
        let mut prev = super::conversation::lock(&self.prev);
        let line = TurnLine {
            id: self.id,
            prompt_index: self.key.0,
            sample: self.key.1,
            turn: turn.number,
            segment: turn.segment,
            asked_final: turn.asked_final,
            simulated_user: turn.simulated_user,
            prev: &prev,
            restarts: self.restarts,
            started_at: &self.started_at,
            elapsed_ms: millis(self.earlier + self.began.elapsed()),
            reply: WireAssistant(turn.reply),
            results: turn.results,
            usage: turn.usage,
            cost: turn.cost,
            model_ms: millis(turn.model_time),
            step: turn.step,
        };
        let line = serde_json::to_vec(&line).expect("a turn line serialises");
        *prev = digest(&line);
        drop(prev);
        Box::pin(self.log.commit(line))
    }
}

pub(super) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(turn: u32, prev: &str, content: &str) -> (String, TurnEntry) {
        let entry = TurnEntry {
            id: "run-0-0".into(),
            prompt_index: 0,
            sample: 0,
            turn,
            segment: 0,
            asked_final: false,
            simulated_user: None,
            prev: prev.to_owned(),
            restarts: 0,
            started_at: "2026-12-06T00:00:00.000000Z".into(),
            elapsed_ms: 0,
            reply: serde_json::json!({"role": "assistant", "content": content}),
            results: Vec::new(),
            usage: Usage::default(),
            cost: None,
            model_ms: 0,
            step: None,
        };
        let line = serde_json::to_vec(&entry).unwrap();
        (digest(&line), entry)
    }

    fn contents(chain: &Chain) -> Vec<&str> {
        chain
            .entries
            .iter()
            .map(|entry| entry.reply["content"].as_str().unwrap())
            .collect()
    }

    #[test]
    fn the_longest_linked_chain_is_taken_and_a_stale_branch_is_not_spliced_in() {
        // Writer A wrote turns 0..=2; a successor B took up A's turns 0..=1 and wrote 2' and 3';
        // A, still running, then wrote 3 after its own 2.
        let a0 = entry(0, "", "a0");
        let a1 = entry(1, &a0.0, "a1");
        let a2 = entry(2, &a1.0, "a2");
        let b2 = entry(2, &a1.0, "b2");
        let b3 = entry(3, &b2.0, "b3");
        let a3 = entry(3, &a2.0, "a3");
        let b4 = entry(4, &b3.0, "b4");
        let all = vec![a0, a1, a2.clone(), b2, b3, a3, b4.clone()];
        let chain = longest_chain(all.clone()).unwrap();
        assert_eq!(contents(&chain), ["a0", "a1", "b2", "b3", "b4"]);
        assert_eq!(chain.last, b4.0);
        // Without B's last turn the branches are as long: the first in log order wins.
        let tie: Vec<_> = all.into_iter().filter(|(hash, _)| *hash != b4.0).collect();
        let chain = longest_chain(tie).unwrap();
        assert_eq!(contents(&chain), ["a0", "a1", "a2", "a3"]);
    }

    #[test]
    fn a_line_as_written_reads_back_as_its_entry_with_the_reply_in_wire_shape() {
        use crate::model::{AssistantMessage, CallTokens, Message, ToolCall};
        let reply = AssistantMessage {
            content: "checking".into(),
            reasoning: None,
            tool_calls: vec![ToolCall {
                id: "call_1".into(),
                name: "terminal".into(),
                raw_arguments: r#"{"command":"ls"}"#.into(),
                arguments: Ok(serde_json::Map::new()),
            }],
        };
        let results = [ToolMessage {
            tool_call_id: "call_1".into(),
            name: "terminal".into(),
            content: "a.txt".into(),
        }];
        let step = Step {
            reply: Some(2),
            tokens: CallTokens {
                prompt_token_ids: Some(vec![1, 2, 3]),
                completion_token_ids: Some(vec![4]),
                logprobs: vec![-0.25],
                top_logprobs: Vec::new(),
                retokenized: false,
            },
            finish_reason: Some("tool_calls".into()),
            tier: None,
            endpoint: Some("http://model-a:8000/v1".into()),
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 1,
                ..Usage::default()
            },
        };
        let line = TurnLine {
            id: "run-0-1",
            prompt_index: 0,
            sample: 1,
            turn: 2,
            segment: 0,
            asked_final: false,
            simulated_user: None,
            prev: "ab",
            restarts: 0,
            started_at: "2026-12-06T00:00:00.000000Z",
            elapsed_ms: 7,
            reply: WireAssistant(&reply),
            results: &results,
            usage: Usage::default(),
            cost: None,
            model_ms: 3,
            step: Some(&step),
        };
        let entry: TurnEntry = serde_json::from_slice(&serde_json::to_vec(&line).unwrap()).unwrap();
        // The wire shape servers take back (content always there, the arguments as sent), and
        // the same the requests send.
        let wire = serde_json::json!({
            "role": "assistant",
            "content": "checking",
            "tool_calls": [{
                "id": "call_1",
                "type": "function",
                "function": {"name": "terminal", "arguments": r#"{"command":"ls"}"#},
            }],
        });
        assert_eq!(entry.reply, wire);
        assert_eq!(entry.reply, Message::Assistant(reply).to_wire());
        assert_eq!(entry.results, results);
        assert_eq!(
            entry.step.as_ref(),
            Some(&step),
            "a resumed call keeps its tokens"
        );
        assert_eq!(
            (
                entry.id.as_str(),
                entry.sample,
                entry.turn,
                entry.prev.as_str()
            ),
            ("run-0-1", 1, 2, "ab")
        );
    }

    #[test]
    fn a_chain_needs_its_first_turn_and_consecutive_numbers() {
        let a0 = entry(0, "", "a0");
        let a1 = entry(1, &a0.0, "a1");
        // A line that links to a1 but skips a number is no continuation.
        let skipped = entry(3, &a1.0, "x");
        let chain = longest_chain(vec![a0.clone(), a1.clone(), skipped]).unwrap();
        assert_eq!(contents(&chain), ["a0", "a1"]);
        // Without turn 0 nothing can be taken up.
        assert!(longest_chain(vec![a1.clone()]).is_none());
        // A line written twice (a group retried) counts once.
        let chain = longest_chain(vec![a0.clone(), a0.clone()]).unwrap();
        assert_eq!(contents(&chain), ["a0"]);
        // A start over outranks the longer chain it could not take up.
        let (_, mut over) = entry(0, "", "over");
        over.restarts = 1;
        let over_line = serde_json::to_vec(&over).unwrap();
        let over = (digest(&over_line), over);
        let chain = longest_chain(vec![a0, a1, over]).unwrap();
        assert_eq!(contents(&chain), ["over"]);
    }
}
