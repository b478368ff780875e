//! The tools a spec declares itself, MCP servers (`spec.tools.mcp`) and HTTP tools
//! (`spec.tools.http`): names that clash with nothing, one transport, credentials never inline,
//! templates that name declared arguments.

use std::collections::BTreeSet;

use serde_json::Value;

use super::SpecViolation;
use crate::spec::{HttpToolSpec, McpServerSpec, NamedValue, ToolsSpec};
use crate::template::placeholders;
use crate::toolsets::{NOT_YET_SHIPPED, SHIPPED};

/// Every placeholder in the string values of a JSON body template.
fn body_placeholders<'a>(body: &'a Value, out: &mut Vec<&'a str>) {
    match body {
        Value::String(text) => out.extend(placeholders(text)),
        Value::Array(items) => items.iter().for_each(|item| body_placeholders(item, out)),
        Value::Object(map) => map.values().for_each(|item| body_placeholders(item, out)),
        _ => {}
    }
}

/// A toolset or tool name: letters, digits, `_` and `-`, 1 to 64 of them (what `OpenAI`
/// function names allow).
pub fn is_valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Names of headers and variables whose value is a credential, which must not be written inline.
fn looks_secret(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    name == "cookie"
        || ["auth", "key", "token", "secret", "password", "credential"]
            .iter()
            .any(|word| name.contains(word))
}

struct Check<'a> {
    violations: &'a mut Vec<SpecViolation>,
}

impl Check<'_> {
    fn that(&mut self, ok: bool, field: &str, message: impl Into<String>) {
        if !ok {
            self.violations.push(SpecViolation {
                field: field.to_owned(),
                message: message.into(),
            });
        }
    }

    fn named_values(&mut self, values: &[NamedValue], field: &str) {
        for (index, value) in values.iter().enumerate() {
            let field = format!("{field}[{index}]");
            self.that(!value.name.is_empty(), &field, "needs a name");
            match (&value.value, &value.value_from) {
                (Some(_), Some(_)) | (None, None) => {
                    self.that(false, &field, "set exactly one of `value` and `valueFrom`");
                }
                (Some(_), None) => self.that(
                    !looks_secret(&value.name),
                    &format!("{field}.value"),
                    format!(
                        "{:?} looks like a credential: give it with valueFrom (env or \
                         secretKeyRef), never inline",
                        value.name
                    ),
                ),
                (None, Some(source)) => {
                    self.that(
                        source.is_well_formed(),
                        &format!("{field}.valueFrom"),
                        "set exactly one of `env` (a variable name) and `secretKeyRef` \
                         (name and key)",
                    );
                }
            }
        }
    }

    fn mcp_server(&mut self, server: &McpServerSpec, field: &str) {
        match (&server.streamable_http, &server.stdio) {
            (Some(http), None) => {
                self.that(
                    http.url.starts_with("http://") || http.url.starts_with("https://"),
                    &format!("{field}.streamableHttp.url"),
                    format!("{:?} must be an http:// or https:// URL", http.url),
                );
                self.named_values(&http.headers, &format!("{field}.streamableHttp.headers"));
            }
            (None, Some(stdio)) => {
                self.that(
                    !stdio.command.is_empty(),
                    &format!("{field}.stdio.command"),
                    "must not be empty",
                );
                self.named_values(&stdio.env, &format!("{field}.stdio.env"));
            }
            _ => self.that(
                false,
                field,
                "set exactly one transport: `streamableHttp` or `stdio`",
            ),
        }
        self.that(
            server.timeout_seconds >= 1,
            &format!("{field}.timeoutSeconds"),
            "must be at least 1",
        );
        self.that(
            server.connect_timeout_seconds >= 1,
            &format!("{field}.connectTimeoutSeconds"),
            "must be at least 1",
        );
        self.that(
            server.max_result_bytes >= 1,
            &format!("{field}.maxResultBytes"),
            "must be at least 1",
        );
    }

    fn http_tool(&mut self, tool: &HttpToolSpec, field: &str) {
        self.that(
            is_valid_name(&tool.name) && !tool.name.starts_with("mcp__"),
            &format!("{field}.name"),
            format!(
                "{:?} must be 1-64 letters, digits, `_` or `-`, not starting with `mcp__`",
                tool.name
            ),
        );
        let properties = tool.parameters.get("properties");
        let schema_ok = tool.parameters.get("type") == Some(&Value::from("object"))
            && properties.is_none_or(Value::is_object);
        self.that(
            schema_ok,
            &format!("{field}.parameters"),
            "must be a JSON schema with \"type\": \"object\" (and `properties` an object)",
        );
        let declared = |name: &str| properties.and_then(|p| p.get(name)).is_some();

        let url = &tool.url;
        let rest = url
            .strip_prefix("http://")
            .or_else(|| url.strip_prefix("https://"));
        match rest {
            None => self.that(
                false,
                &format!("{field}.url"),
                format!("{url:?} must be an http:// or https:// URL"),
            ),
            Some(rest) => {
                let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
                self.that(
                    !authority.is_empty() && !authority.contains('{'),
                    &format!("{field}.url"),
                    format!(
                        "{url:?}: placeholders may appear in the path and query only, never in \
                         the host (a model's argument must not choose where the request goes)"
                    ),
                );
            }
        }
        let mut used: Vec<&str> = placeholders(url).collect();
        let url_placeholders = used.len();
        if let Some(body) = &tool.body {
            body_placeholders(body, &mut used);
        }
        for (index, name) in used.into_iter().enumerate() {
            let part = if index < url_placeholders {
                "url"
            } else {
                "body"
            };
            self.that(
                declared(name),
                &format!("{field}.{part}"),
                format!(
                    "refers to the argument {{{name}}}, which `parameters.properties` does not declare"
                ),
            );
        }
        self.named_values(&tool.headers, &format!("{field}.headers"));
        self.that(
            tool.timeout_seconds >= 1,
            &format!("{field}.timeoutSeconds"),
            "must be at least 1",
        );
        self.that(
            tool.max_response_bytes >= 1,
            &format!("{field}.maxResponseBytes"),
            "must be at least 1",
        );
    }
}

