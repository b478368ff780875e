//! The page's accessibility tree (`Accessibility.getFullAXTree`) as the text the model reads.
//!
//! One line per node, indented by depth, in the form agent-browser (the reference's backend)
//! prints: `- role "name" [ref=e3] [level=1]`, text as `- text: ...`. Nodes the model can act on
//! (links, buttons, inputs, ...) and headings get a ref; the ref's number indexes the list of
//! their DOM backend node ids kept with the session, which `browser_click` and `browser_type`
//! act on. The compact view (the default) leaves out unnamed layout containers (their children
//! move up) and text that only repeats its parent's name; the full view keeps every node that
//! is not ignored. Rendering stops at the character cap, so a huge page costs no more than the
//! cap, and only refs that were shown exist.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde::Deserialize;
use serde_json::Value;

/// The marker the reference appends to a cut snapshot.
pub(super) const TRUNCATED: &str = "\n\n[... content truncated ...]";

/// Roles that get a ref because the model can click or type into them.
const INTERACTIVE: &[&str] = &[
    "button",
    "checkbox",
    "combobox",
    "link",
    "listbox",
    "menuitem",
    "menuitemcheckbox",
    "menuitemradio",
    "option",
    "radio",
    "searchbox",
    "slider",
    "spinbutton",
    "switch",
    "tab",
    "textbox",
    "treeitem",
];

/// Unnamed nodes of these roles are only layout; the compact view shows their children instead.
const LAYOUT: &[&str] = &[
    "generic",
    "none",
    "presentation",
    "LineBreak",
    "group",
    "LabelText",
];

/// Properties worth showing, as `[name]` (true booleans) or `[name=value]`.
const SHOWN_PROPERTIES: &[&str] = &[
    "level", "checked", "pressed", "selected", "expanded", "disabled", "required", "readonly",
];

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AxNode {
    node_id: String,
    #[serde(default)]
    ignored: bool,
    #[serde(default)]
    role: Option<AxValue>,
    #[serde(default)]
    name: Option<AxValue>,
    #[serde(default)]
    value: Option<AxValue>,
    #[serde(default)]
    properties: Vec<AxProperty>,
    #[serde(default)]
    child_ids: Vec<String>,
    #[serde(default)]
    parent_id: Option<String>,
    #[serde(default, rename = "backendDOMNodeId")]
    backend_dom_node_id: Option<i64>,
}

#[derive(Debug, Deserialize)]
struct AxValue {
    #[serde(default)]
    value: Value,
}

#[derive(Debug, Deserialize)]
struct AxProperty {
    name: String,
    value: AxValue,
}

/// A rendered snapshot: the text and the backend node id of each ref (`@e1` is index 0).
#[derive(Debug, Default, PartialEq)]
pub(super) struct Snapshot {
    pub(super) text: String,
    pub(super) refs: Vec<i64>,
}

/// Renders the result of `Accessibility.getFullAXTree` (`{"nodes": [...]}`), at most
/// `max_chars` characters plus the truncation marker.
pub(super) fn render(tree: &Value, full: bool, max_chars: usize) -> Result<Snapshot, String> {
    let nodes: Vec<AxNode> = tree
        .get("nodes")
        .cloned()
        .map(serde_json::from_value)
        .transpose()
        .map_err(|err| format!("unexpected accessibility tree: {err}"))?
        .unwrap_or_default();
    let by_id: HashMap<&str, &AxNode> = nodes.iter().map(|n| (n.node_id.as_str(), n)).collect();
    let mut renderer = Renderer {
        by_id,
        full,
        max_chars,
        chars: 0,
        truncated: false,
        snapshot: Snapshot::default(),
    };
    if let Some(root) = nodes
        .iter()
        .find(|node| node.parent_id.is_none())
        .or(nodes.first())
    {
        renderer.walk(root, 0, "", 0);
    }
    let mut snapshot = renderer.snapshot;
    if renderer.truncated {
        snapshot.text.push_str(TRUNCATED);
    }
    Ok(snapshot)
}

struct Renderer<'a> {
    by_id: HashMap<&'a str, &'a AxNode>,
    full: bool,
    max_chars: usize,
    chars: usize,
    truncated: bool,
    snapshot: Snapshot,
}

/// Deeper trees than this are not walked further (a hostile page can nest without end).
const MAX_DEPTH: usize = 200;

impl<'a> Renderer<'a> {
    fn walk(&mut self, node: &'a AxNode, depth: usize, parent_name: &str, nesting: usize) {
        if self.truncated || nesting > MAX_DEPTH {
            return;
        }
        let role = text_of(node.role.as_ref());
        let name = collapse(&text_of(node.name.as_ref()));
        let hoisted = node.ignored
            || role == "InlineTextBox"
            || (!self.full && name.is_empty() && LAYOUT.contains(&role.as_str()));
        if role == "InlineTextBox" {
            return;
        }
        if hoisted {
            self.children(node, depth, parent_name, nesting);
            return;
        }
        if role == "StaticText" {
            if !name.is_empty() && (self.full || name != parent_name) {
                self.line(depth, &format!("- text: {name}"));
            }
            return;
        }
        let mut line = format!(
            "- {}",
            if role == "RootWebArea" {
                "document"
            } else {
                &role
            }
        );
        if !name.is_empty() {
            let _ = write!(line, " {}", quoted(&name));
        }
        let refable = INTERACTIVE.contains(&role.as_str()) || role == "heading";
        let backend = node.backend_dom_node_id.filter(|_| refable);
        if backend.is_some() {
            let _ = write!(line, " [ref=e{}]", self.snapshot.refs.len() + 1);
        }
        for property in &node.properties {
            if !SHOWN_PROPERTIES.contains(&property.name.as_str()) {
                continue;
            }
            match &property.value.value {
                Value::Bool(true) => {
                    let _ = write!(line, " [{}]", property.name);
                }
                Value::Bool(false) | Value::Null => {}
                Value::String(text) if text == "false" => {}
                other => {
                    let _ = write!(line, " [{}={}]", property.name, text_of_value(other));
                }
            }
        }
        let value = collapse(&text_of(node.value.as_ref()));
        if !value.is_empty() {
            let _ = write!(line, ": {value}");
        }
        // A ref exists only if its line was shown whole.
        if self.line(depth, &line)
            && let Some(backend) = backend
        {
            self.snapshot.refs.push(backend);
        }
        self.children(node, depth + 1, &name, nesting);
    }

