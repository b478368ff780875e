//! `statistics.json`'s `episodes`: how the kept records of rows with several user turns went,
//! summed from each record's `episode`.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Value, json};

/// A record's `episode`, as merge reads it.
#[derive(Debug, Default, Deserialize)]
pub struct EpisodeView {
    #[serde(default)]
    turns: u64,
    #[serde(default)]
    answered: u64,
    #[serde(default)]
    termination_reason: String,
}

/// Running totals of the records' episodes.
#[derive(Debug, Default)]
pub struct Episodes {
    records: u64,
    turns: u64,
    answered: u64,
    by_termination: BTreeMap<String, u64>,
}

impl Episodes {
    pub fn add(&mut self, episode: &EpisodeView) {
        self.records += 1;
        self.turns += episode.turns;
        self.answered += episode.answered;
        *self
            .by_termination
            .entry(episode.termination_reason.clone())
            .or_default() += 1;
    }

    pub fn absorb(&mut self, other: Self) {
        self.records += other.records;
        self.turns += other.turns;
        self.answered += other.answered;
        for (reason, count) in other.by_termination {
            *self.by_termination.entry(reason).or_default() += count;
        }
    }

    /// `statistics.json`'s `episodes`; `None` when no record was an episode.
    pub fn summary(&self) -> Option<Value> {
        (self.records > 0).then(|| {
            json!({
                "records": self.records,
                "user_turns": self.turns,
                "answered": self.answered,
                "answered_rate": percent(self.answered, self.turns),
                "by_termination_reason": self.by_termination,
            })
        })
    }
}

/// `part` of `whole` in percent, to two places (0 of nothing is 0).
#[allow(clippy::cast_precision_loss)] // counts of turns stay far below 2^52
fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        return 0.0;
    }
    (part as f64 * 10_000.0 / whole as f64).round() / 100.0
}