/// Every way the declared MCP servers and HTTP tools are wrong, each naming its field.
pub fn declared_tool_violations(tools: &ToolsSpec) -> Vec<SpecViolation> {
    let mut violations = Vec::new();
    let mut check = Check {
        violations: &mut violations,
    };
    let builtin: BTreeSet<&str> = SHIPPED
        .iter()
        .copied()
        .chain(NOT_YET_SHIPPED.iter().map(|(name, _)| *name))
        .collect();
    let mut toolsets = BTreeSet::new();
    let mut toolset_name = |check: &mut Check, name: &str, field: String| {
        check.that(
            is_valid_name(name),
            &field,
            format!("{name:?} must be 1-64 letters, digits, `_` or `-`"),
        );
        check.that(
            !builtin.contains(name),
            &field,
            format!("{name:?} is a built-in toolset; choose another name"),
        );
        check.that(
            toolsets.insert(name.to_owned()),
            &field,
            format!("toolset {name:?} is declared twice"),
        );
    };
    for (index, server) in tools.mcp.iter().enumerate() {
        let field = format!("spec.tools.mcp[{index}]");
        toolset_name(&mut check, &server.name, format!("{field}.name"));
        check.mcp_server(server, &field);
    }
    let mut tool_names = BTreeSet::new();
    for (index, group) in tools.http.iter().enumerate() {
        let field = format!("spec.tools.http[{index}]");
        toolset_name(&mut check, &group.toolset, format!("{field}.toolset"));
        check.that(
            !group.tools.is_empty(),
            &format!("{field}.tools"),
            "a toolset needs a tool",
        );
        for (tool_index, tool) in group.tools.iter().enumerate() {
            let field = format!("{field}.tools[{tool_index}]");
            check.that(
                tool_names.insert(tool.name.clone()),
                &format!("{field}.name"),
                format!("tool {:?} is declared twice", tool.name),
            );
            check.http_tool(tool, &field);
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(value: serde_json::Value) -> ToolsSpec {
        serde_json::from_value(value).unwrap()
    }

    fn messages(spec: &ToolsSpec) -> Vec<String> {
        declared_tool_violations(spec)
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn a_template_naming_an_undeclared_argument_is_refused() {
        let spec = tools(serde_json::json!({"http": [{"toolset": "team", "tools": [{
            "name": "lookup",
            "description": "d",
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
            "method": "POST",
            "url": "http://svc/items/{id}/{missing}",
            "body": {"id": "{id}", "note": "about {other}"},
        }]}]}));
        assert_eq!(
            messages(&spec),
            [
                "spec.tools.http[0].tools[0].url: refers to the argument {missing}, which \
                 `parameters.properties` does not declare",
                "spec.tools.http[0].tools[0].body: refers to the argument {other}, which \
                 `parameters.properties` does not declare",
            ]
        );
    }

    #[test]
    fn a_placeholder_in_the_host_an_inline_secret_and_a_clash_are_refused() {
        let spec = tools(serde_json::json!({
            "mcp": [{"name": "web", "stdio": {"command": "x"}},
                    {"name": "both", "stdio": {"command": "x"},
                     "streamableHttp": {"url": "http://a/mcp"}}],
            "http": [{"toolset": "team", "tools": [{
                "name": "t",
                "description": "d",
                "parameters": {"type": "object", "properties": {"host": {"type": "string"}}},
                "url": "http://{host}/x",
                "headers": [{"name": "Authorization", "value": "Bearer abc"},
                            {"name": "X-Trace", "valueFrom": {"env": "TRACE"}}],
            }]}, {"toolset": "team", "tools": []}],
        }));
        let fields: Vec<String> = declared_tool_violations(&spec)
            .into_iter()
            .map(|v| v.field)
            .collect();
        assert_eq!(
            fields,
            [
                "spec.tools.mcp[0].name",
                "spec.tools.mcp[1]",
                "spec.tools.http[0].tools[0].url",
                "spec.tools.http[0].tools[0].headers[0].value",
                "spec.tools.http[1].toolset",
                "spec.tools.http[1].tools",
            ]
        );
    }
}
