//! Toolset distributions: which toolsets a prompt's agent is offered.
//!
//! The reference's semantics, made reproducible: every toolset of a distribution is drawn
//! independently with its probability (a Bernoulli trial, not a weighted choice; the percentages
//! need not sum to 100), and when none is drawn the most probable one is taken. The draws are a
//! pure function of `(seed, prompt_index, sample, toolset)`, so the same run gives the same
//! toolsets on every machine and every retry.

use std::collections::BTreeMap;

use crate::spec::DistributionSpec;
use crate::tools::{Availability, Registry};
use crate::toolsets::BUILTIN_DISTRIBUTIONS as BUILTIN;

/// A distribution: toolsets with inclusion probabilities in percent, in declaration order.
#[derive(Debug, Clone, PartialEq)]
pub struct Distribution {
    pub name: String,
    pub description: String,
    pub toolsets: Vec<(String, f64)>,
}

/// Why a distribution cannot be used; each names the field and value at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DistributionError {
    #[error("spec.distribution: unknown distribution {0:?}; known: {1}")]
    UnknownName(String, String),
    #[error("spec.distribution.{0}: unknown toolset {0:?}; known: {1}")]
    UnknownToolset(String, String),
    #[error("spec.distribution.{toolset}: percent must be between 0 and 100, got {percent}")]
    Percent { toolset: String, percent: f64 },
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
    BUILTIN
        .iter()
        .map(|(name, description, toolsets)| Distribution {
            name: (*name).to_owned(),
            description: (*description).to_owned(),
            toolsets: toolsets
                .iter()
                .map(|(toolset, percent)| ((*toolset).to_owned(), *percent))
                .collect(),
        })
        .collect()
}

impl Distribution {
    /// Resolves the spec into a distribution this build can serve, or says why not.
    pub fn resolve(
        spec: &DistributionSpec,
        registry: &Registry,
    ) -> Result<Self, DistributionError> {
        let distribution = match spec {
            DistributionSpec::Named(name) => builtin()
                .into_iter()
                .find(|d| &d.name == name)
                .ok_or_else(|| {
                    let known: Vec<_> = BUILTIN.iter().map(|(name, ..)| *name).collect();
                    DistributionError::UnknownName(name.clone(), known.join(", "))
                })?,
            DistributionSpec::Inline(map) => Self::inline(map),
        };
        let known: Vec<_> = registry.toolset_names().collect();
        for (toolset, percent) in &distribution.toolsets {
            if !(0.0..=100.0).contains(percent) {
                return Err(DistributionError::Percent {
                    toolset: toolset.clone(),
                    percent: *percent,
                });
            }
            let Some(entry) = registry.toolset(toolset) else {
                return Err(DistributionError::UnknownToolset(
                    toolset.clone(),
                    known.join(", "),
                ));
            };
            if let Availability::Unavailable(hint) = &entry.availability
                && *percent > 0.0
            {
                return Err(DistributionError::Unavailable {
                    distribution: distribution.name.clone(),
                    toolset: toolset.clone(),
                    percent: *percent,
                    hint: hint.clone(),
                });
            }
        }
        if distribution
            .toolsets
            .iter()
            .all(|(_, percent)| *percent <= 0.0)
        {
            return Err(DistributionError::Empty);
        }
        Ok(distribution)
    }

    fn inline(map: &BTreeMap<String, f64>) -> Self {
        Self {
            name: "inline".to_owned(),
            description: "Inline distribution from the spec".to_owned(),
            toolsets: map
                .iter()
                .map(|(toolset, percent)| (toolset.clone(), *percent))
                .collect(),
        }
    }

    /// Every toolset this distribution can draw (probability above 0), in declaration order.
    pub fn possible_toolsets(&self) -> Vec<String> {
        self.toolsets
            .iter()
            .filter(|(_, percent)| *percent > 0.0)
            .map(|(toolset, _)| toolset.clone())
            .collect()
    }

    /// The toolsets of one (prompt, sample): independent draws, falling back to the most probable
    /// toolset (the first on ties) when none is drawn.
    pub fn sample(&self, seed: u64, prompt_index: u64, sample: u32) -> Vec<String> {
        let mut chosen: Vec<String> = self
            .toolsets
            .iter()
            .filter(|(toolset, percent)| {
                unit_draw(seed, prompt_index, sample, toolset) * 100.0 < *percent
            })
            .map(|(toolset, _)| toolset.clone())
            .collect();
        if chosen.is_empty() {
            let mut best: Option<&(String, f64)> = None;
            for entry in &self.toolsets {
                if best.is_none_or(|(_, percent)| entry.1 > *percent) {
                    best = Some(entry);
                }
            }
            chosen.extend(best.map(|(toolset, _)| toolset.clone()));
        }
        chosen
    }
}

/// A uniform draw in [0, 1) from the inputs alone. `SplitMix64`'s finaliser over the seed, the
/// prompt, the sample and an FNV-1a hash of the toolset name: stable across platforms and
/// releases, which a library RNG's stream does not promise.
fn unit_draw(seed: u64, prompt_index: u64, sample: u32, toolset: &str) -> f64 {
    let mut name_hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in toolset.bytes() {
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
                .all(|d| d.toolsets.iter().all(|(t, _)| t != "moa"))
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
    }

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

        #[test]
        fn inclusion_rates_match_the_percentages(seed: u64, percent in 5.0f64..95.0) {
            let d = Distribution::resolve(&inline(&[("file", percent), ("terminal", 100.0)]), &registry()).unwrap();
            let n = 4000u32;
            let hits = (0..u64::from(n)).filter(|i| d.sample(seed, *i, 0).iter().any(|t| t == "file")).count();
            let rate = hits as f64 / f64::from(n) * 100.0;
            // Binomial standard deviation is at most 0.8 points at n = 4000; allow 4 of them.
            prop_assert!((rate - percent).abs() < 3.2, "rate {} for {}%", rate, percent);
        }
    }
}
