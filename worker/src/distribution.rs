//! Toolset distributions: which toolsets a prompt's agent is offered.
//!
//! The reference's semantics, made reproducible: every entry of a distribution is drawn
//! independently with its probability (a Bernoulli trial, not a weighted choice; the percentages
//! need not sum to 100); an entry is a toolset or a group such as `browser+search`, whose one draw
//! enables all its members; when nothing is drawn the most probable entry (the first on ties) is
//! taken, all its members. The draws are a pure function of `(seed, prompt_index, sample, entry)`,
//! so the same run gives the same toolsets on every machine and every retry.

use std::collections::BTreeMap;

use crate::spec::DistributionSpec;
use crate::tools::{Availability, Registry};
use crate::toolsets::{BUILTIN_DISTRIBUTIONS, BuiltinDistribution, entry_members};

/// A distribution: entries (toolsets or groups of them) with inclusion probabilities in percent,
/// in declaration order.
#[derive(Debug, Clone, PartialEq)]
pub struct Distribution {
    pub name: String,
    pub description: String,
    pub entries: Vec<(String, f64)>,
}

/// Why a distribution cannot be used; each names the field and value at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DistributionError {
    #[error("spec.distribution: unknown distribution {0:?}; known: {1}")]
    UnknownName(String, String),
    /// `entry` is the toolset itself, or the group naming it.
    #[error("spec.distribution.{entry}: unknown toolset {toolset:?}; known: {known}")]
    UnknownToolset {
        entry: String,
        toolset: String,
        known: String,
    },
    #[error("spec.distribution.{entry}: percent must be between 0 and 100, got {percent}")]
    Percent { entry: String, percent: f64 },
    #[error(
        "spec.distribution: {distribution:?} can draw toolset {toolset:?} ({percent}%), which is not available: {hint}"
    )]
    Unavailable {
        distribution: String,
        toolset: String,
        percent: f64,
        hint: String,
    },
    #[error("spec.distribution: the distribution has no toolset with a probability above 0")]
    Empty,
}

/// Every built-in distribution, in the reference's order.
pub fn builtin() -> Vec<Distribution> {
    BUILTIN_DISTRIBUTIONS
        .iter()
        .map(Distribution::from)
        .collect()
}

impl From<&BuiltinDistribution> for Distribution {
    fn from(builtin: &BuiltinDistribution) -> Self {
        Self {
            name: builtin.name.to_owned(),
            description: builtin.description.to_owned(),
            entries: builtin
                .entries
                .iter()
                .map(|(entry, percent)| ((*entry).to_owned(), *percent))
                .collect(),
        }
    }
}

impl Distribution {
    /// Resolves the spec into a distribution this build can serve, or says why not.
    pub fn resolve(
        spec: &DistributionSpec,
        registry: &Registry,
    ) -> Result<Self, DistributionError> {
        let distribution = match spec {
            DistributionSpec::Named(name) => BuiltinDistribution::named(name)
                .map(Self::from)
                .ok_or_else(|| {
                    let known: Vec<_> = BUILTIN_DISTRIBUTIONS.iter().map(|d| d.name).collect();
                    DistributionError::UnknownName(name.clone(), known.join(", "))
                })?,
            DistributionSpec::Inline(map) => Self::inline(map),
        };
        let known: Vec<_> = registry.toolset_names().collect();
        for (entry, percent) in &distribution.entries {
            if !(0.0..=100.0).contains(percent) {
                return Err(DistributionError::Percent {
                    entry: entry.clone(),
                    percent: *percent,
                });
            }
            for toolset in entry_members(entry) {
                let Some(registered) = registry.toolset(toolset) else {
                    return Err(DistributionError::UnknownToolset {
                        entry: entry.clone(),
                        toolset: toolset.to_owned(),
                        known: known.join(", "),
                    });
                };
                if let Availability::Unavailable(hint) = &registered.availability
                    && *percent > 0.0
                {
                    return Err(DistributionError::Unavailable {
                        distribution: distribution.name.clone(),
                        toolset: toolset.to_owned(),
                        percent: *percent,
                        hint: hint.clone(),
                    });
                }
            }
        }
        if distribution
            .entries
            .iter()
            .all(|(_, percent)| *percent <= 0.0)
        {
            return Err(DistributionError::Empty);
        }
        Ok(distribution)
    }

    /// An inline distribution's entries come in the map's (alphabetical) order.
    fn inline(map: &BTreeMap<String, f64>) -> Self {
        Self {
            name: "inline".to_owned(),
            description: "Inline distribution from the spec".to_owned(),
            entries: map
                .iter()
                .map(|(entry, percent)| (entry.clone(), *percent))
                .collect(),
        }
    }

    /// Every toolset this distribution can draw (its entry's probability above 0), in
    /// declaration order, each once.
    pub fn possible_toolsets(&self) -> Vec<String> {
        members_once(
            self.entries
                .iter()
                .filter(|(_, percent)| *percent > 0.0)
                .map(|(entry, _)| entry.as_str()),
        )
    }

