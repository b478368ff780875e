//! The agent loop: one conversation from a prompt to a final answer.
//!
//! Call the model with the offered tools; run every tool call of a reply concurrently and append
//! the results in call order; repeat until a reply has no tool calls or `max_turns` calls were
//! made, and then make one last call without tools asking for a final answer (as the reference
//! does). A wall-clock budget bounds the whole conversation; dropping it cancels in-flight tools.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, join_all};
use serde_json::Value;
use tracing::{Instrument, info_span};

use crate::model::{
    AssistantMessage, CallTokens, Completion, Message, ModelClient, ModelError, ToolMessage, Usage,
};
use crate::pricing::Cost;
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
    /// How the conversation took up turns an earlier attempt had finished (`None`: it started
    /// from its prompt with nothing recorded).
    pub resume: Option<Resumed>,
    /// How many of its tool calls took their output from another run's (`spec.replay.from`).
    pub replayed: Option<Replayed>,
    /// Every model call in call order, with the tokens the server gave, when the run keeps them
    /// (`spec.model.tokens`); empty otherwise.
    pub steps: Vec<Step>,
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
}

impl Step {
    fn of(completion: &Completion, reply: Option<u32>) -> Self {
        Self {
            reply,
            tokens: completion.tokens.clone().unwrap_or_default(),
            finish_reason: completion.finish_reason.clone(),
            usage: completion.usage,
            endpoint: completion.endpoint.clone(),
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
            resume: None,
            replayed: None,
            steps: Vec::new(),
        }
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
    pub reply: &'a AssistantMessage,
    pub results: &'a [ToolMessage],
    pub usage: Usage,
    pub cost: Option<Cost>,
    pub model_time: Duration,
    /// The call's tokens, when the run keeps them.
    pub step: Option<&'a Step>,
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

async fn converse(
    client: &ModelClient,
    tools: &[Arc<dyn Tool>],
    ctx: &ToolContext,
    config: &AgentConfig,
    conversation: &mut Conversation,
    hooks: &mut Hooks<'_>,
) -> Result<(), ModelError> {
    let definitions = tool_definitions(tools);
    let system = config.ephemeral_system_prompt.as_deref();
    // Synthetic call ids are numbered by turn: a resumed conversation goes on numbering.
    let mut turn = conversation.api_calls as usize;
    while conversation.api_calls < config.max_turns {
        let body = client.request_body(system, &conversation.messages, Some(&definitions));
        let (reply, spent) = timed_call(client, &body, turn, conversation).await?;
        let number = conversation.api_calls;
        conversation.api_calls += 1;
        turn += 1;
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
            conversation.messages.push(Message::Assistant(message));
            conversation.completed = true;
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
        if let Some(sink) = hooks.sink {
            sink.commit(Turn {
                number,
                reply: &message,
                results: &results,
                usage,
                cost: spent.cost,
                model_time: spent.model_time,
                step: conversation.steps.last(),
            })
            .await;
        }
        conversation.messages.push(Message::Assistant(message));
        conversation
            .messages
            .extend(results.into_iter().map(Message::Tool));
    }
    conversation
        .messages
        .push(Message::User(FINAL_ANSWER_REQUEST.to_owned()));
    let body = client.request_body(system, &conversation.messages, None);
    let (reply, _) = timed_call(client, &body, turn, conversation).await?;
    conversation.record_step(client, &reply, true);
    // Without tools offered, a server may still emit calls; they cannot run, so they are dropped.
    let message = AssistantMessage {
        tool_calls: Vec::new(),
        ..reply.message
    };
    conversation.messages.push(Message::Assistant(message));
    Ok(())
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
    conversation.usage.add(reply.usage);
    let cost = client.cost_of(&reply);
    if let Some(cost) = cost {
        Cost::add_to(&mut conversation.cost, cost);
    }
    Ok((reply, CallSpent { cost, model_time }))
}
