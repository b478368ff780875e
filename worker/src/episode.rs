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
    /// Why the episode ended: `all_turns_answered`; `user_stop` (the simulated user said a
    /// stop marker); `max_user_turns` (it wrote all the messages it may); `cut_off` (a reply
    /// ran into the server's token limit, and the turns after it were never sent).
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
        let total = (conversation.follow_ups.len() + 1).max(conversation.segments.len());
        let simulation = conversation.user_simulation.as_ref();
        let termination_reason = if answered < total || conversation.partial {
            "cut_off"
        } else if simulation.is_some_and(|simulation| simulation.stopped) {
            "user_stop"
        } else if simulation.is_some_and(|simulation| simulation.turns >= simulation.max_turns) {
            "max_user_turns"
        } else {
            "all_turns_answered"
        };
        Self {
            turns: total,
            answered,
            termination_reason,
            segments,
        }
    }
}

/// A record's `user_simulator`: what the simulated user wrote and cost, apart from the agent's
/// `usage` and `cost`.
#[derive(Debug, Serialize)]
pub struct SimulatorEntry<U: Serialize, C: Serialize> {
    /// Messages it wrote (its stop not counted).
    pub turns: u32,
    /// It ended the conversation with a stop marker.
    pub stopped: bool,
    /// Its calls' tokens and cost, every call counted (its stop included).
    pub usage: U,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<C>,
}
