//! The `terminal` toolset.
use std::sync::Arc;

use super::Tool;
use crate::spec::ToolsSpec;

pub const TOOLSET: &str = "terminal";

pub fn tools(_config: &ToolsSpec) -> Vec<Arc<dyn Tool>> {
    Vec::new()
}
