//! The `file` toolset.
use std::sync::Arc;

use super::Tool;
use crate::spec::ToolsSpec;

pub const TOOLSET: &str = "file";

pub fn tools(_config: &ToolsSpec) -> Vec<Arc<dyn Tool>> {
    Vec::new()
}
