//! The simulated user (`spec.userSimulator`): another model, playing the user a row's
//! `user_scenario` describes (tau2-bench's `persona` and `instructions`), writes the next user
//! message once the agent has answered, until it says a stop marker or has written its turns.
//!
//! It sees the conversation as the user would: its own messages (the row's turns and those it
//! wrote) as the assistant's, and the agent's answers to the user as the user's; tool calls and
//! their results, and the loop's own requests, stay out of it.

use futures::future::BoxFuture;
use serde_json::Value;

use crate::agent::{Conversation, SimulatedTurn, UserOrigin, UserSays, UserSimulation};
use crate::model::{ApiKey, AssistantMessage, Message, ModelClient, ModelError, ModelSettings};
use crate::spec::UserSimulatorSpec;

/// The simulated user of a run.
#[derive(Debug)]
pub struct UserSimulator {
    client: ModelClient,
    max_turns: u32,
    stop_tokens: Vec<String>,
}

impl UserSimulator {
    /// The simulator `spec` describes; its key from `TRAJ_USER_SIMULATOR_API_KEY` (a pod's, from
    /// its `apiKeySecretRef`) or the variable its `apiKeyEnv` names.
    pub fn from_spec(spec: &UserSimulatorSpec) -> Result<Self, String> {
        let key = std::env::var(crate::contract::env::USER_SIMULATOR_API_KEY)
            .ok()
            .filter(|key| !key.trim().is_empty());
        let key = match (key, spec.model.api_key_env.as_deref()) {
            (Some(key), _) => Some(ApiKey::new(key)),
            (None, Some(name)) => match std::env::var(name) {
                Ok(key) if !key.trim().is_empty() => Some(ApiKey::new(key)),
                _ => {
                    return Err(format!(
                        "spec.userSimulator.model.apiKeyEnv names the environment variable \
                         {name}, which is not set"
                    ));
                }
            },
            (None, None) => None,
        };
        let settings = ModelSettings::from_spec(&spec.model, key)
            .map_err(|err| format!("spec.userSimulator.model: {err}"))?;
        Ok(Self {
            client: ModelClient::new(settings)
                .map_err(|err| format!("spec.userSimulator.model: {err}"))?,
            max_turns: spec.max_turns,
            stop_tokens: spec.stop_tokens.clone(),
        })
    }

    async fn ask(&self, conversation: &Conversation) -> Result<SimulatedTurn, ModelError> {
        let scenario = conversation
            .user_simulation
            .as_ref()
            .map_or(&Value::Null, |simulation| &simulation.scenario);
        let system = system_prompt(scenario, &self.stop_tokens[0]);
        let messages = as_the_user_sees_it(conversation);
        let body = self.client.request_body(Some(&system), &messages, None);
        let turn = conversation.segments.len();
        let reply = self.client.complete(&body, turn).await?;
        let cost = self.client.cost_of(&reply);
        let text = reply.message.content.trim().to_owned();
        let stops = text.is_empty()
            || self
                .stop_tokens
                .iter()
                .any(|token| text.contains(token.as_str()));
        Ok(SimulatedTurn {
            says: if stops {
                UserSays::Stop
            } else {
                UserSays::Message(text)
            },
            usage: reply.usage,
            cost,
        })
    }
}

impl UserSimulation for UserSimulator {
    fn max_turns(&self) -> u32 {
        self.max_turns
    }

    fn next_turn<'a>(
        &'a self,
        conversation: &'a Conversation,
    ) -> BoxFuture<'a, Result<SimulatedTurn, ModelError>> {
        Box::pin(self.ask(conversation))
    }
}

/// The simulator's instructions: play the scenario's user, one message at a time, and say
/// `stop` when done.
fn system_prompt(scenario: &Value, stop: &str) -> String {
    let part = |name: &str| match scenario.get(name) {
        Some(Value::String(text)) => Some(text.clone()),
        Some(Value::Null) | None => None,
        Some(other) => Some(serde_json::to_string_pretty(other).unwrap_or_default()),
    };
    let mut prompt = format!(
        "You are a user talking with an AI assistant that can use tools. Play the user described \
         below. Write only the user's next message, in the first person, one message at a time; \
         never act as the assistant and never call tools. When your goal is reached, or the \
         assistant cannot reach it, reply with {stop} alone."
    );
    if let Some(persona) = part("persona") {
        prompt.push_str("\n\nPersona:\n");
        prompt.push_str(&persona);
    }
    if let Some(instructions) = part("instructions") {
        prompt.push_str("\n\nInstructions:\n");
        prompt.push_str(&instructions);
    }
    prompt
}

/// The conversation from the user's side: the user's messages as the assistant's, the agent's
/// answers (text, without its tool calls) as the user's.
fn as_the_user_sees_it(conversation: &Conversation) -> Vec<Message> {
    conversation
        .messages
        .iter()
        .enumerate()
        .filter_map(|(index, message)| match message {
            Message::User(text) if conversation.user_origin(index) != UserOrigin::Harness => {
                Some(Message::Assistant(AssistantMessage {
                    content: text.clone(),
                    reasoning: None,
                    tool_calls: Vec::new(),
                }))
            }
            Message::Assistant(answer) if !answer.content.trim().is_empty() => {
                Some(Message::User(answer.content.clone()))
            }
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_sees_the_answers_and_its_own_words_not_the_tools() {
        let mut conversation = Conversation::new("book a table");
        conversation
            .messages
            .push(Message::Assistant(AssistantMessage {
                content: String::new(),
                reasoning: None,
                tool_calls: Vec::new(),
            }));
        conversation
            .messages
            .push(Message::Assistant(AssistantMessage {
                content: "For how many?".into(),
                reasoning: None,
                tool_calls: Vec::new(),
            }));
        let seen = as_the_user_sees_it(&conversation);
        assert_eq!(seen.len(), 2);
        assert!(matches!(&seen[0], Message::Assistant(own) if own.content == "book a table"));
        assert!(matches!(&seen[1], Message::User(text) if text == "For how many?"));
        let prompt = system_prompt(
            &serde_json::json!({"persona": "a busy chef", "instructions": {"task": "a table for 4"}}),
            "###STOP###",
        );
        assert!(prompt.contains("###STOP### alone"), "{prompt}");
        assert!(prompt.contains("Persona:\na busy chef"), "{prompt}");
        assert!(prompt.contains("\"task\": \"a table for 4\""), "{prompt}");
    }
}
