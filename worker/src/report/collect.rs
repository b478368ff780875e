//! What a report needs of every record, gathered in one pass: distributions of turns, tokens and
//! durations as histograms, counts per drawn toolset combination and per discard reason, and a
//! bounded, stratified, deterministic sample of whole record lines.
//!
//! The pass is merge's own (each reader thread keeps a [`Collector`] and merge adds them up), or
//! a read of the merged outputs for `trajectory-worker report`; both see the same records and
//! produce the same report.

use std::collections::{BTreeMap, BinaryHeap};

use serde::Serialize;

/// Records of each stratum (outcome and reason) kept in the sample before the page's byte
/// budget picks among them.
pub const PER_STRATUM: usize = 200;

/// How a record ended, as the report groups records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome<'a> {
    /// A trajectory: `completed` when the model gave its answer, `partial` when a reply was cut
    /// off at the token limit, neither when it ran out of turns.
    Trajectory { completed: bool, partial: bool },
    /// Discarded by a filter (the filter's name).
    Discarded { filter: &'a str },
    /// Failed (the error's class).
    Failed { class: &'a str },
}

impl<'a> Outcome<'a> {
    /// A record's outcome from its fields: no `status` is a trajectory, `discarded` names its
    /// `filter`, any other status its `error_class`.
    pub fn of(
        status: Option<&str>,
        (completed, partial): (bool, bool),
        filter: Option<&'a str>,
        error_class: Option<&'a str>,
    ) -> Self {
        match status {
            None => Self::Trajectory { completed, partial },
            Some("discarded") => Self::Discarded {
                filter: filter.unwrap_or("unknown"),
            },
            Some(_) => Self::Failed {
                class: error_class.unwrap_or("unknown"),
            },
        }
    }

    /// The sample's stratum and the page's outcome filter: `completed`, `partial`,
    /// `out of turns`, `discarded: FILTER` or `failed: CLASS`.
    pub fn stratum(self) -> String {
        let mut stratum = String::new();
        self.write_stratum(&mut stratum);
        stratum
    }

    /// [`Self::stratum`] into `out`, which is cleared first (a buffer reused for every record).
    fn write_stratum(self, out: &mut String) {
        out.clear();
        match self {
            Self::Trajectory {
                completed: true, ..
            } => out.push_str("completed"),
            Self::Trajectory { partial: true, .. } => out.push_str("partial"),
            Self::Trajectory { .. } => out.push_str("out of turns"),
            Self::Discarded { filter } => {
                out.push_str("discarded: ");
                out.push_str(filter);
            }
            Self::Failed { class } => {
                out.push_str("failed: ");
                out.push_str(class);
            }
        }
    }
}

/// The facts of one record the report counts.
#[derive(Debug, Clone, Copy)]
pub struct RecordFacts<'a> {
    pub prompt_index: u64,
    pub sample: u32,
    pub outcome: Outcome<'a>,
    /// Model requests (turns) of a trajectory.
    pub api_calls: u64,
    /// Prompt and completion tokens of a trajectory.
    pub tokens: u64,
    pub duration_ms: u64,
    /// Tool calls and failed tool calls of a trajectory.
    pub tool_calls: u64,
    pub tool_failures: u64,
}

/// Counts by value in buckets of a 1-2-5 sequence (0, 1, 2, 5, 10, 20, 50, …): readable bounds
/// whatever the scale, and mergeable without knowing the values in advance.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Histogram {
    /// Lower bound of each non-empty bucket → records in it.
    buckets: BTreeMap<u64, u64>,
}

impl Histogram {
    /// The lower bound of `value`'s bucket.
    pub fn bucket_of(value: u64) -> u64 {
        if value == 0 {
            return 0;
        }
        let mut decade = 1_u64;
        loop {
            for step in [1, 2, 5] {
                let next = match step {
                    1 => decade.saturating_mul(2),
                    2 => decade.saturating_mul(5),
                    _ => decade.saturating_mul(10),
                };
                if value < next || next == u64::MAX {
                    return decade.saturating_mul(step);
                }
            }
            decade = decade.saturating_mul(10);
        }
    }

    pub fn add(&mut self, value: u64) {
        *self.buckets.entry(Self::bucket_of(value)).or_default() += 1;
    }

