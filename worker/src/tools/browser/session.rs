//! One conversation's browser: a browser context of its own (`Target.createBrowserContext`:
//! cookies, storage and cache apart from every other conversation's) with one page, and the
//! refs of its last snapshot. Disposing the context closes its page and forgets its state; that
//! happens on `browser_close` or when the conversation ends (the session is dropped).

use std::sync::Arc;
use std::time::Duration;

use chromiumoxide::Page;
use chromiumoxide::cdp::IntoEventKind;
use chromiumoxide::cdp::browser_protocol::page::{
    EventFrameStartedLoading, EventJavascriptDialogOpening, EventLoadEventFired,
    HandleJavaScriptDialogParams,
};
use chromiumoxide::cdp::browser_protocol::target::{
    CreateBrowserContextParams, CreateTargetParams,
};
use chromiumoxide::listeners::EventStream;
use futures::StreamExt;
use serde_json::{Value, json};

use super::pool::Chromium;
use super::snapshot::{self, Snapshot};
use super::{BrowserError, Settings, cdp};

/// How long after a click, a key press or a step back a page load may start and still count as
/// caused by it (loads start within milliseconds of the event that causes them).
const SETTLE: Duration = Duration::from_millis(250);

/// Pixels one `browser_scroll` moves.
const SCROLL_PIXELS: i64 = 500;

/// At most this many images are listed by `browser_get_images`.
const MAX_IMAGES: usize = 200;

#[derive(Debug)]
pub(super) struct Session {
    chromium: Arc<Chromium>,
    context_id: chromiumoxide::cdp::browser_protocol::browser::BrowserContextId,
    page: Page,
    refs: Vec<i64>,
    /// Answers the page's `alert`/`confirm`/`prompt`/`beforeunload` dialogs, which would
    /// otherwise stop its scripts (and every later call) until someone clicks.
    dialogs: tokio::task::JoinHandle<()>,
}

impl Session {
    pub(super) async fn open(chromium: Arc<Chromium>) -> Result<Self, BrowserError> {
        let context_id = chromium
            .browser
            .create_browser_context(CreateBrowserContextParams::default())
            .await
            .map_err(|err| BrowserError::Protocol {
                method: "Target.createBrowserContext",
                reason: err.to_string(),
            })?;
        let mut params = CreateTargetParams::new("about:blank");
        params.browser_context_id = Some(context_id.clone());
        let page = match chromium.browser.new_page(params).await {
            Ok(page) => page,
            Err(err) => {
                let _ = chromium.browser.dispose_browser_context(context_id).await;
                return Err(BrowserError::Protocol {
                    method: "Target.createTarget",
                    reason: err.to_string(),
                });
            }
        };
        let mut opened = match page.event_listener::<EventJavascriptDialogOpening>().await {
            Ok(opened) => opened,
            Err(err) => {
                let _ = chromium.browser.dispose_browser_context(context_id).await;
                return Err(BrowserError::Protocol {
                    method: "Page.javascriptDialogOpening",
                    reason: err.to_string(),
                });
            }
        };
        let answering = page.clone();
        let dialogs = tokio::spawn(async move {
            while opened.next().await.is_some() {
                let _ = answering
                    .execute(HandleJavaScriptDialogParams::new(true))
                    .await;
            }
        });
        Ok(Self {
            chromium,
            context_id,
            page,
            refs: Vec::new(),
            dialogs,
        })
    }

    /// Whether its Chromium still runs.
    pub(super) fn is_alive(&self) -> bool {
        self.chromium.is_alive()
    }

    /// Loads `url` and waits for its load event.
    ///
    /// The page is sent there by script (`location.href = ...`) rather than `Page.navigate`:
    /// chromiumoxide queues `Page.navigate` per frame until the previous one completes or its
    /// fixed 30 s deadline passes, so after a page that hangs every navigation would wait. As a
    /// page's own navigation it is also held to the web's rules (no `file:` from a web page).
    pub(super) async fn navigate(
        &mut self,
        url: &str,
        settings: &Settings,
    ) -> Result<Value, BrowserError> {
        self.refs.clear();
        let target =
            serde_json::to_string(url).map_err(|err| BrowserError::Navigation(err.to_string()))?;
        let watch = self.watch().await?;
        cdp::evaluate(&self.page, &format!("window.location.href = {target}")).await?;
        self.settle(watch, url, settings).await?;
        let location = self.location().await?;
        if location["url"]
            .as_str()
            .is_some_and(|at| at.starts_with("chrome-error:"))
        {
            // Chromium's error page shows the network error's name (`ERR_CONNECTION_REFUSED`).
            let code = cdp::evaluate(
                &self.page,
                "(document.querySelector('.error-code') || {}).textContent || ''",
            )
            .await
            .ok()
            .and_then(|code| code.as_str().map(str::trim).map(str::to_owned))
            .filter(|code| !code.is_empty())
            .unwrap_or_else(|| "the page could not be loaded".to_owned());
            return Err(BrowserError::Navigation(format!("{url}: net::{code}")));
        }
        Ok(location)
    }

