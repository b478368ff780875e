//! The `browser` toolset: the reference's `browser_*` tools (same names, descriptions,
//! argument schemas and result shapes), driving a headless Chromium over the `DevTools` protocol.
//!
//! - `pool.rs` starts the worker's one Chromium on the first browser call (in a pod, in the
//!   sandbox container through an executor session on a `DevTools` pipe, which `bridge.rs` turns
//!   into the WebSocket chromiumoxide connects to; locally as a child with an empty environment,
//!   its profile in a temporary directory) and restarts it if it dies;
//! - `session.rs` is one conversation's browser context and page, opened by the conversation's
//!   first `browser_navigate` and disposed on `browser_close` or when the conversation ends
//!   (its [`ConversationBrowser`] in the [`ToolContext`] is dropped);
//! - `snapshot.rs` renders the accessibility tree as text with `@eN` refs;
//! - `cdp.rs` sends protocol commands as JSON.
//!
//! Every failure (Chromium missing or dead, a page that hangs, a stale ref) is a tool error the
//! model sees. `browser_vision` (a screenshot of the page shown to a vision model) is offered
//! only when `spec.tools.vision` is set too: it asks that model, through the `vision` toolset's
//! [`Analyzer`]. Whether it is offered depends on the spec alone, so every record of a run has
//! the same catalog.
//!
//! To add a browser tool: a variant of `Action` with its name, description and schema in
//! [`tools`], its arguments read in `Action::parse`, and the work in `session.rs`.

mod bridge;
mod cdp;
mod pool;
mod session;
mod snapshot;
#[cfg(test)]
mod tests;

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::args::{non_empty_string_arg, optional_bool_arg, string_arg};
use super::endpoint::EndpointError;
use super::sandbox::Sandbox;
use super::vision::Analyzer;
use super::{ResumeRule, Tool, ToolContext, ToolFuture, ToolOutcome, ToolSpec};
use crate::spec::{BrowserSpec, ToolsSpec};
use pool::Pool;
use session::{Key, Session};

pub const TOOLSET: &str = "browser";

/// Longest text `browser_type` types (a model can produce megabytes of arguments).
const MAX_TYPED_CHARS: usize = 20_000;
/// Longest URL `browser_navigate` accepts.
const MAX_URL_CHARS: usize = 8_000;

/// Why a browser call failed; the message is what the model is shown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BrowserError {
    #[error("the browser could not be started: {0}")]
    Launch(String),
    #[error("the browser failed ({method}): {reason}")]
    Protocol {
        method: &'static str,
        reason: String,
    },
    #[error("navigation failed: {0}")]
    Navigation(String),
    #[error("{0}")]
    Element(String),
    #[error("the page's script failed: {0}")]
    Script(String),
    #[error("no page is open; call browser_navigate first")]
    NoPage,
    #[error("Failed to take screenshot: {0}")]
    Screenshot(String),
    #[error("Error during vision analysis: {0}")]
    Vision(String),
}

/// The settings of `spec.tools.browser`, resolved.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    chromium_path: PathBuf,
    launch_timeout: Duration,
    navigation_timeout: Duration,
    snapshot_max_chars: usize,
    allowed_schemes: Vec<String>,
}

impl From<&BrowserSpec> for Settings {
    fn from(spec: &BrowserSpec) -> Self {
        Self {
            chromium_path: PathBuf::from(&spec.chromium_path),
            launch_timeout: Duration::from_secs(spec.launch_timeout_seconds.max(1)),
            navigation_timeout: Duration::from_secs(spec.navigation_timeout_seconds.max(1)),
            snapshot_max_chars: usize::try_from(spec.snapshot_max_chars).unwrap_or(usize::MAX),
            allowed_schemes: spec.allowed_schemes.clone(),
        }
    }
}

/// One conversation's browser, in its [`ToolContext`]: empty until the first
/// `browser_navigate`, disposed when dropped with the context (so nothing of one conversation's
/// browsing — cookies, storage, history — reaches another's).
#[derive(Debug, Default)]
pub struct ConversationBrowser {
    session: tokio::sync::Mutex<Option<Session>>,
}

/// The toolset's tools, in the reference's order, with Chromium in `sandbox` when given (a
/// pod's sandbox container); `browser_vision` only with `tools.vision` (whose endpoint failing
/// to build, say for a key variable that is not set, makes the toolset unavailable rather than
/// the tool absent). Chromium is not started here (a run that is only planned never starts it)
/// but by the first call.
pub fn tools(
    config: &ToolsSpec,
    sandbox: Option<&Sandbox>,
) -> Result<Vec<Arc<dyn Tool>>, EndpointError> {
    let settings = config
        .browser
        .as_ref()
        .map_or_else(|| Settings::from(&BrowserSpec::default()), Settings::from);
    let vision = config
        .vision
        .as_ref()
        .map(Analyzer::new)
        .transpose()?
        .map(Arc::new);
    Ok(tools_on(
        &Arc::new(Pool::new(settings, sandbox.cloned())),
        vision.as_ref(),
    ))
}

