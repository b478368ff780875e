//! The agent loop: one conversation from a prompt to a final answer.
//!
//! Call the model with the offered tools; run every tool call of a reply concurrently and append
//! the results in call order; repeat until a reply has no tool calls or `max_turns` calls were
//! made, and then make one last call without tools asking for a final answer (as the reference
//! does). A wall-clock budget bounds the whole conversation; dropping it cancels in-flight tools.
//!
//! An **episode** answers several user turns of one row in order, in the same environment: once
//! a turn has its final answer, the next user message is appended and the loop goes on, each
//! turn a [`Segment`] with its own `max_turns`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, join_all};
use serde_json::Value;
use tracing::{Instrument, info_span};

use crate::model::{
    AssistantMessage, CallTokens, Completion, Message, ModelClient, ModelError, ToolMessage, Usage,
};
use crate::pricing::{Cost, PriceTier};
use crate::replay::Replay;
use crate::tools::{Tool, ToolContext, execute};

/// The user message that asks for a final answer once the turn budget is spent.
pub const FINAL_ANSWER_REQUEST: &str = "You have reached the maximum number of tool-calling turns. \
Please give your final answer now, based on what you have found, without calling any tools.";

/// Settings of the loop itself.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub max_turns: u32,
    pub prompt_timeout: Duration,
    /// Sent as the system message while generating; never saved into trajectories.
    pub ephemeral_system_prompt: Option<String>,
}

/// A finished conversation.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// The user prompt first, then every assistant, tool and (synthetic) user message.
    pub messages: Vec<Message>,
    /// Model calls of the loop (the final call without tools is not counted, as in the reference).
    pub api_calls: u32,
    /// The model gave a final answer within `max_turns`.
    pub completed: bool,
    /// The conversation stopped early (a reply cut off by the token limit).
    pub partial: bool,
    pub usage: Usage,
    /// What its model calls cost, summed over calls (`None`: no price and no reported cost).
    pub cost: Option<Cost>,
    /// Time spent waiting for the model, summed over calls.
    pub model_time: Duration,
    /// What each call answered in a provider batch waited for its answer, in milliseconds
    /// (batch mode's turnaround as the conversation saw it), in call order.
    pub batch_waits_ms: Vec<u64>,
    /// How the conversation took up turns an earlier attempt had finished (`None`: it started
    /// from its prompt with nothing recorded).
    pub resume: Option<Resumed>,
    /// How many of its tool calls took their output from another run's (`spec.replay.from`).
    pub replayed: Option<Replayed>,
    /// Every model call in call order, with the tokens the server gave, when the run keeps them
    /// (`spec.model.tokens`); empty otherwise.
    pub steps: Vec<Step>,
    /// The user turns of the row after the prompt, answered in order (an episode); empty for a
    /// row of one prompt.
    pub follow_ups: Vec<String>,
    /// The user turns answered or under way, in order: the first is the prompt's.
    pub segments: Vec<Segment>,
    /// The simulated user of a row with a `user_scenario`, when the run has one
    /// (`spec.userSimulator`): what it was told and what it wrote and cost.
    pub user_simulation: Option<UserSimulationState>,
}

/// A conversation's simulated user: its scenario, and what it said and cost so far.
#[derive(Debug, Clone, PartialEq)]
pub struct UserSimulationState {
    /// The row's `user_scenario` (a `persona` and `instructions`).
    pub scenario: Value,
    /// Messages it may write.
    pub max_turns: u32,
    /// Messages it wrote.
    pub turns: u32,
    /// What asking it cost, every call counted (its stop included).
    pub usage: Usage,
    pub cost: Option<Cost>,
    /// It said a stop marker: the conversation is over.
    pub stopped: bool,
}

impl UserSimulationState {
    pub fn new(scenario: Value, max_turns: u32) -> Self {
        Self {
            scenario,
            max_turns,
            turns: 0,
            usage: Usage::default(),
            cost: None,
            stopped: false,
        }
    }

    /// Whether it may be asked for another message.
    fn open(&self) -> bool {
        !self.stopped && self.turns < self.max_turns
    }

    fn spent(&mut self, usage: Usage, cost: Option<Cost>) {
        self.usage.add(usage);
        if let Some(cost) = cost {
            Cost::add_to(&mut self.cost, cost);
        }
    }
}

