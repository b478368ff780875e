//! The toolsets and built-in distributions a run may name, as plain data, with the check that a
//! spec's distribution can be served by this build. It builds with serde alone (like [`crate::spec`]),
//! so that the operator refuses a run naming an unknown distribution or a toolset this build does
//! not ship before any pod starts, in the words the worker would use. A shipped toolset whose tools
//! talk to a backend is served only when the run configures it ([`missing_backend`]).

use crate::spec::{DistributionSpec, SpecViolation, ToolsSpec};

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

/// Every way `spec` names a distribution this build cannot serve: an unknown name, an unknown
/// toolset, or a toolset it does not ship (or whose backend `tools` does not configure) drawn
/// with a probability above 0; toolsets the spec declares itself (MCP servers and HTTP toolsets,
/// `spec.tools`) may be named by an inline distribution too. Each violation names
/// `spec.distribution` (or the inline toolset's own field, or the missing backend setting).
pub fn distribution_violations(spec: &DistributionSpec, tools: &ToolsSpec) -> Vec<SpecViolation> {
    let declared: Vec<&str> = tools.declared_toolsets().collect();
    let violation = |field: String, message: String| SpecViolation { field, message };
    let (name, toolsets): (&str, Vec<(&str, f64)>) = match spec {
        DistributionSpec::Named(name) => {
            let Some((_, _, toolsets)) = BUILTIN_DISTRIBUTIONS.iter().find(|(n, ..)| n == name)
            else {
                let known: Vec<&str> = BUILTIN_DISTRIBUTIONS
                    .iter()
                    .map(|(name, ..)| *name)
                    .collect();
                return vec![violation(
                    "spec.distribution".to_owned(),
                    format!("unknown distribution {name:?}; known: {}", known.join(", ")),
                )];
            };
            (name, toolsets.to_vec())
        }
        DistributionSpec::Inline(map) => (
            "inline",
            map.iter()
                .map(|(toolset, percent)| (toolset.as_str(), *percent))
                .collect(),
        ),
    };
    let mut violations = Vec::new();
    for (toolset, percent) in toolsets {
        if let Some((_, hint)) = NOT_YET_SHIPPED.iter().find(|(n, _)| *n == toolset) {
            if percent > 0.0 {
                violations.push(violation(
                    "spec.distribution".to_owned(),
                    format!(
                        "{name:?} can draw toolset {toolset:?} ({percent}%), which is not available: {hint}"
                    ),
                ));
            }
        } else if let Some(field) = missing_backend(toolset, tools).filter(|_| percent > 0.0) {
            violations.push(violation(
                field.to_owned(),
                format!("required because distribution {name:?} draws toolset {toolset}"),
            ));
        } else if !SHIPPED.contains(&toolset) && !declared.contains(&toolset) {
            let known: Vec<&str> = SHIPPED
                .iter()
                .copied()
                .chain(NOT_YET_SHIPPED.iter().map(|(name, _)| *name))
                .chain(declared.iter().copied())
                .collect();
            violations.push(violation(
                format!("spec.distribution.{toolset}"),
                format!("unknown toolset {toolset:?}; known: {}", known.join(", ")),
            ));
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(spec: &DistributionSpec) -> Vec<String> {
        distribution_violations(spec, &ToolsSpec::default())
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn a_distribution_is_refused_naming_every_backend_it_draws_and_lacks() {
        assert!(messages(&DistributionSpec::Named("terminal_only".into())).is_empty());
        assert_eq!(
            messages(&DistributionSpec::Named("default".into())),
            [
                "spec.tools.web.search: required because distribution \"default\" draws toolset web",
                "spec.tools.vision: required because distribution \"default\" draws toolset vision",
                "spec.tools.imageGen: required because distribution \"default\" draws toolset image_gen",
                "spec.tools.browser: required because distribution \"default\" draws toolset browser",
            ]
        );
    }

    #[test]
    fn every_builtin_distribution_passes_with_every_backend_configured() {
        let tools: ToolsSpec = serde_json::from_value(serde_json::json!({
            "web": {"search": {"url": "http://searxng:8080"}},
            "browser": {},
            "vision": {"baseUrl": "http://vllm-vl:8000/v1", "model": "vl"},
            "imageGen": {"baseUrl": "http://images:8000/v1", "model": "img"},
        }))
        .unwrap();
        assert!(NOT_YET_SHIPPED.is_empty());
        for (name, ..) in BUILTIN_DISTRIBUTIONS {
            let spec = DistributionSpec::Named((*name).to_owned());
            assert_eq!(distribution_violations(&spec, &tools), [], "{name}");
        }
        assert_eq!(missing_backend("vision", &tools), None);
        assert_eq!(missing_backend("image_gen", &tools), None);
        assert_eq!(
            missing_backend("image_gen", &ToolsSpec::default()),
            Some("spec.tools.imageGen")
        );
    }

    #[test]
    fn a_toolset_with_a_backend_passes_once_the_backend_is_configured() {
        let research = DistributionSpec::Named("terminal_web".into());
        assert_eq!(
            messages(&research),
            [
                "spec.tools.web.search: required because distribution \"terminal_web\" draws toolset web"
            ]
        );
        let tools: ToolsSpec = serde_json::from_value(
            serde_json::json!({"web": {"search": {"url": "http://searxng:8080"}}}),
        )
        .unwrap();
        assert!(distribution_violations(&research, &tools).is_empty());
        assert_eq!(missing_backend("web", &tools), None);
        let browser_only = DistributionSpec::Named("browser_only".into());
        assert_eq!(
            messages(&browser_only),
            [
                "spec.tools.browser: required because distribution \"browser_only\" draws toolset browser"
            ]
        );
        let tools = ToolsSpec {
            browser: Some(crate::spec::BrowserSpec::default()),
            ..ToolsSpec::default()
        };
        assert!(distribution_violations(&browser_only, &tools).is_empty());
        assert_eq!(missing_backend("terminal", &ToolsSpec::default()), None);
    }

    #[test]
    fn an_unknown_name_or_toolset_is_refused_naming_the_field() {
        let unknown = messages(&DistributionSpec::Named("researh".into()));
        assert_eq!(unknown.len(), 1);
        assert!(
            unknown[0].starts_with(
                "spec.distribution: unknown distribution \"researh\"; known: default, "
            ),
            "{unknown:?}"
        );
        let inline = DistributionSpec::Inline(
            [("terminal".to_owned(), 50.0), ("termnal".to_owned(), 50.0)].into(),
        );
        assert_eq!(
            messages(&inline),
            [
                "spec.distribution.termnal: unknown toolset \"termnal\"; known: terminal, file, web, browser, vision, image_gen"
            ]
        );
        // A toolset this build does not ship, or whose backend is missing, may be named at 0%.
        let off = DistributionSpec::Inline(
            [
                ("terminal".to_owned(), 100.0),
                ("web".to_owned(), 0.0),
                ("vision".to_owned(), 0.0),
            ]
            .into(),
        );
        assert!(messages(&off).is_empty());
    }
}
