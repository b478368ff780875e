//! An episode's outcome as its record keeps it: the user turns it answered, where each begins
//! and ends among the record's `conversations`, and why it ended.

use serde::Serialize;

use crate::agent::Conversation;

/// A record's `episode`.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct EpisodeEntry {
    /// The user turns the row holds (its prompt included).
    pub turns: usize,
    /// The user turns answered (a final answer ended each).
    pub answered: usize,
    /// Why the episode ended: `all_turns_answered`, or `cut_off` (a reply ran into the
    /// server's token limit, and the turns after it were never sent).
    pub termination_reason: &'static str,
    pub segments: Vec<SegmentEntry>,
}

/// One user turn of an episode and what answered it.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct SegmentEntry {
    /// Which user turn of the row (0: the prompt).
    pub turn: u32,
    /// The index in `conversations` of its user turn, and the one after its last turn.
    pub start: usize,
    pub end: usize,
    /// The model gave its final answer within `max_turns` (otherwise it was asked for one).
    pub completed: bool,
}

impl EpisodeEntry {
    /// The episode of `conversation`, whose record has `turns` entries in `conversations`;
    /// `turn_of_message` finds the entry a conversation message begins.
    pub fn of(
        conversation: &Conversation,
        turn_of_message: impl Fn(usize) -> Option<usize>,
        turns: usize,
    ) -> Self {
        let starts: Vec<usize> = conversation
            .segments
            .iter()
            .map(|segment| turn_of_message(segment.first_message).unwrap_or(turns))
            .collect();
        let segments = conversation
            .segments
            .iter()
            .zip(&starts)
            .enumerate()
            .map(|(index, (segment, &start))| SegmentEntry {
                turn: segment.turn,
                start,
                end: starts.get(index + 1).copied().unwrap_or(turns),
                completed: segment.completed,
            })
            .collect();
        let answered = conversation
            .segments
            .iter()
            .filter(|segment| segment.ended)
            .count();
        let total = conversation.follow_ups.len() + 1;
        Self {
            turns: total,
            answered,
            termination_reason: if answered == total {
                "all_turns_answered"
            } else {
                "cut_off"
            },
            segments,
        }
    }
}