    /// The snapshot of the current page; its refs replace the previous ones.
    pub(super) async fn snapshot(
        &mut self,
        full: bool,
        max_chars: usize,
    ) -> Result<Value, BrowserError> {
        let tree = cdp::page(&self.page, "Accessibility.getFullAXTree", json!({})).await?;
        let Snapshot { text, refs } =
            snapshot::render(&tree, full, max_chars).map_err(|reason| BrowserError::Protocol {
                method: "Accessibility.getFullAXTree",
                reason,
            })?;
        self.refs = refs;
        Ok(json!({"success": true, "snapshot": text, "element_count": self.refs.len()}))
    }

    /// A PNG screenshot of the page's viewport, base64-encoded as the protocol sends it.
    pub(super) async fn screenshot(&self) -> Result<String, BrowserError> {
        let shot = cdp::page(
            &self.page,
            "Page.captureScreenshot",
            json!({"format": "png"}),
        )
        .await?;
        match shot.get("data").and_then(Value::as_str) {
            Some(data) if !data.is_empty() => Ok(data.to_owned()),
            _ => Err(BrowserError::Protocol {
                method: "Page.captureScreenshot",
                reason: "the answer holds no image data".to_owned(),
            }),
        }
    }

    /// Clicks the middle of the element with real mouse events (so the page sees what a user's
    /// click does), or calls its `click()` if it has no box; waits for a load it causes.
    pub(super) async fn click(
        &mut self,
        reference: &str,
        settings: &Settings,
    ) -> Result<(), BrowserError> {
        let object = self.resolve(reference).await?;
        let position = cdp::call_on(
            &self.page,
            &object,
            "function() { this.scrollIntoView({block: 'center', inline: 'center'}); \
             const r = this.getBoundingClientRect(); \
             return [r.left + r.width / 2, r.top + r.height / 2, r.width * r.height]; }",
        )
        .await?;
        let loads = self.watch().await?;
        match position
            .as_array()
            .map(|xs| xs.iter().filter_map(Value::as_f64).collect::<Vec<_>>())
        {
            Some(xs) if xs.len() == 3 && xs[2] > 0.0 => {
                for kind in ["mouseMoved", "mousePressed", "mouseReleased"] {
                    cdp::page(
                        &self.page,
                        "Input.dispatchMouseEvent",
                        json!({"type": kind, "x": xs[0], "y": xs[1], "button": "left", "clickCount": 1}),
                    )
                    .await?;
                }
            }
            _ => {
                cdp::call_on(&self.page, &object, "function() { this.click(); }").await?;
            }
        }
        self.settle(loads, reference, settings).await
    }

    /// Replaces the field's text with `text`, as typing would (input events fire).
    pub(super) async fn type_text(
        &mut self,
        reference: &str,
        text: &str,
    ) -> Result<(), BrowserError> {
        let object = self.resolve(reference).await?;
        let focused = cdp::call_on(
            &self.page,
            &object,
            "function() { this.scrollIntoView({block: 'center'}); this.focus(); \
             if (document.activeElement !== this) return false; \
             if ('value' in this) { this.value = ''; } \
             else if (this.isContentEditable) { this.textContent = ''; } \
             this.dispatchEvent(new Event('input', {bubbles: true})); return true; }",
        )
        .await?;
        if focused != Value::Bool(true) {
            return Err(BrowserError::Element(format!(
                "{reference} cannot take text (it cannot be focused); use a textbox's ref from browser_snapshot"
            )));
        }
        cdp::page(&self.page, "Input.insertText", json!({"text": text})).await?;
        Ok(())
    }

    pub(super) async fn scroll(&mut self, down: bool) -> Result<(), BrowserError> {
        let pixels = if down { SCROLL_PIXELS } else { -SCROLL_PIXELS };
        cdp::evaluate(&self.page, &format!("window.scrollBy(0, {pixels})")).await?;
        Ok(())
    }