    /// The toolsets of one (prompt, sample): independent draws per entry, falling back to the
    /// most probable entry (the first on ties) when none is drawn; each toolset once, in
    /// declaration order, a group's members in the group's order.
    pub fn sample(&self, seed: u64, prompt_index: u64, sample: u32) -> Vec<String> {
        let drawn: Vec<&str> = self
            .entries
            .iter()
            .filter(|(entry, percent)| {
                unit_draw(seed, prompt_index, sample, entry) * 100.0 < *percent
            })
            .map(|(entry, _)| entry.as_str())
            .collect();
        if !drawn.is_empty() {
            return members_once(drawn);
        }
        let mut most_probable: Option<&(String, f64)> = None;
        for entry in &self.entries {
            if most_probable.is_none_or(|(_, percent)| entry.1 > *percent) {
                most_probable = Some(entry);
            }
        }
        members_once(most_probable.map(|(entry, _)| entry.as_str()))
    }
}

/// The members of `entries`, in order, each once (two entries may share a toolset).
fn members_once<'a>(entries: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut toolsets: Vec<String> = Vec::new();
    for toolset in entries.into_iter().flat_map(entry_members) {
        if !toolsets.iter().any(|seen| seen == toolset) {
            toolsets.push(toolset.to_owned());
        }
    }
    toolsets
}

/// A uniform draw in [0, 1) from the inputs alone. `SplitMix64`'s finaliser over the seed, the
/// prompt, the sample and an FNV-1a hash of the entry's name (a toolset's own name, or the group's
/// such as `browser+search`): stable across platforms and releases, which a library RNG's stream
/// does not promise.
fn unit_draw(seed: u64, prompt_index: u64, sample: u32, entry: &str) -> f64 {
    let mut name_hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in entry.bytes() {
        name_hash ^= u64::from(byte);
        name_hash = name_hash.wrapping_mul(0x0100_0000_01b3);
    }
    let mut state = seed;
    for word in [prompt_index, u64::from(sample), name_hash] {
        state = splitmix64(state ^ word);
    }
    // The top 53 bits make an exact f64 in [0, 1).
    (state >> 11) as f64 / (1u64 << 53) as f64
}