/// What a simulated user says next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UserSays {
    Message(String),
    /// A stop marker (or nothing): the conversation ends here.
    Stop,
}

/// A simulated user's answer, with what asking for it cost.
#[derive(Debug, Clone, PartialEq)]
pub struct SimulatedTurn {
    pub says: UserSays,
    pub usage: Usage,
    pub cost: Option<Cost>,
}

/// A simulated user (`spec.userSimulator`): writes the next user message of a conversation.
pub trait UserSimulation: Send + Sync {
    /// Messages it may write in one conversation.
    fn max_turns(&self) -> u32;
    fn next_turn<'a>(
        &'a self,
        conversation: &'a Conversation,
    ) -> BoxFuture<'a, Result<SimulatedTurn, ModelError>>;
}

/// One user turn of a conversation and what answered it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Segment {
    /// Which user turn of the row it is (0: the prompt).
    pub turn: u32,
    /// Where its user message is in the conversation's messages.
    pub first_message: usize,
    /// The conversation's `api_calls` before its first call: it has `max_turns` of its own.
    pub first_call: u32,
    /// A final answer ended it (given, or asked for once its `max_turns` were spent).
    pub ended: bool,
    /// The model gave its final answer within the segment's `max_turns`.
    pub completed: bool,
    /// A simulated user wrote its message (not the row), at this usage and cost.
    pub simulated: Option<(Usage, Option<Cost>)>,
}

impl Segment {
    fn new(turn: u32, first_message: usize, first_call: u32) -> Self {
        Self {
            turn,
            first_message,
            first_call,
            ended: false,
            completed: false,
            simulated: None,
        }
    }
}

/// Where a human turn came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UserOrigin {
    /// The row: its prompt or one of its later turns.
    Dataset,
    /// The loop itself: the request for a final answer once `max_turns` were spent.
    Harness,
    /// The simulated user (`spec.userSimulator`).
    Simulator,
}

/// One model call of a conversation, as a trainer reads it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Step {
    /// Which reply of the conversation the call gave (0-based, among its assistant messages);
    /// `None` for a reply cut off by the token limit, which the conversation does not keep.
    pub reply: Option<u32>,
    #[serde(flatten)]
    pub tokens: CallTokens,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
    pub usage: Usage,
    /// The base URL of the endpoint that answered the call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The service tier the call was billed at, when not the standard one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<PriceTier>,
}

impl Step {
    fn of(completion: &Completion, reply: Option<u32>) -> Self {
        Self {
            reply,
            tokens: completion.tokens.clone().unwrap_or_default(),
            finish_reason: completion.finish_reason.clone(),
            usage: completion.usage,
            endpoint: completion.endpoint.clone(),
            tier: completion.tier.filter(|tier| *tier != PriceTier::Standard),
        }
    }
}

/// What a conversation took from another run's recording (`spec.replay.from`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Tool calls whose output was the recording's.
    pub calls: u32,
    /// Of those, the ones run afterwards for what they leave in the environment (before the
    /// first call of the conversation's own).
    pub ran_for_state: u32,
}

impl Conversation {
    /// A conversation that has only its prompt.
    pub fn new(prompt: &str) -> Self {
        Self {
            messages: vec![Message::User(prompt.to_owned())],
            api_calls: 0,
            completed: false,
            partial: false,
            usage: Usage::default(),
            cost: None,
            model_time: Duration::ZERO,
            batch_waits_ms: Vec::new(),
            resume: None,
            replayed: None,
            steps: Vec::new(),
            follow_ups: Vec::new(),
            segments: vec![Segment::new(0, 0, 0)],
            user_simulation: None,
        }
    }

    /// A conversation that has only its prompt, with the row's later user turns to answer after
    /// it in order.
    pub fn episode(prompt: &str, follow_ups: Vec<String>) -> Self {
        Self {
            follow_ups,
            ..Self::new(prompt)
        }
    }

    /// Whether the row has several user turns.
    pub fn is_episode(&self) -> bool {
        !self.follow_ups.is_empty() || self.user_simulation.is_some()
    }

    /// Where the user message at `index` of `messages` came from.
    pub fn user_origin(&self, index: usize) -> UserOrigin {
        match self
            .segments
            .iter()
            .find(|segment| segment.first_message == index)
        {
            Some(segment) if segment.simulated.is_some() => UserOrigin::Simulator,
            Some(_) => UserOrigin::Dataset,
            None => UserOrigin::Harness,
        }
    }

