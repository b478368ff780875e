//! Batch mode's journal: what a process sent to the provider's Batch API, on the run's storage
//! before it acts on it, so that a successor of a killed process adopts the batches already paid
//! for instead of sending their turns again.
//!
//! Each window is journaled twice: its intent (the `custom_id` and the digest of every line)
//! before its file is uploaded, and its provider batch's id once the batch is created. A window
//! with an intent and no id was created or not: the batch carries the window's name in its
//! metadata, so the successor looks for it ([`super::batch_api::BatchApi::find`]). The turn log
//! says which turns were applied: a conversation taken up asks exactly the turn it had in flight,
//! under the same `custom_id` (the conversation's identity and the turn), and gets the adopted
//! batch's answer for it when the line it would send now is the line the window held.

use std::collections::HashMap;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

/// One line of a window's intent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntentLine {
    pub custom_id: String,
    /// [`line_digest`] of the request line.
    pub digest: String,
}

/// One line of a windows journal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "entry", rename_all = "snake_case")]
pub enum JournalEntry {
    /// Written before the window's file is uploaded.
    Intent {
        window: String,
        /// When (seconds since the epoch): a batch looked for again was created after it.
        at: u64,
        lines: Vec<IntentLine>,
    },
    /// Written once the provider created the window's batch.
    Created { window: String, batch_id: String },
}

/// Where a batch's windows are journaled (the run layer keeps it on the run's storage).
pub trait WindowJournal: Send + Sync + std::fmt::Debug {
    /// Makes `entry` durable, or says why it could not.
    fn write(&self, entry: JournalEntry) -> BoxFuture<'_, Result<(), String>>;
}

/// The digest of a request line, as an intent keeps it: 128 bits of BLAKE3, hex.
pub fn line_digest(line: &[u8]) -> String {
    blake3::hash(line).to_hex()[..32].to_owned()
}

/// A window an earlier process journaled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EarlierWindow {
    pub name: String,
    pub at: u64,
    /// Its provider batch, when its creation was journaled.
    pub batch_id: Option<String>,
    pub custom_ids: Vec<String>,
}

/// The windows of earlier processes, by the turns they hold; each adopted at most once, when
/// the first of its turns is asked again.
#[derive(Debug, Default)]
pub struct EarlierWindows {
    /// Custom id: the window holding it and the digest of its line.
    lines: HashMap<String, (String, String)>,
    /// Not yet adopted, by name.
    windows: HashMap<String, EarlierWindow>,
}

/// What became of a turn asked again.
#[derive(Debug, PartialEq, Eq)]
pub enum Claim {
    /// No earlier window holds it (or held another request under its id): send it.
    None,
    /// Its window is adopted already: wait for its answer there.
    Adopted,
    /// Its window is to be adopted now, by the one who claimed it.
    Adopt(EarlierWindow),
}

impl EarlierWindows {
    /// Adds the windows `entries` journal; a window's creation may be in another journal than
    /// its intent (a successor that found its batch records it).
    pub fn add(&mut self, entries: impl IntoIterator<Item = JournalEntry>) {
        let mut created = Vec::new();
        for entry in entries {
            match entry {
                JournalEntry::Intent { window, at, lines } => {
                    let custom_ids = lines
                        .into_iter()
                        .map(|line| {
                            self.lines
                                .insert(line.custom_id.clone(), (window.clone(), line.digest));
                            line.custom_id
                        })
                        .collect();
                    self.windows.insert(
                        window.clone(),
                        EarlierWindow {
                            name: window,
                            at,
                            batch_id: None,
                            custom_ids,
                        },
                    );
                }
                JournalEntry::Created { window, batch_id } => created.push((window, batch_id)),
            }
        }
        for (window, batch_id) in created {
            if let Some(earlier) = self.windows.get_mut(&window) {
                earlier.batch_id = Some(batch_id);
            }
        }
    }

    /// Whether an earlier window holds the turn `custom_id` with this request `line` (its
    /// digest is computed only for a turn an earlier window holds: every batch call asks).
    pub fn claim(&mut self, custom_id: &str, line: &[u8]) -> Claim {
        let Some((window, held)) = self.lines.get(custom_id) else {
            return Claim::None;
        };
        if *held != line_digest(line) {
            // The conversation asks something else under that id now (it started over).
            self.lines.remove(custom_id);
            return Claim::None;
        }
        match self.windows.remove(window) {
            Some(earlier) => Claim::Adopt(earlier),
            None => Claim::Adopted,
        }
    }

    /// Forgets `custom_id`: its answer was taken.
    pub fn answered(&mut self, custom_id: &str) {
        self.lines.remove(custom_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An intent holding each custom id with the request line given.
    fn intent(window: &str, ids: &[(&str, &str)]) -> JournalEntry {
        JournalEntry::Intent {
            window: window.into(),
            at: 7,
            lines: ids
                .iter()
                .map(|(custom_id, line)| IntentLine {
                    custom_id: (*custom_id).into(),
                    digest: line_digest(line.as_bytes()),
                })
                .collect(),
        }
    }

    #[test]
    fn a_window_is_adopted_once_by_the_first_turn_asked_again_with_the_same_line() {
        let mut earlier = EarlierWindows::default();
        // The creation journaled by another writer than the intent.
        earlier.add([intent("w-1", &[("a-0", "da"), ("b-0", "db")])]);
        earlier.add([JournalEntry::Created {
            window: "w-1".into(),
            batch_id: "batch_9".into(),
        }]);
        let Claim::Adopt(window) = earlier.claim("a-0", b"da") else {
            panic!("the first claim adopts");
        };
        assert_eq!(window.batch_id.as_deref(), Some("batch_9"));
        assert_eq!(window.custom_ids, ["a-0", "b-0"]);
        assert_eq!(earlier.claim("b-0", b"db"), Claim::Adopted);
        assert_eq!(earlier.claim("c-0", b"dc"), Claim::None);
    }

    #[test]
    fn a_turn_whose_line_changed_is_sent_again() {
        let mut earlier = EarlierWindows::default();
        earlier.add([intent("w-1", &[("a-3", "old")])]);
        assert_eq!(earlier.claim("a-3", b"new"), Claim::None);
        assert_eq!(earlier.claim("a-3", b"old"), Claim::None, "forgotten");
    }

    #[test]
    fn entries_read_back_as_written() {
        let entry = intent("w-1", &[("a-0", "da")]);
        let line = serde_json::to_string(&entry).unwrap();
        assert!(
            line.starts_with(r#"{"entry":"intent","window":"w-1""#),
            "{line}"
        );
        assert_eq!(serde_json::from_str::<JournalEntry>(&line).unwrap(), entry);
    }
}
