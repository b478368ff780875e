//! The toolsets and built-in distributions a run may name, as plain data. It builds with serde
//! alone (like [`crate::spec`]), so that the operator refuses a run naming an unknown distribution
//! or a toolset this build does not ship before any pod starts ([`crate::validate`] checks a spec
//! against it), in the words the worker would use. A shipped toolset whose tools talk to a backend
//! is served only when the run configures it ([`missing_backend`]).

use crate::spec::ToolsSpec;

/// The toolsets this build serves, in catalog order.
pub const SHIPPED: [&str; 7] = [
    "terminal",
    "file",
    "web",
    "search",
    "browser",
    "vision",
    "image_gen",
];

/// The setting a shipped toolset needs and `tools` lacks, as a field path; `None` when the
/// toolset needs no backend or has one. A toolset with a backend adds one arm here.
pub fn missing_backend(toolset: &str, tools: &ToolsSpec) -> Option<&'static str> {
    match toolset {
        // `search` is `web_search` alone, on the same backend as `web`'s.
        "web" | "search" if tools.web.search.is_none() => Some("spec.tools.web.search"),
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

/// What joins the toolsets of a grouped distribution entry (`browser+search`), as the reference
/// writes it.
pub const GROUP_SEPARATOR: char = '+';

/// The toolsets a distribution entry names, in its order: one toolset, or the members of a group
/// such as `browser+search`, which one draw enables together (as the reference's, which trims
/// each member).
pub fn entry_members(entry: &str) -> impl Iterator<Item = &str> {
    entry.split(GROUP_SEPARATOR).map(str::trim)
}

/// A built-in distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BuiltinDistribution {
    pub name: &'static str,
    pub description: &'static str,
    /// Entries with their probability in percent, in declaration order, which is the order of
    /// `toolsets_used` and decides the fallback on ties. An entry is a toolset or a group
    /// ([`entry_members`]).
    pub entries: &'static [(&'static str, f64)],
}

impl BuiltinDistribution {
    /// The built-in distribution of that name.
    pub fn named(name: &str) -> Option<&'static Self> {
        BUILTIN_DISTRIBUTIONS
            .iter()
            .find(|distribution| distribution.name == name)
    }
}