    /// Goes one entry back in the page's history and returns the URL it lands on.
    pub(super) async fn back(&mut self, settings: &Settings) -> Result<Value, BrowserError> {
        let history = cdp::page(&self.page, "Page.getNavigationHistory", json!({})).await?;
        let current = history
            .get("currentIndex")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let previous = current
            .checked_sub(1)
            .and_then(|index| history.pointer(&format!("/entries/{index}/id")))
            .and_then(Value::as_i64)
            .ok_or_else(|| {
                BrowserError::Navigation(
                    "there is no previous page in this tab's history".to_owned(),
                )
            })?;
        self.refs.clear();
        let loads = self.watch().await?;
        cdp::page(
            &self.page,
            "Page.navigateToHistoryEntry",
            json!({"entryId": previous}),
        )
        .await?;
        self.settle(loads, "the previous page", settings).await?;
        let location = self.location().await?;
        Ok(json!({"success": true, "url": location["url"]}))
    }

    /// Presses and releases `key` on the focused element; waits for a load it causes.
    pub(super) async fn press(
        &mut self,
        key: &Key,
        settings: &Settings,
    ) -> Result<(), BrowserError> {
        let loads = self.watch().await?;
        let mut down = json!({
            "type": if key.text.is_some() { "keyDown" } else { "rawKeyDown" },
            "key": key.dom_name, "code": key.code, "windowsVirtualKeyCode": key.windows_code,
        });
        if let Some(text) = &key.text {
            down["text"] = json!(text);
        }
        cdp::page(&self.page, "Input.dispatchKeyEvent", down).await?;
        cdp::page(
            &self.page,
            "Input.dispatchKeyEvent",
            json!({"type": "keyUp", "key": key.dom_name, "code": key.code, "windowsVirtualKeyCode": key.windows_code}),
        )
        .await?;
        self.settle(loads, &key.dom_name, settings).await
    }

    /// The page's images (not `data:` ones), as the reference lists them.
    pub(super) async fn images(&mut self) -> Result<Value, BrowserError> {
        let images = cdp::evaluate(
            &self.page,
            &format!(
                "[...document.images].map(img => ({{src: img.src, alt: img.alt || '', \
                 width: img.naturalWidth, height: img.naturalHeight}})) \
                 .filter(img => img.src && !img.src.startsWith('data:')).slice(0, {MAX_IMAGES})"
            ),
        )
        .await?;
        let count = images.as_array().map_or(0, Vec::len);
        Ok(json!({"success": true, "images": images, "count": count}))
    }

    /// The page's URL and title, as `browser_navigate` answers.
    async fn location(&self) -> Result<Value, BrowserError> {
        let location =
            cdp::evaluate(&self.page, "({url: location.href, title: document.title})").await?;
        Ok(json!({
            "success": true,
            "url": location.get("url").cloned().unwrap_or(Value::Null),
            "title": location.get("title").cloned().unwrap_or(json!("")),
        }))
    }

    /// The remote object of a ref from the last snapshot.
    async fn resolve(&self, reference: &str) -> Result<String, BrowserError> {
        let index = reference
            .trim()
            .trim_start_matches('@')
            .strip_prefix('e')
            .and_then(|number| number.parse::<usize>().ok())
            .filter(|number| *number >= 1)
            .ok_or_else(|| {
                BrowserError::Element(format!(
                    "{reference:?} is not a ref; refs look like @e5 (from browser_snapshot)"
                ))
            })?;
        let Some(backend) = self.refs.get(index - 1) else {
            return Err(BrowserError::Element(format!(
                "{reference} is not in the last snapshot ({} refs); call browser_snapshot first",
                self.refs.len()
            )));
        };
        let stale = || {
            BrowserError::Element(format!(
                "{reference} is no longer on the page; call browser_snapshot again"
            ))
        };
        let resolved = cdp::page(
            &self.page,
            "DOM.resolveNode",
            json!({"backendNodeId": backend}),
        )
        .await
        .map_err(|_| stale())?;
        resolved
            .pointer("/object/objectId")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(stale)
    }

    async fn listen<T: IntoEventKind + Unpin + std::fmt::Debug>(
        &self,
    ) -> Result<EventStream<T>, BrowserError> {
        self.page
            .event_listener::<T>()
            .await
            .map_err(|err| BrowserError::Protocol {
                method: "event listener",
                reason: err.to_string(),
            })
    }

    /// Listens for the start and the end of page loads; made before an action, so that a load
    /// it causes cannot be missed.
    async fn watch(&self) -> Result<Watch, BrowserError> {
        Ok(Watch {
            started: self.listen::<EventFrameStartedLoading>().await?,
            loaded: self.listen::<EventLoadEventFired>().await?,
        })
    }

