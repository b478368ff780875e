//! Batch mode (`spec.model.batch`): a process's model calls go through the provider's Batch API
//! at its price instead of one request each. A run keeps many conversations in flight, so each
//! round collects the ready turns of all of them into a window, which closes at a number of
//! requests, a size, or an age, and becomes one provider batch; each conversation waits for its
//! line's answer, runs its tools, and its next turn joins a later window. There is no barrier
//! between rounds: windows overlap, and results are applied as each batch ends, in any order.
//!
//! A turn that waits past the run's deadline goes live (the client's usual path), its batch
//! answer dropped when it comes; so do turns whose batch the provider refused, expired before
//! running them, or cancelled: the run's tail is not the batch's tail.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::batch_api::{BatchApi, BatchApiError, LineOutcome, ProviderBatch, request_line};
use crate::spec::BatchSpec;

/// How windows are cut, polled and waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    pub max_requests: usize,
    pub max_bytes: usize,
    pub max_wait: Duration,
    pub poll: Duration,
    /// How long a turn waits for its batch before it goes live.
    pub deadline: Duration,
}

impl BatchSettings {
    pub fn from_spec(spec: &BatchSpec) -> Self {
        Self {
            max_requests: usize::try_from(spec.max_requests).unwrap_or(usize::MAX),
            max_bytes: usize::try_from(spec.max_megabytes)
                .unwrap_or(usize::MAX)
                .saturating_mul(1 << 20),
            max_wait: Duration::from_secs(spec.max_wait_seconds),
            poll: Duration::from_secs(spec.poll_seconds),
            deadline: Duration::from_secs(spec.deadline_seconds),
        }
    }
}

/// What became of a turn sent in a batch.
#[derive(Debug)]
pub enum BatchAnswer {
    /// The chat completion's body.
    Answered(Vec<u8>),
    /// The provider refused the request itself: its status and message.
    Refused { status: u16, message: String },
    /// No answer from a batch: the turn goes live, for this reason.
    GoLive(String),
}

/// One turn waiting in a window.
struct Waiting {
    custom_id: String,
    line: Vec<u8>,
    answer: oneshot::Sender<BatchAnswer>,
}

/// What batch mode did in this process, so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WindowCounts {
    /// Provider batches created.
    pub windows: u64,
    /// Turns sent in them.
    pub sent: u64,
    /// Turns answered by a batch.
    pub answered: u64,
    /// Turns that went live: past the deadline, or their batch gave no answer.
    pub live: u64,
}

/// The `custom_id` of turn `turn` of the conversation `identity`: readable where it is short and
/// of the characters every provider takes (Anthropic's `^[a-zA-Z0-9_-]{1,64}$`), else a digest.
pub fn batch_custom_id(identity: &str, turn: usize) -> String {
    let id = format!("{identity}-{turn}");
    if id.len() <= 48
        && id
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_')
    {
        return id;
    }
    let digest = blake3::hash(identity.as_bytes()).to_hex();
    format!("c{}-{turn}", &digest.as_str()[..32])
}

/// The windows of one process, shared by all its conversations' clients.
#[derive(Debug)]
pub struct BatchWindows {
    settings: BatchSettings,
    /// Numbers the calls of clients without a conversation identity.
    calls: std::sync::atomic::AtomicU64,
    api: BatchApi,
    sender: mpsc::UnboundedSender<Waiting>,
    /// Taken by the collector when the first turn arrives (it needs the runtime).
    receiver: Mutex<Option<mpsc::UnboundedReceiver<Waiting>>>,
    counts: Arc<Mutex<WindowCounts>>,
}

