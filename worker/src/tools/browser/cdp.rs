//! `DevTools`-protocol commands sent as plain JSON.
//!
//! chromiumoxide's generated types follow one protocol revision; a newer Chromium adds enum
//! values (roles, property names) that those types refuse to parse, and a refused parse would
//! fail the whole command. So the toolset sends its commands as `{method, params}` JSON through
//! chromiumoxide's connection (which keeps the WebSocket, the per-target sessions and the
//! events) and reads the answers as JSON, taking only the fields it uses.

use std::borrow::Cow;

use chromiumoxide::Page;
use chromiumoxide::types::{Command, Method, MethodId};
use serde::{Serialize, Serializer};
use serde_json::Value;

use super::BrowserError;

/// One command: the method name and its params object.
#[derive(Debug)]
pub(super) struct Raw {
    method: &'static str,
    params: Value,
}

impl Serialize for Raw {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.params.serialize(serializer)
    }
}

impl Method for Raw {
    fn identifier(&self) -> MethodId {
        Cow::Borrowed(self.method)
    }
}

impl Command for Raw {
    type Response = Value;
}

/// Sends `method` to the page's target and returns its result object.
pub(super) async fn page(
    page: &Page,
    method: &'static str,
    params: Value,
) -> Result<Value, BrowserError> {
    page.execute(Raw { method, params })
        .await
        .map(|response| response.result)
        .map_err(|err| BrowserError::Protocol {
            method,
            reason: err.to_string(),
        })
}

/// Evaluates `expression` in the page and returns its value (by value, so it must be
/// JSON-serialisable); an exception thrown by the page is an error.
pub(super) async fn evaluate(page_: &Page, expression: &str) -> Result<Value, BrowserError> {
    let result = page(
        page_,
        "Runtime.evaluate",
        serde_json::json!({"expression": expression, "returnByValue": true}),
    )
    .await?;
    script_value(result)
}

/// Calls `function` with `this` bound to the remote object `object_id`.
pub(super) async fn call_on(
    page_: &Page,
    object_id: &str,
    function: &str,
) -> Result<Value, BrowserError> {
    let result = page(
        page_,
        "Runtime.callFunctionOn",
        serde_json::json!({
            "objectId": object_id,
            "functionDeclaration": function,
            "returnByValue": true,
        }),
    )
    .await?;
    script_value(result)
}

fn script_value(mut result: Value) -> Result<Value, BrowserError> {
    if let Some(exception) = result.get("exceptionDetails") {
        let text = exception
            .pointer("/exception/description")
            .or_else(|| exception.get("text"))
            .and_then(Value::as_str)
            .unwrap_or("the page's script threw");
        return Err(BrowserError::Script(text.chars().take(300).collect()));
    }
    Ok(result
        .pointer_mut("/result/value")
        .map_or(Value::Null, Value::take))
}
