//! Whether a spec's distribution can be served by this build: a known name, known toolsets (each
//! member of a group entry among them), and the backend of every toolset it can draw configured.

use super::SpecViolation;
use crate::spec::{DistributionSpec, ToolsSpec};
use crate::toolsets::{
    BUILTIN_DISTRIBUTIONS, BuiltinDistribution, NOT_YET_SHIPPED, SHIPPED, entry_members,
    missing_backend,
};

/// Every way `spec` names a distribution this build cannot serve: an unknown name, an unknown
/// toolset, or a toolset it does not ship (or whose backend `tools` does not configure) drawn
/// with a probability above 0; toolsets the spec declares itself (MCP servers and HTTP toolsets,
/// `spec.tools`) may be named by an inline distribution too. The members of a group entry
/// (`browser+search`) are checked one by one. Each violation names `spec.distribution` (or the
/// inline entry's own field, or the missing backend setting).
pub fn distribution_violations(spec: &DistributionSpec, tools: &ToolsSpec) -> Vec<SpecViolation> {
    let declared: Vec<&str> = tools.declared_toolsets().collect();
    let violation = |field: String, message: String| SpecViolation { field, message };
    let (name, entries): (&str, Vec<(&str, f64)>) = match spec {
        DistributionSpec::Named(name) => {
            let Some(builtin) = BuiltinDistribution::named(name) else {
                let known: Vec<&str> = BUILTIN_DISTRIBUTIONS.iter().map(|d| d.name).collect();
                return vec![violation(
                    "spec.distribution".to_owned(),
                    format!("unknown distribution {name:?}; known: {}", known.join(", ")),
                )];
            };
            (name, builtin.entries.to_vec())
        }
        DistributionSpec::Inline(map) => (
            "inline",
            map.iter()
                .map(|(entry, percent)| (entry.as_str(), *percent))
                .collect(),
        ),
    };
    let mut violations = Vec::new();
    for (entry, percent) in entries {
        for toolset in entry_members(entry) {
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
                    format!("spec.distribution.{entry}"),
                    format!("unknown toolset {toolset:?}; known: {}", known.join(", ")),
                ));
            }
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::BrowserSpec;

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
        for builtin in BUILTIN_DISTRIBUTIONS {
            let name = builtin.name;
            let spec = DistributionSpec::Named(name.to_owned());
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
            browser: Some(BrowserSpec::default()),
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
                "spec.distribution.termnal: unknown toolset \"termnal\"; known: terminal, file, web, search, browser, vision, image_gen"
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

    #[test]
    fn each_member_of_a_group_entry_is_checked_and_a_bad_one_names_the_group() {
        assert_eq!(
            messages(&DistributionSpec::Named("browser_tasks".into())),
            [
                "spec.tools.browser: required because distribution \"browser_tasks\" draws toolset browser",
                "spec.tools.web.search: required because distribution \"browser_tasks\" draws toolset search",
                "spec.tools.vision: required because distribution \"browser_tasks\" draws toolset vision",
            ]
        );
        let inline = DistributionSpec::Inline(
            [
                ("terminal+file".to_owned(), 80.0),
                ("terminal+fiel".to_owned(), 20.0),
            ]
            .into(),
        );
        let violations = distribution_violations(&inline, &ToolsSpec::default());
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert_eq!(violations[0].field, "spec.distribution.terminal+fiel");
        assert!(
            violations[0]
                .message
                .starts_with("unknown toolset \"fiel\"; known: terminal, file"),
            "{violations:?}"
        );
    }
}