    fn absorb(&mut self, other: Self) {
        for (bucket, count) in other.buckets {
            *self.buckets.entry(bucket).or_default() += count;
        }
    }

    /// Records counted.
    pub fn total(&self) -> u64 {
        self.buckets.values().sum()
    }
}

/// Conversations, tool calls and failed tool calls of one drawn toolset combination.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ComboCounts {
    pub conversations: u64,
    pub tool_calls: u64,
    pub tool_failures: u64,
}

/// One sampled record: its rank (a hash of its key: smaller is kept) and its line.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Sampled {
    rank: u64,
    line: Vec<u8>,
}

/// Everything gathered so far.
#[derive(Debug, Default)]
pub struct Collector {
    pub turns: Histogram,
    pub tokens: Histogram,
    pub duration_ms: Histogram,
    /// By toolset combination as drawn (`web+terminal`; `(none)` for none).
    pub combos: BTreeMap<String, ComboCounts>,
    /// Discarded records by filter.
    pub discarded: BTreeMap<String, u64>,
    /// Records of each stratum, and the kept sample of each (the [`PER_STRATUM`] smallest ranks,
    /// as a max-heap).
    strata: BTreeMap<String, (u64, BinaryHeap<Sampled>)>,
    /// A key built for each record (its combination, its stratum): allocated once, and copied
    /// into a map only the first time the map sees it.
    key: String,
}

impl Collector {
    /// Counts a record whose drawn toolsets are `toolsets`, its line `line` a candidate for the
    /// sample.
    pub fn add<'a>(
        &mut self,
        facts: &RecordFacts<'_>,
        toolsets: impl IntoIterator<Item = &'a str>,
        line: &[u8],
    ) {
        match facts.outcome {
            Outcome::Trajectory { .. } => {
                self.turns.add(facts.api_calls);
                self.tokens.add(facts.tokens);
                self.duration_ms.add(facts.duration_ms);
                let combo = &mut self.key;
                combo.clear();
                for toolset in toolsets {
                    if !combo.is_empty() {
                        combo.push('+');
                    }
                    combo.push_str(toolset);
                }
                if combo.is_empty() {
                    combo.push_str("(none)");
                }
                let counts = entry(&mut self.combos, combo);
                counts.conversations += 1;
                counts.tool_calls += facts.tool_calls;
                counts.tool_failures += facts.tool_failures;
            }
            Outcome::Discarded { filter } => {
                *self.discarded.entry(filter.to_owned()).or_default() += 1;
            }
            Outcome::Failed { .. } => {}
        }
        let rank = sample_rank(facts.prompt_index, facts.sample);
        facts.outcome.write_stratum(&mut self.key);
        let (seen, kept) = entry(&mut self.strata, &self.key);
        *seen += 1;
        if kept.len() < PER_STRATUM {
            kept.push(Sampled {
                rank,
                line: line.to_vec(),
            });
        } else if kept.peek().is_some_and(|largest| rank < largest.rank) {
            kept.pop();
            kept.push(Sampled {
                rank,
                line: line.to_vec(),
            });
        }
    }

    /// Adds what another collector gathered (of other records).
    pub fn absorb(&mut self, other: Self) {
        self.turns.absorb(other.turns);
        self.tokens.absorb(other.tokens);
        self.duration_ms.absorb(other.duration_ms);
        for (combo, counts) in other.combos {
            let entry = self.combos.entry(combo).or_default();
            entry.conversations += counts.conversations;
            entry.tool_calls += counts.tool_calls;
            entry.tool_failures += counts.tool_failures;
        }
        for (filter, count) in other.discarded {
            *self.discarded.entry(filter).or_default() += count;
        }
        for (stratum, (seen, kept)) in other.strata {
            let (all, mine) = self.strata.entry(stratum).or_default();
            *all += seen;
            for sampled in kept {
                mine.push(sampled);
                if mine.len() > PER_STRATUM {
                    mine.pop();
                }
            }
        }
    }

    /// Each stratum with the number of its records and its sampled lines, smallest rank first
    /// (so that any prefix is a uniform sample of the stratum).
    pub fn strata(self) -> Vec<(String, u64, Vec<Vec<u8>>)> {
        self.strata
            .into_iter()
            .map(|(stratum, (seen, kept))| {
                let lines = kept.into_sorted_vec().into_iter().map(|s| s.line).collect();
                (stratum, seen, lines)
            })
            .collect()
    }
}