    /// Appends what the simulated user wrote as a new segment (its usage and cost counted
    /// apart from the agent's).
    pub fn begin_simulated_segment(&mut self, text: String, usage: Usage, cost: Option<Cost>) {
        let turn = self.segments.last().map_or(0, |last| last.turn + 1);
        let mut segment = Segment::new(turn, self.messages.len(), self.api_calls);
        segment.simulated = Some((usage, cost));
        self.segments.push(segment);
        self.messages.push(Message::User(text));
        if let Some(simulation) = &mut self.user_simulation {
            simulation.turns += 1;
            simulation.spent(usage, cost);
        }
    }

    /// What the simulated user answered: a message begins the next segment, a stop ends the
    /// conversation.
    fn take_simulated(&mut self, turn: SimulatedTurn) {
        match turn.says {
            UserSays::Message(text) => self.begin_simulated_segment(text, turn.usage, turn.cost),
            UserSays::Stop => {
                if let Some(simulation) = &mut self.user_simulation {
                    simulation.stopped = true;
                    simulation.spent(turn.usage, turn.cost);
                }
            }
        }
    }

    /// Whether the simulated user may write the next message once the segment under way ended.
    fn simulation_open(&self) -> bool {
        self.next_follow_up().is_none()
            && self
                .user_simulation
                .as_ref()
                .is_some_and(UserSimulationState::open)
    }

    /// The segment under way (every conversation has one from its start).
    fn segment(&mut self) -> &mut Segment {
        self.segments
            .last_mut()
            .expect("a conversation has a segment from its start")
    }

    /// The row's next user turn, when the last segment ended and one is left.
    fn next_follow_up(&self) -> Option<&str> {
        let last = self.segments.last()?;
        if !last.ended {
            return None;
        }
        self.follow_ups.get(last.turn as usize).map(String::as_str)
    }

    /// Appends the row's next user turn as a new segment (see [`Conversation::next_follow_up`]).
    pub fn begin_next_segment(&mut self) {
        let Some(text) = self.next_follow_up().map(str::to_owned) else {
            return;
        };
        let turn = self.segments.last().map_or(0, |last| last.turn + 1);
        self.segments
            .push(Segment::new(turn, self.messages.len(), self.api_calls));
        self.messages.push(Message::User(text));
    }

    /// Ends the segment under way with the reply just appended; `completed`: within its
    /// `max_turns`.
    pub fn end_segment(&mut self, completed: bool) {
        let segment = self.segment();
        segment.ended = true;
        segment.completed = completed;
        self.completed = self.segments.iter().all(|segment| segment.completed)
            && self.next_follow_up().is_none();
    }

    /// The model calls the segment under way made so far.
    fn segment_calls(&self) -> u32 {
        let first = self.segments.last().map_or(0, |segment| segment.first_call);
        self.api_calls - first
    }

    /// Whether a user turn of the row is still to be answered after the segment under way.
    fn more_to_come(&self) -> bool {
        let turn = self.segments.last().map_or(0, |segment| segment.turn);
        (turn as usize) < self.follow_ups.len()
            || self
                .user_simulation
                .as_ref()
                .is_some_and(UserSimulationState::open)
    }

    /// The simulated user's message that began the segment under way, with its usage and cost,
    /// while its first turn is being committed (the turn log keeps it for a successor).
    fn simulated_opening(&self, number: u32) -> Option<SimulatedOpening<'_>> {
        let segment = self.segments.last()?;
        let (usage, cost) = segment.simulated?;
        let Message::User(text) = self.messages.get(segment.first_message)? else {
            return None;
        };
        (segment.first_call == number).then_some(SimulatedOpening { text, usage, cost })
    }

    /// The assistant messages it holds.
    fn replies(&self) -> u32 {
        let replies = self
            .messages
            .iter()
            .filter(|message| matches!(message, Message::Assistant(_)))
            .count();
        u32::try_from(replies).unwrap_or(u32::MAX)
    }

    /// Keeps the call's step, when the run keeps tokens: `kept` says whether its reply becomes
    /// the conversation's next assistant message.
    fn record_step(&mut self, client: &ModelClient, completion: &Completion, kept: bool) {
        if client.settings().tokens.is_some() {
            let reply = kept.then(|| self.replies());
            self.steps.push(Step::of(completion, reply));
        }
    }
}