    fn children(&mut self, node: &'a AxNode, depth: usize, parent_name: &str, nesting: usize) {
        for child in &node.child_ids {
            if let Some(child) = self.by_id.get(child.as_str()).copied() {
                self.walk(child, depth, parent_name, nesting + 1);
            }
        }
    }

    /// Appends the line, or as much of it as the cap leaves (then nothing more is rendered);
    /// true if it was appended whole.
    fn line(&mut self, depth: usize, line: &str) -> bool {
        let indent = "  ".repeat(depth.min(40));
        let length = indent.len() + line.chars().count() + 1;
        if self.chars + length > self.max_chars {
            let room = self.max_chars.saturating_sub(self.chars);
            let cut: String = format!("{indent}{line}").chars().take(room).collect();
            self.snapshot.text.push_str(&cut);
            self.truncated = true;
            return false;
        }
        self.chars += length;
        self.snapshot.text.push_str(&indent);
        self.snapshot.text.push_str(line);
        self.snapshot.text.push('\n');
        true
    }
}

fn text_of(value: Option<&AxValue>) -> String {
    value
        .map(|value| text_of_value(&value.value))
        .unwrap_or_default()
}

fn text_of_value(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Whitespace runs as one space, at most 500 characters: one text node cannot fill the snapshot.
fn collapse(text: &str) -> String {
    let mut out = String::new();
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
        if out.len() > 2000 {
            break;
        }
    }
    if out.chars().count() > 500 {
        out = out.chars().take(500).collect::<String>() + "…";
    }
    out
}

fn quoted(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn node(id: &str, role: &str, name: &str, children: &[&str], backend: i64) -> Value {
        json!({
            "nodeId": id, "ignored": false,
            "role": {"type": "role", "value": role},
            "name": {"type": "computedString", "value": name},
            "childIds": children, "backendDOMNodeId": backend,
        })
    }

    fn tree() -> Value {
        let mut heading = node("3", "heading", "Welcome", &["4"], 13);
        heading["properties"] =
            json!([{"name": "level", "value": {"type": "integer", "value": 1}}]);
        let mut root = node("1", "RootWebArea", "Home", &["2"], 11);
        root.as_object_mut().unwrap().remove("parentId");
        json!({"nodes": [
            root,
            node("2", "generic", "", &["3", "5", "7", "9"], 12),
            heading,
            node("4", "StaticText", "Welcome", &[], 14),
            node("5", "link", "Docs", &["6"], 15),
            node("6", "StaticText", "Docs", &[], 16),
            node("7", "paragraph", "", &["8"], 17),
            node("8", "StaticText", "Some   text\n here", &[], 18),
            {"nodeId": "9", "ignored": true, "childIds": ["10"]},
            node("10", "textbox", "Search", &[], 20),
        ]})
    }

    #[test]
    fn the_compact_view_hoists_layout_and_numbers_the_refs() {
        let snapshot = render(&tree(), false, 8000).unwrap();
        assert_eq!(
            snapshot.text,
            "- document \"Home\"\n  - heading \"Welcome\" [ref=e1] [level=1]\n  - link \"Docs\" [ref=e2]\n  - paragraph\n    - text: Some text here\n  - textbox \"Search\" [ref=e3]\n"
        );
        assert_eq!(snapshot.refs, [13, 15, 20]);
    }

    #[test]
    fn the_full_view_keeps_containers_and_repeated_text() {
        let snapshot = render(&tree(), true, 8000).unwrap();
        assert!(
            snapshot.text.contains("  - generic\n    - heading"),
            "{}",
            snapshot.text
        );
        assert!(
            snapshot.text.contains("      - text: Docs\n"),
            "{}",
            snapshot.text
        );
    }

    #[test]
    fn a_snapshot_over_the_cap_is_cut_with_the_references_marker_and_only_shown_refs_exist() {
        let snapshot = render(&tree(), false, 60).unwrap();
        assert!(snapshot.text.ends_with(TRUNCATED), "{}", snapshot.text);
        assert_eq!(
            snapshot.text.chars().count(),
            60 + TRUNCATED.chars().count()
        );
        assert_eq!(snapshot.refs, [13]);
    }

    #[test]
    fn garbage_is_an_error_and_an_empty_tree_is_empty() {
        assert!(render(&json!({"nodes": 5}), false, 100).is_err());
        assert_eq!(render(&json!({}), false, 100).unwrap(), Snapshot::default());
    }
}
