//! `statistics.json`'s `verification`: what the rows' verifiers found, over the kept records
//! that were verified (trajectories, and the conversations `minReward` discarded, whose records
//! keep their reward).

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// Verified records of one group: how many, how many passed, their rewards' sum.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Group {
    verified: u64,
    passed: u64,
    reward_sum: f64,
}

impl Group {
    fn add(&mut self, reward: f64, passed: bool) {
        self.verified += 1;
        self.passed += u64::from(passed);
        self.reward_sum += reward;
    }

    fn absorb(&mut self, other: Self) {
        self.verified += other.verified;
        self.passed += other.passed;
        self.reward_sum += other.reward_sum;
    }

    fn to_json(self) -> Value {
        json!({
            "verified": self.verified,
            "passed": self.passed,
            "pass_rate": super::merge::rate(self.passed, self.verified),
            "mean_reward": mean(self.reward_sum, self.verified),
        })
    }
}

fn mean(sum: f64, count: u64) -> f64 {
    if count == 0 {
        0.0
    } else {
        round4(sum / count as f64)
    }
}

fn round4(value: f64) -> f64 {
    (value * 10_000.0).round() / 10_000.0
}

/// What one verified record says, as merge reads it.
#[derive(Debug, Clone, Copy)]
pub struct VerifiedRecord<I> {
    pub reward: f64,
    pub passed: bool,
    /// The verifier gave no reward of its own (it could not run, timed out, …).
    pub failed: bool,
    /// The toolsets the conversation was offered, in their drawn order.
    pub toolsets: I,
    pub below_reward: bool,
}

/// Running totals of the verified records.
#[derive(Debug, Default)]
pub struct Rewards {
    all: Group,
    /// Verifiers that gave no reward of their own.
    errors: u64,
    below_reward: u64,
    values: Vec<f64>,
    by_toolset: BTreeMap<String, Group>,
    /// By the set of toolsets drawn together (`terminal+file`): the distribution's outcomes.
    by_draw: BTreeMap<String, Group>,
}

impl Rewards {
    pub fn add<'a, I: Iterator<Item = &'a str> + Clone>(&mut self, record: VerifiedRecord<I>) {
        self.all.add(record.reward, record.passed);
        self.errors += u64::from(record.failed);
        self.below_reward += u64::from(record.below_reward);
        self.values.push(record.reward);
        for toolset in record.toolsets.clone() {
            self.by_toolset
                .entry(toolset.to_owned())
                .or_default()
                .add(record.reward, record.passed);
        }
        let draw: Vec<&str> = record.toolsets.collect();
        self.by_draw
            .entry(draw.join("+"))
            .or_default()
            .add(record.reward, record.passed);
    }

    /// Verified records counted.
    pub fn verified(&self) -> u64 {
        self.all.verified
    }

    /// Of those, the ones that passed.
    pub fn passed(&self) -> u64 {
        self.all.passed
    }

    pub fn absorb(&mut self, other: Self) {
        self.all.absorb(other.all);
        self.errors += other.errors;
        self.below_reward += other.below_reward;
        self.values.extend(other.values);
        for (name, group) in other.by_toolset {
            self.by_toolset.entry(name).or_default().absorb(group);
        }
        for (name, group) in other.by_draw {
            self.by_draw.entry(name).or_default().absorb(group);
        }
    }

    /// `statistics.json`'s `verification`; `None` when no kept record was verified.
    pub fn summary(&mut self) -> Option<Value> {
        if self.all.verified == 0 {
            return None;
        }
        let mut summary = self.all.to_json();
        summary["verifier_errors"] = self.errors.into();
        summary["below_reward"] = self.below_reward.into();
        summary["reward"] = distribution(&mut self.values);
        summary["by_toolset"] = groups(&self.by_toolset);
        summary["by_toolsets_drawn"] = groups(&self.by_draw);
        Some(summary)
    }
}

fn groups(groups: &BTreeMap<String, Group>) -> Value {
    Value::Object(
        groups
            .iter()
            .map(|(name, group)| (name.clone(), group.to_json()))
            .collect(),
    )
}

/// Most distinct rewards a distribution lists one by one; more are counted in ten bins.
const MAX_LISTED_VALUES: usize = 20;