/// How a conversation went on from the turns an earlier attempt left in the turn log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resumed {
    /// Turns taken from the log, asked of the model again by no one (0: it started over).
    pub from_turn: u32,
    /// Tool calls run again to bring the environment back to where the log left it.
    pub replayed_calls: u32,
    /// Calls run again whose output differed from the recorded one, kept by their tool's rule.
    pub divergences: Vec<Divergence>,
    /// Why the recorded turns could not be taken up, so the conversation started over.
    pub restarted: Option<String>,
    /// Wall-clock time the earlier attempts took until their last turn: it counts towards the
    /// conversation's budget.
    pub earlier_time: Duration,
}

/// A replayed call whose output differed from the one the model saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    /// The turn (0-based) whose call it was.
    pub turn: u32,
    pub tool: String,
    pub call_id: String,
}

/// One finished turn: a model reply with tool calls and their results, and what the call cost.
#[derive(Debug, Clone, Copy)]
pub struct Turn<'a> {
    /// Its place in the conversation, 0-based (the number of model calls before it).
    pub number: u32,
    /// The user turn of the row it answers (0: the prompt).
    pub segment: u32,
    /// Its reply answers the loop's request for a final answer (a segment that spent its
    /// `max_turns`); its results are empty.
    pub asked_final: bool,
    /// The simulated user's message its segment began with, when it is that segment's first.
    pub simulated_user: Option<SimulatedOpening<'a>>,
    pub reply: &'a AssistantMessage,
    pub results: &'a [ToolMessage],
    pub usage: Usage,
    pub cost: Option<Cost>,
    pub model_time: Duration,
    /// The call's tokens, when the run keeps them.
    pub step: Option<&'a Step>,
}

/// A simulated user's message that began a segment, and what asking for it cost.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct SimulatedOpening<'a> {
    pub text: &'a str,
    pub usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<Cost>,
}

/// What a conversation's loop reports to, and takes from, outside it.
#[derive(Default)]
#[allow(
    missing_debug_implementations,
    reason = "the sink is a trait object with nothing to show"
)]
pub struct Hooks<'a> {
    /// Where each finished turn goes before the next model call.
    pub sink: Option<&'a dyn TurnSink>,
    /// Another run's tool outputs, taken while the calls are its own.
    pub replay: Option<Replay>,
    /// The simulated user, for a conversation with a `user_simulation`.
    pub simulator: Option<&'a dyn UserSimulation>,
}

/// Where a conversation's finished turns go before its next model call (the run's turn log):
/// the call waits until the turn is kept, so a kill loses at most the turn in flight.
pub trait TurnSink: Send + Sync {
    fn commit<'a>(&'a self, turn: Turn<'a>) -> BoxFuture<'a, ()>;
}

/// What a conversation that ended early had spent on the model until then.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Spent {
    pub usage: Usage,
    pub cost: Option<Cost>,
}

/// Why a conversation produced no trajectory, with what it had spent.
#[derive(Debug, thiserror::Error)]
pub enum ConversationError {
    #[error("{0}")]
    Model(ModelError, Spent),
    #[error("conversation exceeded its budget of {0:?}")]
    Timeout(Duration, Spent),
}

impl ConversationError {
    /// The error class recorded with the failed prompt.
    pub fn class(&self) -> &'static str {
        match self {
            Self::Model(error, _) => error.class().as_str(),
            Self::Timeout(..) => "prompt_timeout",
        }
    }

    /// What the conversation had spent on the model when it ended: its failed record says so,
    /// and a budget counts it.
    pub fn spent(&self) -> &Spent {
        match self {
            Self::Model(_, spent) | Self::Timeout(_, spent) => spent,
        }
    }

    pub fn is_permanent(&self) -> bool {
        matches!(self, Self::Model(error, _) if error.is_permanent())
    }

    /// Retries ran out on failures a later retry may get past (the server down, overloaded or
    /// answering garbage). Recording that as the prompt's failure would let an outage burn
    /// through the whole dataset, so the batch stops instead and the prompt is retried when the
    /// batch is.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Model(error, _) if error.is_transient())
    }

    /// The model or its path does not exist on the server: no prompt can succeed.
    pub fn is_model_missing(&self) -> bool {
        matches!(self, Self::Model(error, _) if error.is_model_missing())
    }

    /// The conversation's wall-clock budget ran out.
    pub fn is_budget_exhausted(&self) -> bool {
        matches!(self, Self::Timeout(..))
    }
}