fn splitmix64(state: u64) -> u64 {
    let mut z = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ToolsSpec;
    use proptest::prelude::*;

    fn registry() -> Registry {
        Registry::builtin(&ToolsSpec::default())
    }

    fn inline(entries: &[(&str, f64)]) -> DistributionSpec {
        DistributionSpec::Inline(entries.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect())
    }

    #[test]
    fn there_are_seventeen_reference_distributions() {
        assert_eq!(builtin().len(), 17);
        assert!(
            builtin()
                .iter()
                .all(|d| d.entries.iter().all(|(t, _)| t != "moa"))
        );
    }

    #[test]
    fn unknown_names_and_toolsets_are_refused_naming_them() {
        let error = Distribution::resolve(&DistributionSpec::Named("nope".into()), &registry())
            .unwrap_err();
        assert!(error.to_string().contains("\"nope\""), "{error}");
        let error = Distribution::resolve(&inline(&[("shell", 50.0)]), &registry()).unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("spec.distribution.shell: unknown toolset"),
            "{error}"
        );
        let error =
            Distribution::resolve(&inline(&[("terminal", 101.0)]), &registry()).unwrap_err();
        assert!(matches!(error, DistributionError::Percent { .. }));
    }

    #[test]
    fn a_distribution_that_can_draw_an_unavailable_toolset_is_refused() {
        let error =
            Distribution::resolve(&DistributionSpec::Named("development".into()), &registry())
                .unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains("\"web\"") && text.contains("not available"),
            "{text}"
        );
        // At 0% it can never be drawn, so it is fine.
        assert!(
            Distribution::resolve(&inline(&[("web", 0.0), ("terminal", 50.0)]), &registry())
                .is_ok()
        );
    }

    #[test]
    fn fallback_takes_the_most_probable_toolset() {
        let distribution = Distribution::resolve(
            &inline(&[("file", 0.001), ("terminal", 0.002)]),
            &registry(),
        )
        .unwrap();
        let fallbacks = (0..200)
            .filter(|i| distribution.sample(1, *i, 0) == ["terminal"])
            .count();
        assert!(fallbacks >= 199, "{fallbacks}");
    }

    fn entries(entries: &[(&str, f64)]) -> Distribution {
        Distribution {
            name: "test".to_owned(),
            description: String::new(),
            entries: entries
                .iter()
                .map(|(entry, percent)| ((*entry).to_owned(), *percent))
                .collect(),
        }
    }

    #[test]
    fn one_draw_offers_every_member_of_a_group_or_none() {
        let browser_tasks = builtin()
            .into_iter()
            .find(|d| d.name == "browser_tasks")
            .unwrap();
        let mut with_browser = 0;
        for prompt in 0..2000 {
            let toolsets = browser_tasks.sample(7, prompt, 0);
            let browser = toolsets.iter().any(|t| t == "browser");
            let search = toolsets.iter().any(|t| t == "search");
            assert_eq!(browser, search, "prompt {prompt}: {toolsets:?}");
            with_browser += usize::from(browser);
        }
        // 97% drawn, plus the fallback when nothing is: about 1,940 of 2,000.
        assert!((1900..=1980).contains(&with_browser), "{with_browser}");
    }

    #[test]
    fn toolsets_follow_declaration_order_with_a_group_in_its_own_order_each_once() {
        let all = entries(&[
            ("terminal", 100.0),
            ("browser+search", 100.0),
            ("file", 100.0),
            ("search+web", 100.0),
        ]);
        assert_eq!(
            all.sample(1, 0, 0),
            ["terminal", "browser", "search", "file", "web"]
        );
        assert_eq!(
            all.possible_toolsets(),
            ["terminal", "browser", "search", "file", "web"]
        );
    }

    #[test]
    fn the_fallback_is_the_most_probable_entry_the_first_on_ties_with_all_its_members() {
        let tied = entries(&[
            ("vision", 0.001),
            ("browser+search", 0.002),
            ("terminal", 0.002),
        ]);
        let fallbacks = (0..200)
            .filter(|i| tied.sample(1, *i, 0) == ["browser", "search"])
            .count();
        assert!(fallbacks >= 199, "{fallbacks}");
    }

    #[test]
    fn known_draws_are_stable_across_releases() {
        // Pinned values: changing the hash silently changes every run's toolsets.
        let balanced =
            Distribution::resolve(&inline(&[("file", 50.0), ("terminal", 50.0)]), &registry())
                .unwrap();
        let draws: Vec<_> = (0..6)
            .map(|i| balanced.sample(42, i, 0).join("+"))
            .collect();
        assert_eq!(draws, PINNED_DRAWS);
        // A group is drawn once, on its entry's name.
        let grouped = entries(&[("web+file", 50.0), ("terminal", 50.0)]);
        let draws: Vec<_> = (0..6).map(|i| grouped.sample(42, i, 0).join(" ")).collect();
        assert_eq!(draws, PINNED_GROUP_DRAWS);
    }

    const PINNED_GROUP_DRAWS: [&str; 6] = [
        "terminal",
        "web file terminal",
        "terminal",
        "web file",
        "web file",
        "web file",
    ];

    const PINNED_DRAWS: [&str; 6] = [
        "file+terminal",
        "file+terminal",
        "file+terminal",
        "file",
        "file",
        "file",
    ];

    proptest! {
        #[test]
        fn sampling_is_a_pure_function_of_its_inputs(seed: u64, prompt in 0u64..1_000_000, sample in 0u32..8) {
            let d = Distribution::resolve(&inline(&[("file", 37.0), ("terminal", 63.0)]), &registry()).unwrap();
            prop_assert_eq!(d.sample(seed, prompt, sample), d.sample(seed, prompt, sample));
            prop_assert!(!d.sample(seed, prompt, sample).is_empty());
        }
    }

    /// Each toolset is drawn at its percentage. The draws are a pure function of (seed, prompt,
    /// sample), so the seeds and percentages are fixed and the test gives the same answer every
    /// run. It was a property test of random seeds within four standard deviations: now and then
    /// one of its 256 cases a run fell past them by chance (seed 6650797371240038464 at 50.929 %:
    /// 4.08), and from then on it failed every run, as proptest replays a failure first.
    #[test]
    fn inclusion_rates_match_the_percentages() {
        const PROMPTS: u32 = 4000;
        for seed in [0, 1, 7, 42, 1_000_003, 6_650_797_371_240_038_464, u64::MAX] {
            for percent in [5.0, 12.5, 25.0, 37.5, 50.0, 50.929, 62.5, 75.0, 87.5, 95.0] {
                let d = Distribution::resolve(
                    &inline(&[("file", percent), ("terminal", 100.0)]),
                    &registry(),
                )
                .unwrap();
                let hits = (0..u64::from(PROMPTS))
                    .filter(|i| d.sample(seed, *i, 0).iter().any(|t| t == "file"))
                    .count();
                let rate = f64::from(u32::try_from(hits).unwrap()) / f64::from(PROMPTS) * 100.0;
                // Within five binomial standard deviations of its percentage (at most 4 points).
                let deviation = (percent * (100.0 - percent) / f64::from(PROMPTS)).sqrt();
                assert!(
                    (rate - percent).abs() < 5.0 * deviation,
                    "seed {seed}: rate {rate} for {percent}% (5 sd = {})",
                    5.0 * deviation
                );
            }
        }
    }
}