/// The rewards' range, mean and median, and how many took each value (or fell in each of ten
/// equal bins between the least and the greatest, when they take many values).
fn distribution(rewards: &mut [f64]) -> Value {
    rewards.sort_unstable_by(f64::total_cmp);
    let (Some(&min), Some(&max)) = (rewards.first(), rewards.last()) else {
        return Value::Null;
    };
    let median = rewards[(rewards.len() - 1) / 2];
    let mut counts: Vec<(f64, u64)> = Vec::new();
    for &reward in rewards.iter() {
        match counts.last_mut() {
            // Equal as stored: sorted, equal rewards are neighbours.
            Some((value, count)) if value.total_cmp(&reward).is_eq() => *count += 1,
            _ => counts.push((reward, 1)),
        }
    }
    let counts: serde_json::Map<String, Value> = if counts.len() <= MAX_LISTED_VALUES {
        counts
            .into_iter()
            .map(|(value, count)| (format!("{value}"), count.into()))
            .collect()
    } else {
        let width = (max - min) / 10.0;
        let mut bins = [0_u64; 10];
        for &reward in rewards.iter() {
            // Truncation picks the bin; the greatest value belongs to the last one.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let bin = (((reward - min) / width) as usize).min(9);
            bins[bin] += 1;
        }
        bins.iter()
            .enumerate()
            .map(|(bin, count)| {
                let low = min + width * bin as f64;
                (
                    format!("{}..{}", round4(low), round4(low + width)),
                    (*count).into(),
                )
            })
            .collect()
    };
    let sum: f64 = rewards.iter().sum();
    json!({
        "min": min,
        "mean": mean(sum, rewards.len() as u64),
        "median": median,
        "max": max,
        "counts": counts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record<'a>(
        reward: f64,
        passed: bool,
        toolsets: &'a [&'a str],
    ) -> VerifiedRecord<impl Iterator<Item = &'a str> + Clone> {
        VerifiedRecord {
            reward,
            passed,
            failed: false,
            toolsets: toolsets.iter().copied(),
            below_reward: !passed,
        }
    }

    #[test]
    fn pass_rates_and_rewards_are_counted_overall_per_toolset_and_per_draw() {
        let mut first = Rewards::default();
        first.add(record(1.0, true, &["terminal", "file"]));
        first.add(record(0.0, false, &["terminal"]));
        let mut second = Rewards::default();
        second.add(record(1.0, true, &["terminal"]));
        second.add(VerifiedRecord {
            failed: true,
            ..record(0.0, false, &["file"])
        });
        first.absorb(second);
        let summary = first.summary().unwrap();
        assert_eq!(summary["verified"], 4);
        assert_eq!(summary["passed"], 2);
        assert_eq!(summary["pass_rate"], 50.0);
        assert_eq!(summary["mean_reward"], 0.5);
        assert_eq!(summary["verifier_errors"], 1);
        assert_eq!(summary["below_reward"], 2);
        assert_eq!(
            summary["reward"],
            json!({"min": 0.0, "mean": 0.5, "median": 0.0, "max": 1.0,
                   "counts": {"0": 2, "1": 2}})
        );
        assert_eq!(summary["by_toolset"]["terminal"]["verified"], 3);
        assert_eq!(summary["by_toolset"]["terminal"]["passed"], 2);
        assert_eq!(summary["by_toolset"]["file"]["pass_rate"], 50.0);
        assert_eq!(summary["by_toolsets_drawn"]["terminal+file"]["passed"], 1);
        assert_eq!(summary["by_toolsets_drawn"]["terminal"]["verified"], 2);
        assert!(Rewards::default().summary().is_none());
    }

    #[test]
    fn many_distinct_rewards_are_counted_in_ten_bins() {
        let mut rewards: Vec<f64> = (0..=100).map(|step| f64::from(step) / 100.0).collect();
        let summary = distribution(&mut rewards);
        let counts = summary["counts"].as_object().unwrap();
        assert_eq!(counts.len(), 10);
        assert_eq!(
            counts.values().map(|c| c.as_u64().unwrap()).sum::<u64>(),
            101
        );
        assert_eq!(counts["0.9..1"], 11, "{counts:?}");
        assert_eq!(summary["median"], 0.5);
    }
}