/// Tool definitions in the chat-completions `tools` shape.
pub fn tool_definitions(tools: &[Arc<dyn Tool>]) -> Vec<Value> {
    tools
        .iter()
        .map(|tool| {
            let spec = tool.spec();
            serde_json::json!({
                "type": "function",
                "function": {
                    "name": spec.name,
                    "description": spec.description,
                    "parameters": spec.parameters,
                },
            })
        })
        .collect()
}

/// Runs one conversation within the configured wall-clock budget.
pub async fn run_conversation(
    client: &ModelClient,
    tools: &[Arc<dyn Tool>],
    ctx: &ToolContext,
    prompt: &str,
    config: &AgentConfig,
) -> Result<Conversation, ConversationError> {
    let start = Conversation::new(prompt);
    continue_conversation(client, tools, ctx, start, config, Hooks::default()).await
}

/// Runs a conversation on from where `conversation` stands (its prompt only, or the turns an
/// earlier attempt finished), within what is left of the wall-clock budget; each turn it
/// finishes is committed to the hooks' sink before the next model call.
pub async fn continue_conversation(
    client: &ModelClient,
    tools: &[Arc<dyn Tool>],
    ctx: &ToolContext,
    mut conversation: Conversation,
    config: &AgentConfig,
    mut hooks: Hooks<'_>,
) -> Result<Conversation, ConversationError> {
    let budget = config.prompt_timeout;
    let earlier = conversation
        .resume
        .as_ref()
        .map_or(Duration::ZERO, |resume| resume.earlier_time);
    // The conversation lives outside the timed future, so that one cut off keeps what it spent.
    let outcome = tokio::time::timeout(
        budget.saturating_sub(earlier),
        converse(client, tools, ctx, config, &mut conversation, &mut hooks),
    )
    .instrument(info_span!("conversation"))
    .await;
    conversation.replayed = hooks.replay.map(|replay| Replayed {
        calls: replay.replayed,
        ran_for_state: replay.ran_for_state,
    });
    let spent = Spent {
        usage: conversation.usage,
        cost: conversation.cost,
    };
    match outcome {
        Ok(Ok(())) => Ok(conversation),
        Ok(Err(error)) => Err(ConversationError::Model(error, spent)),
        Err(_) => Err(ConversationError::Timeout(budget, spent)),
    }
}

/// What every turn of a conversation's loop uses.
struct Loop<'a> {
    client: &'a ModelClient,
    tools: &'a [Arc<dyn Tool>],
    ctx: &'a ToolContext,
    config: &'a AgentConfig,
    definitions: Vec<Value>,
}

async fn converse(
    client: &ModelClient,
    tools: &[Arc<dyn Tool>],
    ctx: &ToolContext,
    config: &AgentConfig,
    conversation: &mut Conversation,
    hooks: &mut Hooks<'_>,
) -> Result<(), ModelError> {
    let parts = Loop {
        client,
        tools,
        ctx,
        config,
        definitions: tool_definitions(tools),
    };
    loop {
        // A conversation taken up after a segment's final answer goes on with the next turn.
        conversation.begin_next_segment();
        if conversation
            .segments
            .last()
            .is_some_and(|segment| segment.ended)
        {
            let Some(simulator) = hooks.simulator.filter(|_| conversation.simulation_open()) else {
                return Ok(());
            };
            let turn = simulator.next_turn(conversation).await?;
            conversation.take_simulated(turn);
            if conversation
                .user_simulation
                .as_ref()
                .is_some_and(|simulation| simulation.stopped)
            {
                return Ok(());
            }
        }
        answer_segment(&parts, conversation, hooks).await?;
        if conversation.partial {
            return Ok(());
        }
    }
}

