//! Batch mode's windows journal on the run's storage (`model::batch_journal` says what it holds
//! and why): each writer of a batch appends to a journal of its own beside its turn log
//! (`batches/batch-NNNNNN/w-<writer>.windows.jsonl`; on a bucket one part per entry), with the
//! turn log's disciplines. A writer reads every journal of its batch at its start and hands the
//! windows to its client, which adopts those its conversations ask again; a batch that finishes
//! removes its own journal.

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use tracing::{info, warn};

use super::RunError;
use super::conversation::{Shared, lock};
use super::engine::TurnLogging;
use crate::model::batch_journal::{JournalEntry, WindowJournal};
use crate::model::batch_windows::BatchTail;
use crate::storage::{RunDir, TurnsWriter, WriterId};

/// A writer's windows journal.
#[derive(Debug)]
pub(super) struct StoredJournal {
    /// Taken when the batch is done, to remove the journal.
    writer: Arc<Mutex<Option<TurnsWriter>>>,
}

impl WindowJournal for StoredJournal {
    fn write(&self, entry: JournalEntry) -> BoxFuture<'_, Result<(), String>> {
        let writer = Arc::clone(&self.writer);
        Box::pin(async move {
            let line = serde_json::to_vec(&entry).map_err(|err| err.to_string())?;
            tokio::task::spawn_blocking(move || match lock(&writer).as_mut() {
                Some(writer) => writer.append(&[&line]).map_err(|err| err.to_string()),
                None => Err("the batch's windows journal is closed".into()),
            })
            .await
            .map_err(|err| format!("the journal's writer panicked: {err}"))?
        })
    }
}

impl StoredJournal {
    /// Removes the journal: every key of the batch has its record, no turn is asked again.
    pub(super) fn remove(&self) {
        let Some(writer) = lock(&self.writer).take() else {
            return;
        };
        if let Err(error) = writer.remove() {
            warn!(%error, "could not remove the batch's windows journal");
        }
    }
}

/// What batch mode keeps for one batch of a worker.
#[derive(Debug, Default)]
pub(super) struct BatchMode {
    /// This writer's windows journal, where turns are logged.
    journal: Option<Arc<StoredJournal>>,
}

impl BatchMode {
    /// The batch is done: its journal goes (every key has its record, no turn is asked again).
    pub(super) fn finish(self) {
        if let Some(journal) = self.journal {
            journal.remove();
        }
    }
}

/// For a batch of `conversations` to run whose client is in batch mode: has the client's turns
/// go live at the batch's tail, and, where turns are logged (a window is adopted only where turns are taken up), hands
/// it the windows earlier writers of the batch journaled and has it journal its own in this
/// writer's journal.
pub(super) fn start_batch_mode(
    shared: &mut Shared,
    run_dir: &RunDir,
    (batch, writer_id): (u32, &WriterId),
    conversations: usize,
) -> Result<BatchMode, RunError> {
    let Some(percent) = shared.engine.client.live_tail_percent() else {
        return Ok(BatchMode::default());
    };
    if percent > 0 {
        let tail = Arc::new(BatchTail::new(conversations, percent));
        shared.engine.client = shared.engine.client.with_tail(tail);
    }
    if shared.engine.turns == TurnLogging::Off {
        return Ok(BatchMode::default());
    }
    let client = &shared.engine.client;
    let entries = read_journals(run_dir, batch)?;
    if !entries.is_empty() {
        info!(
            entries = entries.len(),
            "taking up the windows earlier writers sent"
        );
        client.take_up_windows(entries);
    }
    let writer = run_dir
        .store()
        .turns_writer(&run_dir.batch_windows_of(batch, writer_id));
    let journal = Arc::new(StoredJournal {
        writer: Arc::new(Mutex::new(Some(writer))),
    });
    shared.engine.client =
        client.with_window_journal(Arc::clone(&journal) as Arc<dyn WindowJournal>);
    Ok(BatchMode {
        journal: Some(journal),
    })
}

/// Every entry of the batch's windows journals, in name order (a torn or unreadable line
/// skipped: its window is looked for by name, or sent again).
fn read_journals(run_dir: &RunDir, batch: u32) -> Result<Vec<JournalEntry>, RunError> {
    let journals = run_dir.window_journals(batch)?;
    if journals.is_empty() {
        return Ok(Vec::new());
    }
    let read = run_dir
        .store()
        .read_files_lines_into(journals.iter().map(std::path::PathBuf::as_path), Vec::new())?;
    let mut entries = Vec::with_capacity(read.lines.len());
    for (index, &(start, end)) in read.lines.iter().enumerate() {
        match serde_json::from_slice(&read.data[start..end]) {
            Ok(entry) => entries.push(entry),
            Err(error) => {
                let file = journals[read.file_of(index)].display();
                warn!(batch, %file, %error, "skipping an unreadable windows journal line");
            }
        }
    }
    Ok(entries)
}
