//! The toolsets and built-in distributions a run may name, as plain data. It builds with serde
//! alone (like [`crate::spec`]), so that the operator refuses a run naming an unknown distribution
//! or a toolset this build does not ship before any pod starts ([`crate::validate`] checks a spec
//! against it), in the words the worker would use. A shipped toolset whose tools talk to a backend
//! is served only when the run configures it ([`missing_backend`]).

use crate::spec::ToolsSpec;

/// The toolsets this build serves, in catalog order.
pub const SHIPPED: [&str; 6] = ["terminal", "file", "web", "browser", "vision", "image_gen"];

/// The setting a shipped toolset needs and `tools` lacks, as a field path; `None` when the
/// toolset needs no backend or has one. A toolset with a backend adds one arm here.
pub fn missing_backend(toolset: &str, tools: &ToolsSpec) -> Option<&'static str> {
    match toolset {
        "web" if tools.web.search.is_none() => Some("spec.tools.web.search"),
        // `browser: {}` is enough: it starts Debian's /usr/bin/chromium.
        "browser" if tools.browser.is_none() => Some("spec.tools.browser"),
        "vision" if tools.vision.is_none() => Some("spec.tools.vision"),
        "image_gen" if tools.image_gen.is_none() => Some("spec.tools.imageGen"),
        _ => None,
    }
}

/// Toolsets named by the reference's distributions that this build does not ship yet, with what
/// would enable them (none: every toolset the distributions name is shipped).
pub const NOT_YET_SHIPPED: [(&str, &str); 0] = [];

/// A built-in distribution: name, description, toolsets with percentages.
pub type BuiltinDistribution = (&'static str, &'static str, &'static [(&'static str, f64)]);

/// The reference's distributions, without the removed `moa` toolset.
pub const BUILTIN_DISTRIBUTIONS: &[BuiltinDistribution] = &[
    (
        "default",
        "All toolsets, always",
        &[
            ("web", 100.0),
            ("vision", 100.0),
            ("image_gen", 100.0),
            ("terminal", 100.0),
            ("file", 100.0),
            ("browser", 100.0),
        ],
    ),
    (
        "image_gen",
        "Image generation focus",
        &[
            ("web", 55.0),
            ("vision", 90.0),
            ("image_gen", 90.0),
            ("terminal", 45.0),
        ],
    ),
    (
        "research",
        "Web research with vision",
        &[
            ("web", 90.0),
            ("vision", 50.0),
            ("terminal", 10.0),
            ("browser", 70.0),
        ],
    ),
    (
        "science",
        "Scientific problem solving",
        &[
            ("web", 94.0),
            ("vision", 65.0),
            ("image_gen", 15.0),
            ("terminal", 94.0),
            ("file", 94.0),
            ("browser", 50.0),
        ],
    ),
    (
        "development",
        "Terminal and file work",
        &[
            ("web", 30.0),
            ("vision", 10.0),
            ("terminal", 80.0),
            ("file", 80.0),
        ],
    ),
    (
        "safe",
        "Everything except the terminal",
        &[
            ("web", 80.0),
            ("vision", 60.0),
            ("image_gen", 60.0),
            ("browser", 70.0),
        ],
    ),
    (
        "balanced",
        "Equal chances for every toolset",
        &[
            ("web", 50.0),
            ("vision", 50.0),
            ("image_gen", 50.0),
            ("terminal", 50.0),
            ("file", 50.0),
            ("browser", 50.0),
        ],
    ),
    ("minimal", "Web only", &[("web", 100.0)]),
    (
        "terminal_only",
        "Terminal and file",
        &[("terminal", 100.0), ("file", 100.0)],
    ),
    (
        "terminal_web",
        "Terminal, file and web",
        &[("web", 100.0), ("terminal", 100.0), ("file", 100.0)],
    ),
    (
        "creative",
        "Image generation and vision",
        &[("web", 30.0), ("vision", 90.0), ("image_gen", 90.0)],
    ),
    (
        "reasoning",
        "Reasoning with a little web and terminal",
        &[("web", 30.0), ("terminal", 20.0)],
    ),
    (
        "browser_use",
        "Full browser interaction",
        &[("web", 80.0), ("vision", 70.0), ("browser", 100.0)],
    ),
    ("browser_only", "Browser only", &[("browser", 100.0)]),
    (
        "browser_tasks",
        "Browser-task datasets",
        &[("vision", 12.0), ("terminal", 15.0), ("browser", 97.0)],
    ),
    (
        "terminal_tasks",
        "Terminal-task datasets",
        &[
            ("web", 97.0),
            ("vision", 50.0),
            ("image_gen", 10.0),
            ("terminal", 97.0),
            ("file", 97.0),
            ("browser", 75.0),
        ],
    ),
    (
        "mixed_tasks",
        "Browser and terminal tasks",
        &[
            ("web", 35.0),
            ("vision", 15.0),
            ("image_gen", 15.0),
            ("terminal", 92.0),
            ("file", 92.0),
            ("browser", 92.0),
        ],
    ),
];
