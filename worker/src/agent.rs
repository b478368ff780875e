//! The agent loop: one conversation from a prompt to a final answer.
//!
//! Call the model with the offered tools; run every tool call of a reply concurrently and append
//! the results in call order; repeat until a reply has no tool calls or `max_turns` calls were
//! made, and then make one last call without tools asking for a final answer (as the reference
//! does). A wall-clock budget bounds the whole conversation; dropping it cancels in-flight tools.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use serde_json::Value;
use tracing::{Instrument, debug, info_span};

use crate::model::{
    AssistantMessage, Message, ModelClient, ModelError, ToolCall, ToolMessage, Usage,
};
use crate::pricing::Cost;
use crate::tools::{Tool, ToolContext, ToolOutcome};

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
    let budget = config.prompt_timeout;
    let mut conversation = Conversation {
        messages: vec![Message::User(prompt.to_owned())],
        api_calls: 0,
        completed: false,
        partial: false,
        usage: Usage::default(),
        cost: None,
        model_time: Duration::ZERO,
    };
    // The conversation lives outside the timed future, so that one cut off keeps what it spent.
    let outcome = tokio::time::timeout(
        budget,
        converse(client, tools, ctx, config, &mut conversation),
    )
    .instrument(info_span!("conversation"))
    .await;
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
) -> Result<(), ModelError> {
    let definitions = tool_definitions(tools);
    let system = config.ephemeral_system_prompt.as_deref();
    let mut turn = 0;
    while conversation.api_calls < config.max_turns {
        let body = client.request_body(system, &conversation.messages, Some(&definitions));
        let reply = timed_call(client, &body, turn, conversation).await?;
        conversation.api_calls += 1;
        turn += 1;
        if reply.finish_reason.as_deref() == Some("length") {
            // A reply cut off by the token limit is not a usable turn (its tool-call arguments
            // are usually truncated too): stop here, as the reference does.
            conversation.partial = true;
            return Ok(());
        }
        let message = reply.message;
        if message.tool_calls.is_empty() {
            conversation.messages.push(Message::Assistant(message));
            conversation.completed = true;
            return Ok(());
        }
        let results = join_all(
            message
                .tool_calls
                .iter()
                .map(|call| execute(call, tools, ctx)),
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
    let reply = timed_call(client, &body, turn, conversation).await?;
    // Without tools offered, a server may still emit calls; they cannot run, so they are dropped.
    let message = AssistantMessage {
        tool_calls: Vec::new(),
        ..reply.message
    };
    conversation.messages.push(Message::Assistant(message));
    Ok(())
}

async fn timed_call(
    client: &ModelClient,
    body: &Value,
    turn: usize,
    conversation: &mut Conversation,
) -> Result<crate::model::Completion, ModelError> {
    let started = Instant::now();
    let reply = client.complete(body, turn).await?;
    conversation.model_time += started.elapsed();
    conversation.usage.add(reply.usage);
    if let Some(cost) = client.cost_of(&reply) {
        Cost::add_to(&mut conversation.cost, cost);
    }
    Ok(reply)
}

/// Runs one tool call; unknown tools and invalid arguments go back to the model as tool errors.
async fn execute(call: &ToolCall, tools: &[Arc<dyn Tool>], ctx: &ToolContext) -> ToolMessage {
    let outcome = match (
        tools.iter().find(|tool| tool.spec().name == call.name),
        &call.arguments,
    ) {
        (None, _) => {
            let available: Vec<_> = tools.iter().map(|tool| tool.spec().name.as_str()).collect();
            ToolOutcome::Err(format!(
                "unknown tool {:?}; available tools: {}",
                call.name,
                if available.is_empty() {
                    "none".to_owned()
                } else {
                    available.join(", ")
                }
            ))
        }
        (Some(_), Err(reason)) => {
            ToolOutcome::Err(format!("invalid arguments for {}: {reason}", call.name))
        }
        (Some(tool), Ok(arguments)) => {
            let started = Instant::now();
            let outcome = tool.call(arguments.clone(), ctx).await;
            debug!(tool = %call.name, elapsed_ms = started.elapsed().as_millis(), "tool call finished");
            outcome
        }
    };
    ToolMessage {
        tool_call_id: call.id.clone(),
        name: call.name.clone(),
        content: outcome.into_content(),
    }
}
