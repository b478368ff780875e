//! The `vision` toolset: `vision_analyze`, which shows an image to the multimodal model of
//! `spec.tools.vision` (an OpenAI-compatible chat endpoint) with the model's question and answers
//! with what that model says. `browser_vision` (the browser toolset) asks the same model about a
//! screenshot, through [`Analyzer`].
//!
//! Name, argument schema, description, the prompt sent and the result shape are hermes-agent's
//! (`tools/vision_tools.py`, the version the web and browser toolsets follow): the model sees
//! `{"success": true, "analysis": ...}` as two-space-indented JSON. Every failure (an image that
//! cannot be read, is too large or is not an image; the endpoint down, slow, answering an error or
//! garbage) is a tool error the model reads, and the conversation goes on.
//!
//! ```text
//! image_url ─▶ http(s): guard (scheme, address) ─▶ fetch (time, bytes, redirects) ─┐
//!           └▶ path: confined to the workspace ─▶ read (bytes) ───────────────────┴▶ signature
//!   ─▶ data:<mime>;base64 URL ─▶ POST <baseUrl>/chat/completions (text + image_url) ─▶ analysis
//! ```

pub(crate) mod image;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::args::string_arg;
use super::endpoint::{Endpoint, EndpointError};
use super::web::reference_json;
use super::{Tool, ToolContext, ToolFuture, ToolOutcome, ToolSpec};
use crate::spec::{ToolsSpec, VisionSpec};
use image::ImageSource;

pub const TOOLSET: &str = "vision";

/// The setting the endpoint comes from, as errors name it.
const FIELD: &str = "tools.vision";

/// Bytes of a chat answer read at most (`max_tokens` of text is a few kilobytes; this leaves room
/// for servers that echo a lot).
const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

/// The reference's words for an answer without text.
const NO_ANALYSIS: &str =
    "There was a problem with the request and the image could not be analyzed.";

/// The toolset's tools; unavailable (saying why) when `spec.tools.vision` is missing or its key
/// variable is not set.
pub fn tools(config: &ToolsSpec) -> Result<Vec<Arc<dyn Tool>>, EndpointError> {
    let spec = config
        .vision
        .as_ref()
        .ok_or(EndpointError::NotConfigured { field: FIELD })?;
    let source = ImageSource::new(spec).map_err(|source| EndpointError::Client {
        field: FIELD,
        source,
    })?;
    Ok(vec![Arc::new(VisionAnalyze {
        spec: ToolSpec {
            name: "vision_analyze".to_owned(),
            description: "Analyze images using AI vision. Provides a comprehensive description and answers a specific question about the image content.".to_owned(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "image_url": {"type": "string", "description": "Image URL (http/https) or local file path to analyze."},
                    "question": {
                        "type": "string",
                        "description": "Your specific question or request about the image to resolve. The AI will automatically provide a complete image description AND answer your specific question.",
                    },
                },
                "required": ["image_url", "question"],
            }),
        },
        analyzer: Arc::new(Analyzer::new(spec)?),
        source,
    })])
}

/// The multimodal model: one question about one image per request.
#[derive(Debug)]
pub(crate) struct Analyzer {
    endpoint: Endpoint,
    model: String,
    max_tokens: u32,
}

impl Analyzer {
    pub(crate) fn new(spec: &VisionSpec) -> Result<Self, EndpointError> {
        Ok(Self {
            endpoint: Endpoint::new(
                FIELD,
                &spec.base_url,
                "chat/completions",
                spec.api_key.as_ref(),
                Duration::from_secs(spec.timeout_seconds.max(1)),
                MAX_ANSWER_BYTES,
            )?,
            model: spec.model.clone(),
            max_tokens: spec.max_tokens,
        })
    }

    /// The model's answer to `prompt` about the image `data_url`, as the reference asks it: one
    /// user message of a text part and an `image_url` part, temperature 0.1. An empty answer is
    /// the reference's "could not be analyzed" text.
    pub(crate) async fn analyze(&self, prompt: &str, data_url: String) -> Result<String, String> {
        let body = json!({
            "model": self.model,
            "messages": [{
                "role": "user",
                "content": [
                    {"type": "text", "text": prompt},
                    {"type": "image_url", "image_url": {"url": data_url}},
                ],
            }],
            "temperature": 0.1,
            "max_tokens": self.max_tokens,
        });
        // Serialising a `Value` cannot fail: its keys are strings.
        let body = serde_json::to_vec(&body).expect("a JSON value serialises");
        let answer = self.endpoint.post_json(body).await?;
        let text = answer_text(&answer)?;
        Ok(if text.is_empty() {
            NO_ANALYSIS.to_owned()
        } else {
            text
        })
    }
}

/// The text of a chat completion: `choices[0].message.content`, a string or a list of text parts.
fn answer_text(answer: &Value) -> Result<String, String> {
    let content = answer
        .pointer("/choices/0/message/content")
        .ok_or_else(|| {
            let shown: String = answer.to_string().chars().take(200).collect();
            format!("the vision model's answer holds no choices[0].message.content: {shown}")
        })?;
    match content {
        Value::String(text) => Ok(text.trim().to_owned()),
        Value::Array(parts) => Ok(parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<String>()
            .trim()
            .to_owned()),
        Value::Null => Ok(String::new()),
        other => Err(format!(
            "the vision model's answer content is neither text nor parts: {other}"
        )),
    }
}

#[derive(Debug)]
struct VisionAnalyze {
    spec: ToolSpec,
    analyzer: Arc<Analyzer>,
    source: ImageSource,
}

impl VisionAnalyze {
    async fn analyze(&self, args: &Map<String, Value>, ctx: &ToolContext) -> Result<Value, String> {
        let image_url = string_arg(args, "image_url")?;
        let question = string_arg(args, "question")?;
        let image = self.source.load(image_url, ctx).await?;
        let data_url = image::data_url(image.kind, &image.bytes);
        drop(image);
        let prompt = format!(
            "Fully describe and explain everything about this image, then answer the following question:\n\n{question}"
        );
        let analysis = self.analyzer.analyze(&prompt, data_url).await?;
        Ok(json!({"success": true, "analysis": analysis}))
    }
}

impl Tool for VisionAnalyze {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn read_only(&self) -> bool {
        true
    }

    fn call<'a>(&'a self, args: Map<String, Value>, ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async move {
            match self.analyze(&args, ctx).await {
                Ok(value) => ToolOutcome::Ok(Value::String(reference_json(&value))),
                Err(message) => ToolOutcome::Err(format!("Error analyzing image: {message}")),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_text_is_read_from_a_string_or_parts_and_garbage_is_refused() {
        let answer = |content: Value| json!({"choices": [{"message": {"content": content}}]});
        assert_eq!(answer_text(&answer(json!(" a cat \n"))).unwrap(), "a cat");
        assert_eq!(
            answer_text(&answer(
                json!([{"type": "text", "text": "a "}, {"type": "text", "text": "dog"}])
            ))
            .unwrap(),
            "a dog"
        );
        assert_eq!(answer_text(&answer(Value::Null)).unwrap(), "");
        assert!(answer_text(&json!({"object": "list"})).is_err());
        assert!(answer_text(&answer(json!(42))).is_err());
    }
}
