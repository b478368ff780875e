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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::batch_api::{BatchApi, BatchApiError, BatchProvider, LineOutcome, ProviderBatch};
use super::batch_journal::{
    Claim, EarlierWindow, EarlierWindows, IntentLine, JournalEntry, WindowJournal, line_digest,
};
use crate::spec::BatchSpec;

/// Which API windows go to, and how they are cut, polled and waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    pub provider: BatchProvider,
    pub max_requests: usize,
    pub max_bytes: usize,
    pub max_wait: Duration,
    pub poll: Duration,
    /// How long a turn waits for its batch before it goes live.
    pub deadline: Duration,
    /// The percent of a batch's conversations still running that makes its tail, whose turns
    /// go live.
    pub live_tail_percent: u32,
}

impl BatchSettings {
    pub fn from_spec(spec: &BatchSpec) -> Self {
        Self {
            provider: spec.provider,
            max_requests: usize::try_from(spec.max_requests).unwrap_or(usize::MAX),
            max_bytes: usize::try_from(spec.max_megabytes)
                .unwrap_or(usize::MAX)
                .saturating_mul(1 << 20),
            max_wait: Duration::from_secs(spec.max_wait_seconds),
            poll: Duration::from_secs(spec.poll_seconds),
            deadline: Duration::from_secs(spec.deadline_seconds),
            live_tail_percent: spec.live_tail_percent,
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

/// Whether a batch of the run has reached its tail: every conversation started, few still
/// running; their turns go live from then on, those waiting in a window at once.
#[derive(Debug)]
pub struct BatchTail {
    /// Conversations still running at or below which the tail is reached.
    at: usize,
    reached: AtomicBool,
    notify: Notify,
}

impl BatchTail {
    /// The tail of a batch of `conversations`, `percent` of them.
    pub fn new(conversations: usize, percent: u32) -> Self {
        Self {
            at: conversations.saturating_mul(percent as usize) / 100,
            reached: AtomicBool::new(false),
            notify: Notify::new(),
        }
    }

    /// `running` conversations still run and none will start: the tail is reached at or below
    /// its size.
    pub fn running(&self, running: usize) {
        if running <= self.at && !self.reached.swap(true, Ordering::SeqCst) {
            info!(running, "the batch's last conversations go live");
            self.notify.notify_waiters();
        }
    }

    pub fn is_reached(&self) -> bool {
        self.reached.load(Ordering::SeqCst)
    }

    /// Resolves once the tail is reached.
    pub async fn reached(&self) {
        let notified = self.notify.notified();
        if self.is_reached() {
            return;
        }
        notified.await;
    }
}

/// One turn waiting in a window.
struct Waiting {
    custom_id: String,
    line: Vec<u8>,
    answer: oneshot::Sender<BatchAnswer>,
    /// Where its batch's window is journaled (none: the run keeps no turn log).
    journal: Option<Arc<dyn WindowJournal>>,
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

/// The answers of adopted windows, by custom id, until their turns ask for them (`None`: the
/// window's batch was never created, or is gone: the turn is sent again).
type AdoptedAnswers = HashMap<String, oneshot::Receiver<Option<BatchAnswer>>>;

/// The windows of one process, shared by all its conversations' clients.
#[derive(Debug)]
pub struct BatchWindows {
    settings: BatchSettings,
    /// Names this process's windows (`<name>-<n>`), in the journal and the batches' metadata.
    name: String,
    /// Numbers the calls of clients without a conversation identity.
    calls: std::sync::atomic::AtomicU64,
    api: BatchApi,
    sender: mpsc::UnboundedSender<Waiting>,
    /// Taken by the collector when the first turn arrives (it needs the runtime).
    receiver: Mutex<Option<mpsc::UnboundedReceiver<Waiting>>>,
    /// Windows of killed processes that journaled them, to adopt.
    earlier: Mutex<EarlierWindows>,
    adopted: Mutex<AdoptedAnswers>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl BatchWindows {
    pub fn new(api: BatchApi, settings: BatchSettings) -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        Self {
            settings,
            name: format!("{:016x}", rand::random::<u64>()),
            calls: std::sync::atomic::AtomicU64::new(0),
            api,
            sender,
            receiver: Mutex::new(Some(receiver)),
            earlier: Mutex::default(),
            adopted: Mutex::default(),
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

    /// Takes up the windows an earlier process journaled: a turn they hold that is asked again
    /// waits for their batch's answer rather than being sent again.
    pub fn take_up(&self, entries: Vec<JournalEntry>) {
        lock(&self.earlier).add(entries);
    }

    /// Sends the request `body` in the next window as `custom_id` (journaled in `journal`), and
    /// waits for its answer, at most the run's deadline; a turn an earlier process's window
    /// holds waits for that window's answer instead.
    pub async fn ask(
        &self,
        custom_id: String,
        body: &Value,
        journal: Option<Arc<dyn WindowJournal>>,
    ) -> BatchAnswer {
        let deadline = Instant::now() + self.settings.deadline;
        let line = match self.api.request_line(&custom_id, body) {
            Ok(line) => line,
            Err(reason) => {
                return BatchAnswer::GoLive(format!("the batch API cannot ask it: {reason}"));
            }
        };
        if let Some(adopted) = self.adopted_answer(&custom_id, &line, journal.as_ref()) {
            match tokio::time::timeout_at(deadline, adopted).await {
                Ok(Ok(Some(answer))) => return answer,
                // Never created, or gone: sent again below.
                Ok(Ok(None) | Err(_)) => {}
                Err(_) => return past_deadline(self.settings.deadline),
            }
        }
        if let Some(receiver) = lock(&self.receiver).take() {
            tokio::spawn(collect(
                receiver,
                self.api.clone(),
                self.settings,
                self.name.clone(),
            ));
        }
        let (answer, answered) = oneshot::channel();
        let waiting = Waiting {
            custom_id,
            line,
            answer,
            journal,
        };
        if self.sender.send(waiting).is_err() {
            return BatchAnswer::GoLive("batch mode has stopped".into());
        }
        let answer = match tokio::time::timeout_at(deadline, answered).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => BatchAnswer::GoLive("its window was dropped".into()),
            Err(_) => past_deadline(self.settings.deadline),
        };
        if let BatchAnswer::GoLive(reason) = &answer {
            debug!(reason, "a turn goes live");
        }
        answer
    }

    /// The answer an earlier process's window holds for `custom_id` with this `line`, adopting
    /// the window (its batch polled and read in the background) at the first of its turns.
    fn adopted_answer(
        &self,
        custom_id: &str,
        line: &[u8],
        journal: Option<&Arc<dyn WindowJournal>>,
    ) -> Option<oneshot::Receiver<Option<BatchAnswer>>> {
        // Held until the window's answers are in `adopted`: a turn of the same window asked
        // meanwhile must find its answer there.
        let mut earlier = lock(&self.earlier);
        match earlier.claim(custom_id, line) {
            Claim::None => return None,
            Claim::Adopted => {}
            Claim::Adopt(window) => {
                let mut answers = Vec::with_capacity(window.custom_ids.len());
                {
                    let mut adopted = lock(&self.adopted);
                    for id in &window.custom_ids {
                        let (answer, answered) = oneshot::channel();
                        adopted.insert(id.clone(), answered);
                        answers.push(answer);
                    }
                }
                info!(window = %window.name, turns = answers.len(), "adopting an earlier window");
                tokio::spawn(adopt(
                    self.api.clone(),
                    self.settings,
                    window,
                    answers,
                    journal.cloned(),
                ));
            }
        }
        earlier.answered(custom_id);
        drop(earlier);
        lock(&self.adopted).remove(custom_id)
    }
}

fn past_deadline(deadline: Duration) -> BatchAnswer {
    BatchAnswer::GoLive(format!(
        "it waited past the deadline of {} s",
        deadline.as_secs()
    ))
}

/// Collects the turns into windows, each sent as a provider batch when it closes: at
/// `max_requests` turns, before a turn that would take its file past `max_bytes`, or
/// `max_wait` after its first turn.
async fn collect(
    mut receiver: mpsc::UnboundedReceiver<Waiting>,
    api: BatchApi,
    settings: BatchSettings,
    name: String,
) {
    let mut window: Vec<Waiting> = Vec::new();
    let mut ids: HashSet<String> = HashSet::new();
    let (mut bytes, mut opened, mut windows_sent) = (0, Instant::now(), 0_u64);
    let mut send = |window: &mut Vec<Waiting>, ids: &mut HashSet<String>, bytes: &mut usize| {
        windows_sent += 1;
        let turns = std::mem::take(window);
        tokio::spawn(send_window(
            api.clone(),
            settings,
            format!("{name}-{windows_sent}"),
            turns,
        ));
        ids.clear();
        *bytes = 0;
    };
    loop {
        let closes = opened + settings.max_wait;
        let next = tokio::select! {
            next = receiver.recv() => next,
            () = tokio::time::sleep_until(closes), if !window.is_empty() => {
                send(&mut window, &mut ids, &mut bytes);
                continue;
            }
        };
        let Some(mut waiting) = next else {
            if !window.is_empty() {
                send(&mut window, &mut ids, &mut bytes);
            }
            return;
        };
        if !window.is_empty() && bytes + waiting.line.len() > settings.max_bytes {
            send(&mut window, &mut ids, &mut bytes);
        }
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
        if window.len() >= settings.max_requests {
            send(&mut window, &mut ids, &mut bytes);
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

/// Journals, sends and polls one window, then hands each of its turns its answer.
async fn send_window(api: BatchApi, settings: BatchSettings, name: String, window: Vec<Waiting>) {
    let size = window.len();
    let outcome = match journal_intent(&name, &window).await {
        Ok(journals) => run_window(&api, settings, &name, &window, &journals).await,
        Err(reason) => Err(reason),
    };
    match outcome {
        Ok(batch) => {
            let answers = read_answers(&api, &batch, window.iter().map(|w| &w.custom_id)).await;
            for (waiting, answer) in window.into_iter().zip(answers) {
                let _ = waiting.answer.send(answer);
            }
        }
        Err(reason) => {
            warn!(%reason, turns = size, "a window got no batch; its turns go live");
            for waiting in window {
                let _ = waiting.answer.send(BatchAnswer::GoLive(reason.clone()));
            }
        }
    }
}

/// Writes the window's intent in the journal of each of its turns' batches, before anything is
/// sent (a window with no journal is not journaled); returns those journals.
async fn journal_intent(
    name: &str,
    window: &[Waiting],
) -> Result<Vec<Arc<dyn WindowJournal>>, String> {
    let mut journals: Vec<(Arc<dyn WindowJournal>, Vec<IntentLine>)> = Vec::new();
    for waiting in window {
        let Some(journal) = &waiting.journal else {
            continue;
        };
        let line = IntentLine {
            custom_id: waiting.custom_id.clone(),
            digest: line_digest(&waiting.line),
        };
        match journals
            .iter_mut()
            .find(|(known, _)| Arc::ptr_eq(known, journal))
        {
            Some((_, lines)) => lines.push(line),
            None => journals.push((Arc::clone(journal), vec![line])),
        }
    }
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    let mut written = Vec::with_capacity(journals.len());
    for (journal, lines) in journals {
        let window = name.to_owned();
        journal
            .write(JournalEntry::Intent { window, at, lines })
            .await
            .map_err(|error| format!("its intent could not be journaled: {error}"))?;
        written.push(journal);
    }
    Ok(written)
}

/// The metadata that names window `name` at the provider.
fn window_metadata(name: &str) -> serde_json::Map<String, Value> {
    let mut metadata = serde_json::Map::new();
    metadata.insert("trajectory_window".into(), name.into());
    metadata
}

/// Writes the creation of window `name`'s batch in `journals`; a failure costs only a lookup
/// by metadata when the window is adopted.
async fn journal_creation(journals: &[Arc<dyn WindowJournal>], name: &str, batch_id: &str) {
    for journal in journals {
        let entry = JournalEntry::Created {
            window: name.to_owned(),
            batch_id: batch_id.to_owned(),
        };
        if let Err(error) = journal.write(entry).await {
            warn!(%error, window = name, "the creation of a window's batch was not journaled");
        }
    }
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

/// Uploads the window, creates its batch (journaled in `journals`) and polls it until it ends.
async fn run_window(
    api: &BatchApi,
    settings: BatchSettings,
    name: &str,
    window: &[Waiting],
    journals: &[Arc<dyn WindowJournal>],
) -> Result<ProviderBatch, String> {
    let mut file = Vec::with_capacity(window.iter().map(|waiting| waiting.line.len()).sum());
    for waiting in window {
        file.extend_from_slice(&waiting.line);
    }
    let input = with_retries(settings.poll, || api.prepare(&file))
        .await
        .map_err(|err| err.to_string())?;
    let metadata = window_metadata(name);
    let created = with_retries(settings.poll, || api.create(&input, &metadata))
        .await
        .map_err(|err| err.to_string())?;
    journal_creation(journals, name, &created.id).await;
    info!(batch = %created.id, window = name, turns = window.len(), "a window went out as a provider batch");
    let all_live = || window.iter().all(|waiting| waiting.answer.is_closed());
    poll_until_ended(api, settings, created, all_live).await
}

/// Polls `batch` until it ends; cancels it when `abandoned` says no one waits for its answers.
async fn poll_until_ended(
    api: &BatchApi,
    settings: BatchSettings,
    mut batch: ProviderBatch,
    abandoned: impl Fn() -> bool,
) -> Result<ProviderBatch, String> {
    while !batch.status.ended() {
        tokio::time::sleep(settings.poll).await;
        if abandoned() {
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

/// Adopts an earlier process's window: finds its batch (by its journaled id, else by the
/// window's name in the batches' metadata), polls it and hands its turns their answers; `None`
/// to each when the batch was never created or cannot be read (the turns are sent again).
async fn adopt(
    api: BatchApi,
    settings: BatchSettings,
    window: EarlierWindow,
    answers: Vec<oneshot::Sender<Option<BatchAnswer>>>,
    journal: Option<Arc<dyn WindowJournal>>,
) {
    if window.batch_id.is_none() && !api.names_batches() {
        info!(window = %window.name, "an earlier window's batch id was never journaled and this provider's batches carry no name; its turns are sent again");
        return;
    }
    let found = if let Some(id) = &window.batch_id {
        with_retries(settings.poll, || api.retrieve(id))
            .await
            .map(Some)
    } else {
        // Clocks differ between machines: look a little before the intent.
        let since = window.at.saturating_sub(600);
        let metadata = window_metadata(&window.name);
        with_retries(settings.poll, || api.find(&metadata, since))
            .await
            .map(|found| found.into_iter().next())
    };
    let batch = match found {
        Ok(Some(batch)) => batch,
        Ok(None) => {
            info!(window = %window.name, "an earlier window's batch was never created; its turns are sent again");
            return;
        }
        Err(error) => {
            warn!(%error, window = %window.name, "an earlier window's batch cannot be read; its turns are sent again");
            return;
        }
    };
    if window.batch_id.is_none() {
        journal_creation(journal.as_slice(), &window.name, &batch.id).await;
    }
    info!(batch = %batch.id, window = %window.name, "adopted an earlier window's batch");
    let abandoned = || answers.iter().all(oneshot::Sender::is_closed);
    match poll_until_ended(&api, settings, batch, abandoned).await {
        Ok(batch) => {
            let read = read_answers(&api, &batch, window.custom_ids.iter()).await;
            for (answer, read) in answers.into_iter().zip(read) {
                let _ = answer.send(Some(read));
            }
        }
        Err(reason) => {
            warn!(%reason, window = %window.name, "an adopted batch gave no answers; its turns are sent again");
        }
    }
}

/// The answers of an ended batch to `custom_ids`, in their order.
async fn read_answers<'a>(
    api: &BatchApi,
    batch: &ProviderBatch,
    custom_ids: impl Iterator<Item = &'a String>,
) -> Vec<BatchAnswer> {
    let results = match with_retries(Duration::from_secs(1), || api.results(batch)).await {
        Ok(results) => results,
        Err(error) => {
            let reason = format!(
                "the results of batch {} could not be read: {error}",
                batch.id
            );
            return custom_ids
                .map(|_| BatchAnswer::GoLive(reason.clone()))
                .collect();
        }
    };
    let mut by_id: HashMap<String, LineOutcome> = results
        .into_iter()
        .map(|result| (result.custom_id, result.outcome))
        .collect();
    custom_ids
        .map(|custom_id| match by_id.remove(custom_id) {
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
        })
        .collect()
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