/// The tools, on a given pool (tests look into it), with `browser_vision` when given a model.
fn tools_on(pool: &Arc<Pool>, vision: Option<&Arc<Analyzer>>) -> Vec<Arc<dyn Tool>> {
    Action::ALL
        .iter()
        .filter(|&&action| action != Action::Vision || vision.is_some())
        .map(|&action| {
            let (name, description) = action.described();
            Arc::new(BrowserTool {
                spec: ToolSpec {
                    name: name.to_owned(),
                    description: description.to_owned(),
                    parameters: action.parameters(),
                },
                action,
                pool: Arc::clone(pool),
                vision: vision.cloned(),
            }) as Arc<dyn Tool>
        })
        .collect()
}

/// What a browser tool does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Navigate,
    Snapshot,
    Click,
    Type,
    Scroll,
    Back,
    Press,
    Close,
    GetImages,
    Vision,
}

/// A call with its checked arguments.
#[derive(Debug)]
enum Call {
    /// Opens the conversation's session if it has none.
    Navigate(String),
    Close,
    /// Needs an open page.
    OnPage(PageCall),
}

#[derive(Debug)]
enum PageCall {
    Snapshot { full: bool },
    Click(String),
    Type { reference: String, text: String },
    Scroll { down: bool },
    Back,
    Press(Key),
    GetImages,
    Vision { question: String },
}

impl Action {
    /// Every tool, in the reference's order.
    const ALL: [Self; 10] = [
        Self::Navigate,
        Self::Snapshot,
        Self::Click,
        Self::Type,
        Self::Scroll,
        Self::Back,
        Self::Press,
        Self::Close,
        Self::GetImages,
        Self::Vision,
    ];

    /// The tool's name and description, the reference's words.
    fn described(self) -> (&'static str, &'static str) {
        match self {
            Self::Navigate => (
                "browser_navigate",
                "Navigate to a URL in the browser. Initializes the session and loads the page. Must be called before other browser tools. For simple information retrieval, prefer web_search or web_extract (faster, cheaper). Use browser tools when you need to interact with a page (click, fill forms, dynamic content).",
            ),
            Self::Snapshot => (
                "browser_snapshot",
                "Get a text-based snapshot of the current page's accessibility tree. Returns interactive elements with ref IDs (like @e1, @e2) for browser_click and browser_type. full=false (default): compact view with interactive elements. full=true: complete page content. Snapshots over 8000 chars are truncated or LLM-summarized. Requires browser_navigate first.",
            ),
            Self::Click => (
                "browser_click",
                "Click on an element identified by its ref ID from the snapshot (e.g., '@e5'). The ref IDs are shown in square brackets in the snapshot output. Requires browser_navigate and browser_snapshot to be called first.",
            ),
            Self::Type => (
                "browser_type",
                "Type text into an input field identified by its ref ID. Clears the field first, then types the new text. Requires browser_navigate and browser_snapshot to be called first.",
            ),
            Self::Scroll => (
                "browser_scroll",
                "Scroll the page in a direction. Use this to reveal more content that may be below or above the current viewport. Requires browser_navigate to be called first.",
            ),
            Self::Back => (
                "browser_back",
                "Navigate back to the previous page in browser history. Requires browser_navigate to be called first.",
            ),
            Self::Press => (
                "browser_press",
                "Press a keyboard key. Useful for submitting forms (Enter), navigating (Tab), or keyboard shortcuts. Requires browser_navigate to be called first.",
            ),
            Self::Close => (
                "browser_close",
                "Close the browser session and release resources. Call this when done with browser tasks to free up Browserbase session quota.",
            ),
            Self::GetImages => (
                "browser_get_images",
                "Get a list of all images on the current page with their URLs and alt text. Useful for finding images to analyze with the vision tool. Requires browser_navigate to be called first.",
            ),
            Self::Vision => (
                "browser_vision",
                "Take a screenshot of the current page and analyze it with vision AI. Use this when you need to visually understand what's on the page - especially useful for CAPTCHAs, visual verification challenges, complex layouts, or when the text snapshot doesn't capture important visual information. Requires browser_navigate to be called first.",
            ),
        }
    }

