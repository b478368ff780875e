//! `distributions`: the built-in distributions, the toolsets each one draws, and what each toolset
//! needs configured; given a run file, which distributions that file can serve and what it lacks.
//!
//! The verdicts come from the same checks that refuse a run ([`crate::validate`]), so the listing
//! cannot promise a distribution that validation would then refuse.

use std::fmt::Write as _;
use std::path::Path;

use super::{RunError, RunFile};
use crate::spec::{DistributionSpec, RunSpec, ToolsSpec};
use crate::toolsets::{
    BUILTIN_DISTRIBUTIONS, NOT_YET_SHIPPED, SHIPPED, entry_members, missing_backend,
};
use crate::validate::distribution_violations;

/// Prints the listing, checked against `run_file` when one is given; fails, naming the fields,
/// when that file's own distribution cannot run.
pub fn print(run_file: Option<&Path>) -> Result<(), RunError> {
    let Some(path) = run_file else {
        print!("{}", report(None));
        return Ok(());
    };
    let file = RunFile::read(path)?;
    let name = path.display().to_string();
    print!("{}", report(Some((&name, &file.spec))));
    refusal(&name, &file.spec).map_or(Ok(()), |refusal| Err(RunError::Spec(refusal)))
}

/// Where one toolset stands, for one run file or for none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolsetStatus {
    /// Shipped and needs no backend (terminal, file).
    Builtin,
    /// Shipped, needs this setting; no run file was given to say whether it is set.
    Needs(&'static str),
    /// Shipped, and the run file sets what it needs.
    Configured(&'static str),
    /// Shipped, and the run file lacks this setting.
    Missing(&'static str),
    /// An MCP server or HTTP toolset the run file declares.
    Declared,
    /// Not in this build, with what to do instead.
    NotInBuild(&'static str),
    /// Neither shipped nor declared by the run file.
    Unknown,
}

impl ToolsetStatus {
    /// The status of `toolset`; `tools` is the run file's `spec.tools`, if one was given.
    pub fn of(toolset: &str, tools: Option<&ToolsSpec>) -> Self {
        if let Some((_, hint)) = NOT_YET_SHIPPED.iter().find(|(name, _)| *name == toolset) {
            return Self::NotInBuild(hint);
        }
        if SHIPPED.contains(&toolset) {
            // With nothing configured, the missing setting is the one the toolset needs at all.
            let needed = missing_backend(toolset, &ToolsSpec::default());
            return match (needed, tools) {
                (None, _) => Self::Builtin,
                (Some(field), None) => Self::Needs(field),
                (Some(field), Some(tools)) if missing_backend(toolset, tools).is_some() => {
                    Self::Missing(field)
                }
                (Some(field), Some(_)) => Self::Configured(field),
            };
        }
        if tools.is_some_and(|tools| tools.declared_toolsets().any(|name| name == toolset)) {
            return Self::Declared;
        }
        Self::Unknown
    }

    /// Whether a distribution drawing this toolset can run.
    fn is_usable(&self) -> bool {
        matches!(
            self,
            Self::Builtin | Self::Needs(_) | Self::Configured(_) | Self::Declared
        )
    }

    fn describe(&self) -> String {
        match self {
            Self::Builtin => "built in".to_owned(),
            Self::Needs(field) => format!("needs {field}"),
            Self::Configured(field) => format!("{field} set"),
            Self::Missing(field) => format!("MISSING {field}"),
            Self::Declared => "declared in spec.tools".to_owned(),
            Self::NotInBuild(hint) => format!("NOT IN THIS BUILD: {hint}"),
            Self::Unknown => "UNKNOWN toolset".to_owned(),
        }
    }
}

/// The listing `trajectory-worker distributions [RUN_FILE]` prints: every built-in distribution
/// with its entries (toolsets, or groups drawn as one) by falling probability, each with its
/// status. With a run file, each
/// distribution is marked `ready` or with what the file lacks, and the file's own distribution
/// (named or inline) comes first with the messages validation would give.
pub fn report(run: Option<(&str, &RunSpec)>) -> String {
    let tools = run.map(|(_, spec)| &spec.tools);
    let mut out = String::new();
    if let Some((file, spec)) = run {
        let violations = distribution_violations(&spec.distribution, &spec.tools);
        let name = match &spec.distribution {
            DistributionSpec::Named(name) => name.clone(),
            DistributionSpec::Inline(_) => "an inline distribution".to_owned(),
        };
        if violations.is_empty() {
            let _ = writeln!(out, "{file}: its distribution ({name}) can run");
        } else {
            let _ = writeln!(out, "{file}: its distribution ({name}) cannot run:");
            for violation in &violations {
                let _ = writeln!(out, "    {violation}");
            }
        }
        if let DistributionSpec::Inline(map) = &spec.distribution {
            let toolsets: Vec<(&str, f64)> = map.iter().map(|(t, p)| (t.as_str(), *p)).collect();
            write_toolsets(&mut out, &toolsets, tools);
        }
        let _ = writeln!(out);
    }
    for distribution in BUILTIN_DISTRIBUTIONS {
        let verdict = match tools {
            None => String::new(),
            Some(tools) => {
                let lacking: Vec<String> = distribution
                    .entries
                    .iter()
                    .filter(|(_, percent)| *percent > 0.0)
                    .flat_map(|(entry, _)| entry_members(entry))
                    .map(|toolset| (toolset, ToolsetStatus::of(toolset, Some(tools))))
                    .filter(|(_, status)| !status.is_usable())
                    .map(|(toolset, status)| match status {
                        ToolsetStatus::Missing(field) => field.to_owned(),
                        ToolsetStatus::NotInBuild(_) => format!("{toolset} (not in this build)"),
                        _ => format!("{toolset} (unknown)"),
                    })
                    .collect();
                if lacking.is_empty() {
                    "  [ready]".to_owned()
                } else {
                    format!("  [lacks {}]", lacking.join(", "))
                }
            }
        };
        let _ = writeln!(
            out,
            "{:<16} {}{verdict}",
            distribution.name, distribution.description
        );
        write_toolsets(&mut out, distribution.entries, tools);
    }
    out
}

/// One line per entry, by falling probability (as the reference prints them); a group's line
/// gives each member's status.
fn write_toolsets(out: &mut String, entries: &[(&str, f64)], tools: Option<&ToolsSpec>) {
    let mut entries = entries.to_vec();
    entries.sort_by(|a, b| b.1.total_cmp(&a.1));
    for (entry, percent) in entries {
        let members: Vec<&str> = entry_members(entry).collect();
        let status = if let [toolset] = members.as_slice() {
            ToolsetStatus::of(toolset, tools).describe()
        } else {
            let statuses: Vec<String> = members
                .iter()
                .map(|toolset| {
                    format!(
                        "{toolset}: {}",
                        ToolsetStatus::of(toolset, tools).describe()
                    )
                })
                .collect();
            statuses.join("; ")
        };
        let _ = writeln!(out, "    • {entry:<15}: {percent:>5}% chance  {status}");
    }
}

/// The run file's own distribution cannot run: the listing was printed, and this is the error
/// (each message naming its field) that validating the run would give.
pub fn refusal(file: &str, spec: &RunSpec) -> Option<String> {
    let violations = distribution_violations(&spec.distribution, &spec.tools);
    (!violations.is_empty()).then(|| {
        let list: Vec<String> = violations.iter().map(ToString::to_string).collect();
        format!("{file}: {}", list.join("; "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> RunSpec {
        serde_yaml::from_str(yaml).expect("spec")
    }

    const MODEL: &str =
        "model: {baseUrl: 'http://127.0.0.1:1/v1', name: m}\ndataset: {path: d.jsonl}\n";

    #[test]
    fn without_a_run_file_each_toolset_says_what_it_needs() {
        let listing = report(None);
        let research = listing
            .split("\nresearch ")
            .nth(1)
            .expect("the research distribution is listed");
        assert!(
            research.contains("• web            :    90% chance  needs spec.tools.web.search"),
            "{listing}"
        );
        assert!(
            listing.contains("• terminal       :   100% chance  built in"),
            "{listing}"
        );
        assert_eq!(
            listing
                .lines()
                .filter(|line| !line.starts_with(' '))
                .count(),
            BUILTIN_DISTRIBUTIONS.len(),
            "one heading line per distribution: {listing}"
        );
    }

    #[test]
    fn a_group_entry_is_listed_once_with_each_members_status() {
        let listing = report(None);
        assert!(
            listing.contains(
                "• browser+search :    97% chance  browser: needs spec.tools.browser; search: needs spec.tools.web.search"
            ),
            "{listing}"
        );
        let spec = spec(&format!("{MODEL}tools: {{browser: {{}}}}\n"));
        let listing = report(Some(("run.yaml", &spec)));
        let browser_tasks = listing
            .lines()
            .find(|line| line.starts_with("browser_tasks "))
            .unwrap();
        assert!(
            browser_tasks.ends_with("[lacks spec.tools.web.search, spec.tools.vision]"),
            "{listing}"
        );
    }

    #[test]
    fn with_a_run_file_the_listing_marks_what_it_lacks_and_refuses_its_own_distribution() {
        let spec = spec(&format!(
            "{MODEL}distribution: terminal_web\ntools: {{web: {{search: {{url: 'http://127.0.0.1:8888'}}}}}}\n"
        ));
        let listing = report(Some(("run.yaml", &spec)));
        assert!(
            listing.starts_with("run.yaml: its distribution (terminal_web) can run\n"),
            "{listing}"
        );
        let line = |name: &str| {
            listing
                .lines()
                .find(|line| line.starts_with(&format!("{name} ")))
                .unwrap_or_else(|| panic!("{name} is listed: {listing}"))
                .to_owned()
        };
        assert!(line("terminal_web").ends_with("[ready]"), "{listing}");
        assert!(
            line("browser_only").ends_with("[lacks spec.tools.browser]"),
            "{listing}"
        );
        assert!(
            listing.contains("• web            :   100% chance  spec.tools.web.search set"),
            "{listing}"
        );
        assert_eq!(refusal("run.yaml", &spec), None);

        let browser = self::spec(&format!("{MODEL}distribution: browser_only\n"));
        let listing = report(Some(("run.yaml", &browser)));
        assert!(
            listing.starts_with(
                "run.yaml: its distribution (browser_only) cannot run:\n    spec.tools.browser: required because distribution \"browser_only\" draws toolset browser\n"
            ),
            "{listing}"
        );
        assert_eq!(
            refusal("run.yaml", &browser).as_deref(),
            Some(
                "run.yaml: spec.tools.browser: required because distribution \"browser_only\" draws toolset browser"
            )
        );
    }

    #[test]
    fn an_inline_distribution_lists_its_declared_and_unknown_toolsets() {
        let spec = spec(&format!(
            "{MODEL}distribution: {{terminal: 50, clock: 30, nope: 20}}\ntools:\n  mcp:\n    - name: clock\n      stdio: {{command: mcp-server-time}}\n"
        ));
        let listing = report(Some(("run.yaml", &spec)));
        assert!(
            listing.starts_with("run.yaml: its distribution (an inline distribution) cannot run:\n    spec.distribution.nope: unknown toolset \"nope\""),
            "{listing}"
        );
        assert!(
            listing.contains("• clock          :    30% chance  declared in spec.tools"),
            "{listing}"
        );
        assert!(
            listing.contains("• nope           :    20% chance  UNKNOWN toolset"),
            "{listing}"
        );
    }
}