    /// If a page load starts within [`SETTLE`], waits (within the navigation timeout) for it to
    /// finish; what was done is named in the timeout error.
    async fn settle(
        &mut self,
        watch: Watch,
        what: &str,
        settings: &Settings,
    ) -> Result<(), BrowserError> {
        let Watch {
            mut started,
            loaded,
        } = watch;
        if tokio::time::timeout(SETTLE, started.next()).await.is_err() {
            return Ok(());
        }
        self.refs.clear();
        if tokio::time::timeout(settings.navigation_timeout, wait_next(loaded))
            .await
            .is_err()
        {
            return Err(self.timed_out(what, settings).await);
        }
        Ok(())
    }

    /// Stops the load that took too long (so the next call finds a quiet page).
    async fn timed_out(&self, what: &str, settings: &Settings) -> BrowserError {
        let _ = cdp::page(&self.page, "Page.stopLoading", json!({})).await;
        BrowserError::Navigation(format!(
            "loading {what} timed out after {} s (tools.browser.navigationTimeoutSeconds)",
            settings.navigation_timeout.as_secs()
        ))
    }
}

/// Load events of the page, listened for before an action.
struct Watch {
    started: EventStream<EventFrameStartedLoading>,
    loaded: EventStream<EventLoadEventFired>,
}

async fn wait_next<T: IntoEventKind + Unpin>(mut events: EventStream<T>) {
    let _ = events.next().await;
}

impl Drop for Session {
    fn drop(&mut self) {
        self.dialogs.abort();
        // Disposing needs the connection's task, so it runs on the runtime; without one (the
        // runtime is going away) the whole browser goes with it.
        let chromium = Arc::clone(&self.chromium);
        let context_id = self.context_id.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(err) = chromium.browser.dispose_browser_context(context_id).await {
                    tracing::debug!(%err, "disposing a conversation's browser context failed");
                }
            });
        }
    }
}

/// A key `browser_press` can press.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Key {
    /// The name the model gave, for the result.
    pub(super) given: String,
    dom_name: String,
    code: String,
    windows_code: u32,
    text: Option<String>,
}

/// Named keys: (name, code, Windows virtual key code, text it types).
const NAMED_KEYS: &[(&str, &str, u32, Option<&str>)] = &[
    ("Enter", "Enter", 13, Some("\r")),
    ("Tab", "Tab", 9, None),
    ("Escape", "Escape", 27, None),
    ("Backspace", "Backspace", 8, None),
    ("Delete", "Delete", 46, None),
    ("ArrowUp", "ArrowUp", 38, None),
    ("ArrowDown", "ArrowDown", 40, None),
    ("ArrowLeft", "ArrowLeft", 37, None),
    ("ArrowRight", "ArrowRight", 39, None),
    ("Home", "Home", 36, None),
    ("End", "End", 35, None),
    ("PageUp", "PageUp", 33, None),
    ("PageDown", "PageDown", 34, None),
    ("Space", "Space", 32, Some(" ")),
];

impl Key {
    /// The key the model named (`Enter`, `Tab`, ... or one character), case-insensitively.
    pub(super) fn parse(name: &str) -> Result<Self, String> {
        let trimmed = name.trim();
        let named = match trimmed.to_ascii_lowercase().as_str() {
            "return" => Some(NAMED_KEYS[0]),
            "esc" => Some(NAMED_KEYS[2]),
            " " => Some(NAMED_KEYS[13]),
            lower => NAMED_KEYS
                .iter()
                .copied()
                .find(|(key, ..)| key.eq_ignore_ascii_case(lower)),
        };
        if let Some((key, code, windows_code, text)) = named {
            return Ok(Self {
                given: name.to_owned(),
                dom_name: if key == "Space" {
                    " ".to_owned()
                } else {
                    key.to_owned()
                },
                code: code.to_owned(),
                windows_code,
                text: text.map(str::to_owned),
            });
        }
        let mut chars = name.chars();
        if let (Some(character), None) = (chars.next(), chars.next())
            && !character.is_control()
        {
            let upper = character.to_ascii_uppercase();
            let code = if upper.is_ascii_alphabetic() {
                format!("Key{upper}")
            } else if character.is_ascii_digit() {
                format!("Digit{character}")
            } else {
                String::new()
            };
            return Ok(Self {
                given: name.to_owned(),
                dom_name: character.to_string(),
                code,
                windows_code: if upper.is_ascii_alphanumeric() {
                    u32::from(upper)
                } else {
                    0
                },
                text: Some(character.to_string()),
            });
        }
        let known: Vec<&str> = NAMED_KEYS.iter().map(|(key, ..)| *key).collect();
        Err(format!(
            "unknown key {name:?}; press one of {} or a single character",
            known.join(", ")
        ))
    }
}