    /// JSON schema of the arguments, the reference's.
    fn parameters(self) -> Value {
        match self {
            Self::Navigate => json!({
                "type": "object",
                "properties": {
                    "url": {"type": "string", "description": "The URL to navigate to (e.g., 'https://example.com')"}
                },
                "required": ["url"],
            }),
            Self::Snapshot => json!({
                "type": "object",
                "properties": {
                    "full": {
                        "type": "boolean",
                        "description": "If true, returns complete page content. If false (default), returns compact view with interactive elements only.",
                        "default": false,
                    }
                },
                "required": [],
            }),
            Self::Click => json!({
                "type": "object",
                "properties": {
                    "ref": {"type": "string", "description": "The element reference from the snapshot (e.g., '@e5', '@e12')"}
                },
                "required": ["ref"],
            }),
            Self::Type => json!({
                "type": "object",
                "properties": {
                    "ref": {"type": "string", "description": "The element reference from the snapshot (e.g., '@e3')"},
                    "text": {"type": "string", "description": "The text to type into the field"},
                },
                "required": ["ref", "text"],
            }),
            Self::Scroll => json!({
                "type": "object",
                "properties": {
                    "direction": {"type": "string", "enum": ["up", "down"], "description": "Direction to scroll"}
                },
                "required": ["direction"],
            }),
            Self::Press => json!({
                "type": "object",
                "properties": {
                    "key": {"type": "string", "description": "Key to press (e.g., 'Enter', 'Tab', 'Escape', 'ArrowDown')"}
                },
                "required": ["key"],
            }),
            Self::Vision => json!({
                "type": "object",
                "properties": {
                    "question": {
                        "type": "string",
                        "description": "What you want to know about the page visually. Be specific about what you're looking for.",
                    }
                },
                "required": ["question"],
            }),
            Self::Back | Self::Close | Self::GetImages => {
                json!({"type": "object", "properties": {}, "required": []})
            }
        }
    }

    fn parse(self, args: &Map<String, Value>, settings: &Settings) -> Result<Call, String> {
        let on_page = match self {
            Self::Navigate => {
                return Ok(Call::Navigate(checked_url(
                    non_empty_string_arg(args, "url")?,
                    settings,
                )?));
            }
            Self::Close => return Ok(Call::Close),
            Self::Snapshot => PageCall::Snapshot {
                full: optional_bool_arg(args, "full")?.unwrap_or(false),
            },
            Self::Click => PageCall::Click(reference(args)?),
            Self::Type => {
                let text = string_arg(args, "text")?;
                if text.chars().count() > MAX_TYPED_CHARS {
                    return Err(format!(
                        "argument `text` is longer than {MAX_TYPED_CHARS} characters"
                    ));
                }
                PageCall::Type {
                    reference: reference(args)?,
                    text: text.to_owned(),
                }
            }
            Self::Scroll => match string_arg(args, "direction")?.trim() {
                "down" => PageCall::Scroll { down: true },
                "up" => PageCall::Scroll { down: false },
                other => return Err(format!("Invalid direction '{other}'. Use 'up' or 'down'.")),
            },
            Self::Back => PageCall::Back,
            Self::Press => PageCall::Press(Key::parse(non_empty_string_arg(args, "key")?)?),
            Self::GetImages => PageCall::GetImages,
            Self::Vision => PageCall::Vision {
                question: string_arg(args, "question")?.to_owned(),
            },
        };
        Ok(Call::OnPage(on_page))
    }
}

/// The `ref` argument, with the `@` the reference adds when it is missing.
fn reference(args: &Map<String, Value>) -> Result<String, String> {
    let reference = non_empty_string_arg(args, "ref")?.trim();
    Ok(if reference.starts_with('@') {
        reference.to_owned()
    } else {
        format!("@{reference}")
    })
}

/// Refuses a URL whose scheme is not allowed (`file:` and `chrome:` are not, by default, so
/// that the browser cannot read the worker's files or its own internals). A URL without a
/// scheme gets `https://`, as a browser's address bar would.
fn checked_url(url: &str, settings: &Settings) -> Result<String, String> {
    let url = url.trim();
    if url.chars().count() > MAX_URL_CHARS {
        return Err(format!("the URL is longer than {MAX_URL_CHARS} characters"));
    }
    let scheme = url
        .split_once(':')
        .map(|(scheme, _)| scheme)
        .filter(|scheme| {
            !scheme.is_empty()
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        });
    let (url, scheme) = match scheme {
        // `localhost:8080/x` has no scheme but looks like one; a host has a dot or digits after.
        Some(scheme) if !url[scheme.len() + 1..].starts_with(|c: char| c.is_ascii_digit()) => {
            (url.to_owned(), scheme.to_ascii_lowercase())
        }
        _ => (format!("https://{url}"), "https".to_owned()),
    };
    if !settings.allowed_schemes.contains(&scheme) {
        return Err(format!(
            "URLs with the scheme {scheme:?} are not allowed; allowed: {} (tools.browser.allowedSchemes)",
            settings.allowed_schemes.join(", ")
        ));
    }
    Ok(url)
}