/// The value of `key` in `map`, inserted (default) with a copy of `key` if it is not there.
fn entry<'m, V: Default>(map: &'m mut BTreeMap<String, V>, key: &str) -> &'m mut V {
    if !map.contains_key(key) {
        map.insert(key.to_owned(), V::default());
    }
    map.get_mut(key).expect("inserted above")
}

/// A record's rank in the sample: a fixed mix of its key (splitmix64), so the sample is the same
/// whatever order or thread sees the records, and uniform within a stratum.
fn sample_rank(prompt_index: u64, sample: u32) -> u64 {
    let mut x = prompt_index
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(u64::from(sample));
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_one_two_five() {
        let bounds: Vec<u64> = [0, 1, 2, 3, 4, 5, 9, 10, 19, 20, 49, 50, 99, 100, 999_999]
            .into_iter()
            .map(Histogram::bucket_of)
            .collect();
        assert_eq!(
            bounds,
            [0, 1, 2, 2, 2, 5, 5, 10, 10, 20, 20, 50, 50, 100, 500_000]
        );
        assert_eq!(Histogram::bucket_of(u64::MAX), 10_000_000_000_000_000_000);
    }

    fn trajectory(prompt_index: u64, turns: u64) -> RecordFacts<'static> {
        RecordFacts {
            prompt_index,
            sample: 0,
            outcome: Outcome::Trajectory {
                completed: true,
                partial: false,
            },
            api_calls: turns,
            tokens: 100 * turns,
            duration_ms: 1000,
            tool_calls: turns - 1,
            tool_failures: 1,
        }
    }

    #[test]
    fn the_sample_is_bounded_and_the_same_however_the_records_are_split() {
        let mut whole = Collector::default();
        let mut parts = [Collector::default(), Collector::default()];
        for index in 0..1_000_u64 {
            let facts = trajectory(index, 1 + index % 7);
            let line = format!("{{\"prompt_index\": {index}}}");
            whole.add(&facts, ["web", "terminal"], line.as_bytes());
            parts[usize::try_from(index % 2).unwrap()].add(
                &facts,
                ["web", "terminal"],
                line.as_bytes(),
            );
        }
        let [first, second] = parts;
        let mut merged = first;
        merged.absorb(second);
        assert_eq!(merged.turns, whole.turns);
        assert_eq!(merged.turns.total(), 1000);
        assert_eq!(
            merged.combos["web+terminal"],
            ComboCounts {
                conversations: 1000,
                tool_calls: (0..1000).map(|index| index % 7).sum(),
                tool_failures: 1000,
            }
        );
        let (merged, whole) = (merged.strata(), whole.strata());
        assert_eq!(merged, whole);
        let [(stratum, seen, lines)] = &merged[..] else {
            panic!("{merged:?}")
        };
        assert_eq!(
            (stratum.as_str(), *seen, lines.len()),
            ("completed", 1000, PER_STRATUM)
        );
    }

    #[test]
    fn each_outcome_is_a_stratum_and_only_trajectories_are_in_the_distributions() {
        let mut collector = Collector::default();
        collector.add(&trajectory(0, 2), [], b"t");
        let mut partial = trajectory(1, 9);
        partial.outcome = Outcome::Trajectory {
            completed: false,
            partial: true,
        };
        collector.add(&partial, ["web"], b"p");
        let mut discarded = trajectory(2, 1);
        discarded.outcome = Outcome::Discarded {
            filter: "no_reasoning",
        };
        collector.add(&discarded, ["web"], b"d");
        let mut failed = trajectory(3, 1);
        failed.outcome = Outcome::Failed { class: "timeout" };
        collector.add(&failed, ["web"], b"f");
        assert_eq!(collector.turns.total(), 2);
        assert_eq!(collector.discarded["no_reasoning"], 1);
        assert_eq!(collector.combos["(none)"].conversations, 1);
        let strata: Vec<(String, u64)> = collector
            .strata()
            .into_iter()
            .map(|(stratum, seen, _)| (stratum, seen))
            .collect();
        assert_eq!(
            strata,
            [
                ("completed".to_owned(), 1),
                ("discarded: no_reasoning".to_owned(), 1),
                ("failed: timeout".to_owned(), 1),
                ("partial".to_owned(), 1),
            ]
        );
    }
}