impl BatchWindows {
    pub fn new(api: BatchApi, settings: BatchSettings) -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        Self {
            settings,
            calls: std::sync::atomic::AtomicU64::new(0),
            api,
            sender,
            receiver: Mutex::new(Some(receiver)),
            counts: Arc::default(),
        }
    }

    /// The Batch API's base URL.
    pub fn base_url(&self) -> &str {
        self.api.base_url()
    }

    /// A number for a call without a conversation identity.
    pub fn next_call(&self) -> u64 {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    pub fn counts(&self) -> WindowCounts {
        *self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn count(&self, update: impl FnOnce(&mut WindowCounts)) {
        update(&mut self.counts.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// Sends the request `body` in the next window as `custom_id`, and waits for its answer,
    /// at most the run's deadline.
    pub async fn ask(&self, custom_id: String, body: &Value) -> BatchAnswer {
        if let Some(receiver) = self
            .receiver
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            tokio::spawn(collect(
                receiver,
                self.api.clone(),
                self.settings,
                Arc::clone(&self.counts),
            ));
        }
        let (answer, answered) = oneshot::channel();
        let line = request_line(&custom_id, body);
        if self
            .sender
            .send(Waiting {
                custom_id,
                line,
                answer,
            })
            .is_err()
        {
            return BatchAnswer::GoLive("batch mode has stopped".into());
        }
        let answer = match tokio::time::timeout(self.settings.deadline, answered).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => BatchAnswer::GoLive("its window was dropped".into()),
            Err(_) => BatchAnswer::GoLive(format!(
                "it waited past the deadline of {} s",
                self.settings.deadline.as_secs()
            )),
        };
        match &answer {
            BatchAnswer::GoLive(reason) => {
                debug!(reason, "a turn goes live");
                self.count(|counts| counts.live += 1);
            }
            BatchAnswer::Answered(_) | BatchAnswer::Refused { .. } => {
                self.count(|counts| counts.answered += 1);
            }
        }
        answer
    }
}

/// Collects the turns into windows, each sent as a provider batch when it closes.
async fn collect(
    mut receiver: mpsc::UnboundedReceiver<Waiting>,
    api: BatchApi,
    settings: BatchSettings,
    counts: Arc<Mutex<WindowCounts>>,
) {
    let mut window: Vec<Waiting> = Vec::new();
    let mut ids: HashSet<String> = HashSet::new();
    let (mut bytes, mut opened) = (0, Instant::now());
    loop {
        let closes = opened + settings.max_wait;
        let next = tokio::select! {
            next = receiver.recv() => next,
            () = tokio::time::sleep_until(closes), if !window.is_empty() => {
                send_window(&api, settings, &counts, std::mem::take(&mut window));
                ids.clear();
                bytes = 0;
                continue;
            }
        };
        let Some(mut waiting) = next else {
            if !window.is_empty() {
                send_window(&api, settings, &counts, window);
            }
            return;
        };
        // A turn asked again (its answer could not be used) must not share its id in a file.
        if !ids.insert(waiting.custom_id.clone()) {
            waiting.custom_id = format!("{}-{}", waiting.custom_id, window.len());
            waiting.line = request_line_again(&waiting);
            ids.insert(waiting.custom_id.clone());
        }
        if window.is_empty() {
            opened = Instant::now();
        }
        bytes += waiting.line.len();
        window.push(waiting);
        if window.len() >= settings.max_requests || bytes >= settings.max_bytes {
            send_window(&api, settings, &counts, std::mem::take(&mut window));
            ids.clear();
            bytes = 0;
        }
    }
}

/// `waiting`'s line with its new custom id.
fn request_line_again(waiting: &Waiting) -> Vec<u8> {
    let mut line: Value = serde_json::from_slice(&waiting.line).expect("a line the worker wrote");
    line["custom_id"] = waiting.custom_id.clone().into();
    let mut bytes = serde_json::to_vec(&line).expect("a JSON value serialises");
    bytes.push(b'\n');
    bytes
}

fn send_window(
    api: &BatchApi,
    settings: BatchSettings,
    counts: &Arc<Mutex<WindowCounts>>,
    window: Vec<Waiting>,
) {
    let (api, counts) = (api.clone(), Arc::clone(counts));
    tokio::spawn(async move {
        let size = window.len();
        match run_window(&api, settings, &window).await {
            Ok(batch) => {
                {
                    let mut counts = counts.lock().unwrap_or_else(PoisonError::into_inner);
                    counts.windows += 1;
                    counts.sent += size as u64;
                }
                deliver(&api, &batch, window).await;
            }
            Err(reason) => {
                warn!(%reason, turns = size, "a window got no batch; its turns go live");
                for waiting in window {
                    let _ = waiting.answer.send(BatchAnswer::GoLive(reason.clone()));
                }
            }
        }
    });
}

/// Attempts of a Batch API call that the provider says to retry.
const API_ATTEMPTS: u32 = 8;

/// Calls `call` until it succeeds, the provider refuses for good, or [`API_ATTEMPTS`] pass.
async fn with_retries<T, F, Fut>(poll: Duration, mut call: F) -> Result<T, BatchApiError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, BatchApiError>>,
{
    let mut attempt = 0;
    loop {
        match call().await {
            Err(error) if error.is_transient() && attempt + 1 < API_ATTEMPTS => {
                attempt += 1;
                let wait = match &error {
                    BatchApiError::Status {
                        retry_after: Some(after),
                        ..
                    } => *after,
                    _ => poll.min(Duration::from_secs(1) * attempt),
                };
                debug!(%error, wait_ms = wait.as_millis(), "the batch API says to retry");
                tokio::time::sleep(wait).await;
            }
            outcome => return outcome,
        }
    }
}

/// Uploads the window, creates its batch and polls it until it ends.
async fn run_window(
    api: &BatchApi,
    settings: BatchSettings,
    window: &[Waiting],
) -> Result<ProviderBatch, String> {
    let mut file = Vec::with_capacity(window.iter().map(|waiting| waiting.line.len()).sum());
    for waiting in window {
        file.extend_from_slice(&waiting.line);
    }
    let file_id = with_retries(settings.poll, || api.upload("window.jsonl", file.clone()))
        .await
        .map_err(|err| err.to_string())?;
    let metadata = serde_json::Map::new();
    let created = with_retries(settings.poll, || api.create(&file_id, &metadata))
        .await
        .map_err(|err| err.to_string())?;
    info!(batch = %created.id, turns = window.len(), "a window went out as a provider batch");
    let mut batch = created;
    while !batch.status.ended() {
        tokio::time::sleep(settings.poll).await;
        if window.iter().all(|waiting| waiting.answer.is_closed()) {
            // Every turn went live: the batch's answers would be dropped.
            let _ = api.cancel(&batch.id).await;
            return Err("every turn of the window went live".into());
        }
        match api.retrieve(&batch.id).await {
            Ok(now) => batch = now,
            Err(error) if error.is_transient() => {
                debug!(%error, batch = %batch.id, "polling a batch failed; polling again");
            }
            Err(error) => return Err(error.to_string()),
        }
    }
    Ok(batch)
}

/// Hands each turn of an ended batch its answer.
async fn deliver(api: &BatchApi, batch: &ProviderBatch, window: Vec<Waiting>) {
    let results = match with_retries(Duration::from_secs(1), || api.results(batch)).await {
        Ok(results) => results,
        Err(error) => {
            let reason = format!(
                "the results of batch {} could not be read: {error}",
                batch.id
            );
            for waiting in window {
                let _ = waiting.answer.send(BatchAnswer::GoLive(reason.clone()));
            }
            return;
        }
    };
    let mut by_id: HashMap<String, LineOutcome> = results
        .into_iter()
        .map(|result| (result.custom_id, result.outcome))
        .collect();
    for waiting in window {
        let answer = match by_id.remove(&waiting.custom_id) {
            Some(LineOutcome::Answered(body)) => BatchAnswer::Answered(body),
            Some(LineOutcome::Refused { status, message }) => {
                BatchAnswer::Refused { status, message }
            }
            Some(LineOutcome::NotRun { code, message }) => {
                BatchAnswer::GoLive(format!("batch {}: {code}: {message}", batch.id))
            }
            None if batch.status == super::batch_api::BatchStatus::Failed => BatchAnswer::GoLive(
                format!("batch {} was refused: {}", batch.id, batch.failure()),
            ),
            None => BatchAnswer::GoLive(format!(
                "batch {} ended {:?} without its result",
                batch.id, batch.status
            )),
        };
        let _ = waiting.answer.send(answer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn custom_ids_are_readable_where_every_provider_takes_them_else_a_digest() {
        assert_eq!(batch_custom_id("row-7_s0", 3), "row-7_s0-3");
        let long = batch_custom_id(&"x".repeat(80), 12);
        let odd = batch_custom_id("t/7:s0", 0);
        for id in [&long, &odd] {
            assert!(id.len() <= 64, "{id}");
            assert!(
                id.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
                "{id}"
            );
        }
        assert!(long.ends_with("-12"));
        assert_ne!(batch_custom_id("t/7:s0", 0), batch_custom_id("t/7:s1", 0));
    }
}