/// Answers the user turn of the segment under way: tool turns until a reply without calls, or
/// `max_turns` calls and then one asking for the final answer.
async fn answer_segment(
    parts: &Loop<'_>,
    conversation: &mut Conversation,
    hooks: &mut Hooks<'_>,
) -> Result<(), ModelError> {
    let Loop {
        client,
        tools,
        ctx,
        config,
        definitions,
    } = parts;
    let system = config.ephemeral_system_prompt.as_deref();
    while conversation.segment_calls() < config.max_turns {
        let body =
            client.request_body(system, &conversation.messages, Some(definitions.as_slice()));
        // Synthetic call ids are numbered by turn: a resumed conversation goes on numbering.
        let number = conversation.api_calls;
        let (reply, spent) = timed_call(client, &body, number as usize, conversation).await?;
        conversation.api_calls += 1;
        let cut_off = reply.finish_reason.as_deref() == Some("length");
        conversation.record_step(client, &reply, !cut_off);
        if cut_off {
            // A reply cut off by the token limit is not a usable turn (its tool-call arguments
            // are usually truncated too): stop here, as the reference does.
            conversation.partial = true;
            return Ok(());
        }
        let (usage, message) = (reply.usage, reply.message);
        if message.tool_calls.is_empty() {
            if conversation.more_to_come() {
                // The episode goes on: a kill from here on takes it up after this answer.
                commit(
                    hooks,
                    conversation,
                    (number, &message, &[]),
                    (usage, &spent),
                    false,
                )
                .await;
            }
            conversation.messages.push(Message::Assistant(message));
            conversation.end_segment(true);
            return Ok(());
        }
        let results = match hooks.replay.as_mut() {
            Some(recorded) => recorded.run_turn(&message.tool_calls, tools, ctx).await,
            None => {
                join_all(
                    message
                        .tool_calls
                        .iter()
                        .map(|call| execute(call, tools, ctx)),
                )
                .await
            }
        };
        commit(
            hooks,
            conversation,
            (number, &message, &results),
            (usage, &spent),
            false,
        )
        .await;
        conversation.messages.push(Message::Assistant(message));
        conversation
            .messages
            .extend(results.into_iter().map(Message::Tool));
    }
    conversation
        .messages
        .push(Message::User(FINAL_ANSWER_REQUEST.to_owned()));
    let body = client.request_body(system, &conversation.messages, None);
    let number = conversation.api_calls;
    let (reply, spent) = timed_call(client, &body, number as usize, conversation).await?;
    conversation.record_step(client, &reply, true);
    // Without tools offered, a server may still emit calls; they cannot run, so they are dropped.
    let message = AssistantMessage {
        tool_calls: Vec::new(),
        ..reply.message
    };
    if conversation.more_to_come() {
        // Only the episode's last final-answer call goes uncounted, as in the reference.
        conversation.api_calls += 1;
        commit(
            hooks,
            conversation,
            (number, &message, &[]),
            (reply.usage, &spent),
            true,
        )
        .await;
    }
    conversation.messages.push(Message::Assistant(message));
    conversation.end_segment(false);
    Ok(())
}

/// Commits a finished turn (`number`, its reply and its tool results) to the hooks' sink, if
/// there is one; `asked_final`: the reply answers the request for a final answer.
async fn commit(
    hooks: &Hooks<'_>,
    conversation: &Conversation,
    (number, reply, results): (u32, &AssistantMessage, &[ToolMessage]),
    (usage, spent): (Usage, &CallSpent),
    asked_final: bool,
) {
    let Some(sink) = hooks.sink else {
        return;
    };
    sink.commit(Turn {
        number,
        segment: conversation
            .segments
            .last()
            .map_or(0, |segment| segment.turn),
        asked_final,
        simulated_user: conversation.simulated_opening(number),
        reply,
        results,
        usage,
        cost: spent.cost,
        model_time: spent.model_time,
        step: conversation.steps.last(),
    })
    .await;
}

/// What one model call took: its cost (when priced or reported) and the time waited for it.
struct CallSpent {
    cost: Option<Cost>,
    model_time: Duration,
}

async fn timed_call(
    client: &ModelClient,
    body: &Value,
    turn: usize,
    conversation: &mut Conversation,
) -> Result<(crate::model::Completion, CallSpent), ModelError> {
    let started = Instant::now();
    let reply = client.complete(body, turn).await?;
    let model_time = started.elapsed();
    conversation.model_time += model_time;
    if reply.tier == Some(crate::pricing::PriceTier::Batch) {
        conversation
            .batch_waits_ms
            .push(u64::try_from(model_time.as_millis()).unwrap_or(u64::MAX));
    }
    conversation.usage.add(reply.usage);
    let cost = client.cost_of(&reply);
    if let Some(cost) = cost {
        Cost::add_to(&mut conversation.cost, cost);
    }
    Ok((reply, CallSpent { cost, model_time }))
}