/// The reference's 17 distributions as hermes-agent declares them today (≈ v0.21,
/// `toolset_distributions.py`; its `moa` toolset is gone upstream too): names, descriptions,
/// entries and percentages, in its declaration order.
pub const BUILTIN_DISTRIBUTIONS: &[BuiltinDistribution] = &[
    BuiltinDistribution {
        name: "default",
        description: "All available tools, all the time",
        entries: &[
            ("web", 100.0),
            ("vision", 100.0),
            ("image_gen", 100.0),
            ("terminal", 100.0),
            ("file", 100.0),
            ("browser", 100.0),
        ],
    },
    BuiltinDistribution {
        name: "image_gen",
        description: "Heavy focus on image generation with vision and web support",
        entries: &[
            ("image_gen", 90.0),
            ("vision", 90.0),
            ("web", 55.0),
            ("terminal", 45.0),
        ],
    },
    BuiltinDistribution {
        name: "research",
        description: "Web research with vision analysis and reasoning",
        entries: &[
            ("web", 90.0),
            ("browser", 70.0),
            ("vision", 50.0),
            ("terminal", 10.0),
        ],
    },
    BuiltinDistribution {
        name: "science",
        description: "Scientific research with web, terminal, file, and browser capabilities",
        entries: &[
            ("web", 94.0),
            ("terminal", 94.0),
            ("file", 94.0),
            ("vision", 65.0),
            ("browser", 50.0),
            ("image_gen", 15.0),
        ],
    },
    BuiltinDistribution {
        name: "development",
        description: "Terminal, file tools, and reasoning with occasional web lookup",
        entries: &[
            ("terminal", 80.0),
            ("file", 80.0),
            ("web", 30.0),
            ("vision", 10.0),
        ],
    },
    BuiltinDistribution {
        name: "safe",
        description: "All tools except terminal for safety",
        entries: &[
            ("web", 80.0),
            ("browser", 70.0),
            ("vision", 60.0),
            ("image_gen", 60.0),
        ],
    },
    BuiltinDistribution {
        name: "balanced",
        description: "Equal probability of all toolsets",
        entries: &[
            ("web", 50.0),
            ("vision", 50.0),
            ("image_gen", 50.0),
            ("terminal", 50.0),
            ("file", 50.0),
            ("browser", 50.0),
        ],
    },
    BuiltinDistribution {
        name: "minimal",
        description: "Only web tools for basic research",
        entries: &[("web", 100.0)],
    },
    BuiltinDistribution {
        name: "terminal_only",
        description: "Terminal and file tools for code execution tasks",
        entries: &[("terminal", 100.0), ("file", 100.0)],
    },
    BuiltinDistribution {
        name: "terminal_web",
        description: "Terminal and file tools with web search for documentation lookup",
        entries: &[("terminal", 100.0), ("file", 100.0), ("web", 100.0)],
    },
    BuiltinDistribution {
        name: "creative",
        description: "Image generation and vision analysis focus",
        entries: &[("image_gen", 90.0), ("vision", 90.0), ("web", 30.0)],
    },
    BuiltinDistribution {
        name: "reasoning",
        description: "Heavy research/reasoning distribution with minimal other tools",
        entries: &[("web", 90.0), ("file", 60.0), ("terminal", 20.0)],
    },
    BuiltinDistribution {
        name: "browser_use",
        description: "Full browser-based web interaction with search, vision, and page control",
        entries: &[("browser", 100.0), ("web", 80.0), ("vision", 70.0)],
    },
    BuiltinDistribution {
        name: "browser_only",
        description: "Only browser automation tools for pure web interaction tasks",
        entries: &[("browser", 100.0)],
    },
    BuiltinDistribution {
        name: "browser_tasks",
        description: "Browser-focused distribution with web_search for finding URLs (Google blocks direct browser searches)",
        entries: &[
            ("browser+search", 97.0),
            ("vision", 12.0),
            ("terminal", 15.0),
        ],
    },
    BuiltinDistribution {
        name: "terminal_tasks",
        description: "Terminal-focused distribution with high terminal/file availability, occasional other tools",
        entries: &[
            ("terminal", 97.0),
            ("file", 97.0),
            ("web", 97.0),
            ("browser", 75.0),
            ("vision", 50.0),
            ("image_gen", 10.0),
        ],
    },
    BuiltinDistribution {
        name: "mixed_tasks",
        description: "Mixed distribution with high browser, terminal, and file availability for complex tasks",
        entries: &[
            ("browser", 92.0),
            ("terminal", 92.0),
            ("file", 92.0),
            ("web", 35.0),
            ("vision", 15.0),
            ("image_gen", 15.0),
        ],
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    /// hermes-agent's `DISTRIBUTIONS` today, transcribed by hand, apart from [`BUILTIN_DISTRIBUTIONS`],
    /// from its `toolset_distributions.py` as read at zons-zhaozhy/hermes-agent@303df6af, a fork
    /// that tracks upstream (the values of upstream PR #103463, merged 2026-09-05, which made
    /// `browser+search` one entry, after the `moa` removal, c6575df927; the project's research
    /// notes on hermes-agent now, §4). One line per distribution in its declaration order:
    /// `name | description | entry=percent ...`, the entries in its keyword order.
    const REFERENCE: &str = "\
default | All available tools, all the time | web=100 vision=100 image_gen=100 terminal=100 file=100 browser=100
image_gen | Heavy focus on image generation with vision and web support | image_gen=90 vision=90 web=55 terminal=45
research | Web research with vision analysis and reasoning | web=90 browser=70 vision=50 terminal=10
science | Scientific research with web, terminal, file, and browser capabilities | web=94 terminal=94 file=94 vision=65 browser=50 image_gen=15
development | Terminal, file tools, and reasoning with occasional web lookup | terminal=80 file=80 web=30 vision=10
safe | All tools except terminal for safety | web=80 browser=70 vision=60 image_gen=60
balanced | Equal probability of all toolsets | web=50 vision=50 image_gen=50 terminal=50 file=50 browser=50
minimal | Only web tools for basic research | web=100
terminal_only | Terminal and file tools for code execution tasks | terminal=100 file=100
terminal_web | Terminal and file tools with web search for documentation lookup | terminal=100 file=100 web=100
creative | Image generation and vision analysis focus | image_gen=90 vision=90 web=30
reasoning | Heavy research/reasoning distribution with minimal other tools | web=90 file=60 terminal=20
browser_use | Full browser-based web interaction with search, vision, and page control | browser=100 web=80 vision=70
browser_only | Only browser automation tools for pure web interaction tasks | browser=100
browser_tasks | Browser-focused distribution with web_search for finding URLs (Google blocks direct browser searches) | browser+search=97 vision=12 terminal=15
terminal_tasks | Terminal-focused distribution with high terminal/file availability, occasional other tools | terminal=97 file=97 web=97 browser=75 vision=50 image_gen=10
mixed_tasks | Mixed distribution with high browser, terminal, and file availability for complex tasks | browser=92 terminal=92 file=92 web=35 vision=15 image_gen=15
";

    #[test]
    fn the_builtin_distributions_are_the_references_today() {
        // Ours, written in the transcription's format (a whole percent prints without `.0`).
        let ours: Vec<String> = BUILTIN_DISTRIBUTIONS
            .iter()
            .map(|distribution| {
                let entries: Vec<String> = distribution
                    .entries
                    .iter()
                    .map(|(entry, percent)| format!("{entry}={percent}"))
                    .collect();
                format!(
                    "{} | {} | {}",
                    distribution.name,
                    distribution.description,
                    entries.join(" ")
                )
            })
            .collect();
        let reference: Vec<&str> = REFERENCE.lines().collect();
        assert_eq!(reference.len(), 17);
        assert_eq!(ours, reference);
    }

    #[test]
    fn every_member_of_every_builtin_entry_is_shipped() {
        for distribution in BUILTIN_DISTRIBUTIONS {
            for (entry, _) in distribution.entries {
                for toolset in entry_members(entry) {
                    assert!(
                        SHIPPED.contains(&toolset),
                        "{}: {toolset}",
                        distribution.name
                    );
                }
            }
        }
        let browser_tasks = BuiltinDistribution::named("browser_tasks").unwrap();
        assert_eq!(
            entry_members(browser_tasks.entries[0].0).collect::<Vec<_>>(),
            ["browser", "search"]
        );
    }
}
