//! Taking a conversation up from its turn log: the turns an earlier attempt finished become the
//! conversation's start (no model call repeats them), and its environment is brought back by
//! replaying the recorded tool calls in the fresh workspace (or task container), each by its
//! tool's [`ResumeRule`].
//!
//! Replay rather than a snapshot of the workspace: a snapshot would have to be taken at every
//! turn of every conversation (a copy of a repository per turn, on the run's storage) to save
//! work only when a kill comes, and it misses what lives outside the workspace (a task
//! container's installed packages, the shell's variables, a background server). Replaying costs
//! nothing until a resume, runs the calls where they ran (the same sandbox, the same image), and
//! rebuilds all of it; its price is the time the calls take again and, for calls whose output
//! depends on time or chance, a difference the rule of their tool decides on.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;

use super::turns::Chain;
use crate::agent::{Conversation, Divergence, FINAL_ANSWER_REQUEST, Resumed};
use crate::model::{Message, ToolMessage, types::parse_assistant};
use crate::pricing::Cost;
use crate::tools::{ResumeRule, Tool, ToolContext, execute};

/// What taking up a chain came to.
pub(super) enum TakenUp {
    /// The conversation goes on from its last recorded turn, its environment replayed.
    Resumed(Box<Conversation>),
    /// The recorded turns cannot be used: the conversation starts over from its prompt, in an
    /// environment of its own (the replay may have changed this one), for this reason.
    StartOver(String),
}

/// Rebuilds the conversation of `chain` on `start` (the row's prompt, its later user turns and
/// its simulated user, nothing answered) and replays its tool calls in `ctx`.
pub(super) async fn take_up(
    chain: &Chain,
    start: Conversation,
    tools: &[Arc<dyn Tool>],
    ctx: &ToolContext,
) -> TakenUp {
    let mut conversation = start;
    let mut resumed = Resumed {
        from_turn: u32::try_from(chain.entries.len()).unwrap_or(u32::MAX),
        earlier_time: Duration::from_millis(
            chain.entries.last().map_or(0, |entry| entry.elapsed_ms),
        ),
        ..Resumed::default()
    };
    let replies: Vec<_> = chain
        .entries
        .iter()
        .map(|entry| parse_assistant(&entry.reply, entry.turn as usize))
        .collect();
    // Decided before anything runs: a conversation that must start over leaves no trace here.
    if let Some(reason) = segments_out_of_order(chain, conversation.follow_ups.len()) {
        return TakenUp::StartOver(reason);
    }
    for (entry, reply) in chain.entries.iter().zip(&replies) {
        if let Some(call) = reply
            .tool_calls
            .iter()
            .find(|call| rule_of(tools, &call.name) == Some(ResumeRule::StartOver))
        {
            return TakenUp::StartOver(format!(
                "turn {} called {}, whose state a replay cannot bring back",
                entry.turn, call.name
            ));
        }
    }
    for (entry, reply) in chain.entries.iter().zip(replies) {
        let recorded: Vec<ToolMessage> = entry.results.clone();
        let replayed = join_all(reply.tool_calls.iter().map(|call| async move {
            let rule = rule_of(tools, &call.name)?;
            // A call whose arguments did not parse ran nothing.
            if rule == ResumeRule::Recorded || call.arguments.is_err() {
                return None;
            }
            Some((rule, call, execute(call, tools, ctx).await))
        }))
        .await;
        for (rule, call, result) in replayed.into_iter().flatten() {
            resumed.replayed_calls += 1;
            let same = recorded
                .iter()
                .find(|recorded| recorded.tool_call_id == call.id)
                .is_some_and(|recorded| recorded.content == result.content);
            if same {
                continue;
            }
            if rule == ResumeRule::RerunExact {
                return TakenUp::StartOver(format!(
                    "turn {}'s {} call answered otherwise when replayed",
                    entry.turn, call.name
                ));
            }
            resumed.divergences.push(Divergence {
                turn: entry.turn,
                tool: call.name.clone(),
                call_id: call.id.clone(),
            });
        }
        if entry.segment
            > conversation
                .segments
                .last()
                .map_or(0, |segment| segment.turn)
        {
            match &entry.simulated_user {
                Some(user) => {
                    conversation.begin_simulated_segment(user.text.clone(), user.usage, user.cost);
                }
                None => conversation.begin_next_segment(),
            }
        }
        if entry.asked_final {
            conversation
                .messages
                .push(Message::User(FINAL_ANSWER_REQUEST.to_owned()));
        }
        let ends_segment = reply.tool_calls.is_empty();
        conversation.messages.push(Message::Assistant(reply));
        conversation
            .messages
            .extend(recorded.into_iter().map(Message::Tool));
        if ends_segment {
            conversation.end_segment(!entry.asked_final);
        }
        conversation.api_calls += 1;
        conversation.usage.add(entry.usage);
        if let Some(cost) = entry.cost {
            // A priced turn's tiers say whether a batch answered it.
            if cost.tiers.batch.calls > 0 {
                conversation.batch_waits_ms.push(entry.model_ms);
            }
            Cost::add_to(&mut conversation.cost, cost);
        }
        conversation.model_time += Duration::from_millis(entry.model_ms);
        conversation.steps.extend(entry.step.clone());
    }
    conversation.resume = Some(resumed);
    TakenUp::Resumed(Box::new(conversation))
}

/// Why the chain's segments cannot be the row's turns in order (each entry in its segment or the
/// next, that one only after a reply without calls ended the last), if they cannot: a log of
/// another version of the row, or a bug; the conversation starts over rather than misplace a turn.
fn segments_out_of_order(chain: &Chain, follow_ups: usize) -> Option<String> {
    let mut current = 0;
    let mut ended = false;
    for entry in &chain.entries {
        let next = entry.segment == current + 1 && ended;
        let known = entry.segment as usize <= follow_ups || entry.simulated_user.is_some();
        if entry.segment != current && !(next && known) {
            return Some(format!(
                "turn {} answers user turn {} of a row with {} after user turn {current}",
                entry.turn,
                entry.segment,
                follow_ups + 1
            ));
        }
        current = entry.segment;
        ended = entry.results.is_empty();
    }
    None
}

/// The rule of the tool named `name`, if the conversation was offered one.
fn rule_of(tools: &[Arc<dyn Tool>], name: &str) -> Option<ResumeRule> {
    tools
        .iter()
        .find(|tool| tool.spec().name == name)
        .map(|tool| tool.on_resume())
}