/// One `browser_*` tool; all of them share the worker's [`Pool`].
struct BrowserTool {
    spec: ToolSpec,
    action: Action,
    pool: Arc<Pool>,
    /// The vision model `browser_vision` asks (set on that tool only).
    vision: Option<Arc<Analyzer>>,
}

impl fmt::Debug for BrowserTool {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("BrowserTool")
            .field("name", &self.spec.name)
            .finish_non_exhaustive()
    }
}

impl Tool for BrowserTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    /// A page's state (where it was scrolled, what was typed, what the site answered) cannot
    /// be brought back by calling again.
    fn on_resume(&self) -> ResumeRule {
        ResumeRule::StartOver
    }

    fn call<'a>(&'a self, args: Map<String, Value>, ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async move {
            let call = match self.action.parse(&args, self.pool.settings()) {
                Ok(call) => call,
                Err(message) => return ToolOutcome::Err(message),
            };
            match run(&self.pool, &ctx.browser, call, self.vision.as_deref()).await {
                Ok(value) => ToolOutcome::Ok(value),
                Err(err) => ToolOutcome::Err(err.to_string()),
            }
        })
    }
}

async fn run(
    pool: &Pool,
    browser: &ConversationBrowser,
    call: Call,
    vision: Option<&Analyzer>,
) -> Result<Value, BrowserError> {
    let settings = pool.settings();
    // One call at a time per conversation: the page has one focus and one history.
    let mut slot = browser.session.lock().await;
    let call = match call {
        Call::Close => {
            // Dropping the session disposes its context.
            slot.take();
            return Ok(json!({"success": true, "closed": true}));
        }
        Call::Navigate(url) => {
            // A session on a Chromium that died is replaced (its state went with the process).
            if slot.as_ref().is_none_or(|session| !session.is_alive()) {
                slot.take();
                *slot = Some(Session::open(pool.chromium().await?).await?);
            }
            let session = slot.as_mut().ok_or(BrowserError::NoPage)?;
            return session.navigate(&url, settings).await;
        }
        Call::OnPage(call) => call,
    };
    let session = slot.as_mut().ok_or(BrowserError::NoPage)?;
    match call {
        PageCall::Snapshot { full } => session.snapshot(full, settings.snapshot_max_chars).await,
        PageCall::Click(reference) => {
            session.click(&reference, settings).await?;
            Ok(json!({"success": true, "clicked": reference}))
        }
        PageCall::Type { reference, text } => {
            session.type_text(&reference, &text).await?;
            Ok(json!({"success": true, "typed": text, "element": reference}))
        }
        PageCall::Scroll { down } => {
            session.scroll(down).await?;
            Ok(json!({"success": true, "scrolled": if down { "down" } else { "up" }}))
        }
        PageCall::Back => session.back(settings).await,
        PageCall::Press(key) => {
            session.press(&key, settings).await?;
            Ok(json!({"success": true, "pressed": key.given}))
        }
        PageCall::GetImages => session.images().await,
        PageCall::Vision { question } => {
            let screenshot = session
                .screenshot()
                .await
                .map_err(|err| BrowserError::Screenshot(err.to_string()))?;
            // The page is free for the conversation's next call while the model looks.
            drop(slot);
            let analyzer = vision.ok_or_else(|| {
                BrowserError::Vision("no vision model is configured (tools.vision)".to_owned())
            })?;
            let analysis = analyzer
                .analyze(
                    &vision_prompt(&question),
                    format!("data:image/png;base64,{screenshot}"),
                )
                .await
                .map_err(BrowserError::Vision)?;
            Ok(json!({"success": true, "analysis": analysis}))
        }
    }
}

/// What `browser_vision` asks the model, in the reference's words.
fn vision_prompt(question: &str) -> String {
    format!(
        "You are analyzing a screenshot of a web browser.\n\n\
         User's question: {question}\n\n\
         Provide a detailed and helpful answer based on what you see in the screenshot. \
         If there are interactive elements, describe them. If there are verification challenges \
         or CAPTCHAs, describe what type they are and what action might be needed. \
         Focus on answering the user's specific question."
    )
}
