//! `statistics.json`'s `cost`: what the kept records' model calls cost, by kind of token, summed
//! from each record's `cost` (the run's prices or the provider's figures, applied call by call
//! while the conversation ran).

use serde::Deserialize;

use crate::pricing::{ByTier, PriceTier};
use serde_json::{Value, json};

/// A record's `cost`, as merge reads it.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
pub struct CostView {
    #[serde(default)]
    input: f64,
    #[serde(default)]
    cached_input: f64,
    #[serde(default)]
    cache_write: f64,
    #[serde(default)]
    output: f64,
    #[serde(default)]
    total: f64,
    /// Calls and cost per service tier, when any was not the standard one.
    #[serde(default)]
    tiers: ByTier,
    /// What the calls would have cost at the standard tier, likewise.
    #[serde(default)]
    at_standard: Option<f64>,
}

/// Running totals of the records' costs.
#[derive(Debug, Default, Clone, Copy)]
pub struct Costs {
    records: u64,
    trajectories: u64,
    trajectories_total: f64,
    sum: CostView,
    /// What the records' calls would have cost at the standard tier.
    at_standard: f64,
}

impl Costs {
    /// Counts a kept record's cost; `trajectory`: the record is one of `trajectories.jsonl`.
    pub fn add(&mut self, cost: &CostView, trajectory: bool) {
        self.records += 1;
        if trajectory {
            self.trajectories += 1;
            self.trajectories_total += cost.total;
        }
        self.add_sum(cost, cost.at_standard.unwrap_or(cost.total));
    }

    pub fn absorb(&mut self, other: Self) {
        self.records += other.records;
        self.trajectories += other.trajectories;
        self.trajectories_total += other.trajectories_total;
        self.add_sum(&other.sum, other.at_standard);
    }

    /// Adds `other`, whose calls would have cost `at_standard` at the standard tier.
    fn add_sum(&mut self, other: &CostView, at_standard: f64) {
        self.sum.tiers.add(other.tiers);
        self.at_standard += at_standard;
        self.sum.input += other.input;
        self.sum.cached_input += other.cached_input;
        self.sum.cache_write += other.cache_write;
        self.sum.output += other.output;
        self.sum.total += other.total;
    }

    /// The run's total in USD, `None` when no record was priced.
    pub fn total(&self) -> Option<f64> {
        (self.records > 0).then_some(self.sum.total)
    }

    /// `statistics.json`'s `cost`; `None` when no record was priced.
    pub fn summary(&self) -> Option<Value> {
        if self.records == 0 {
            return None;
        }
        #[allow(clippy::cast_precision_loss)] // record counts stay far below 2^52
        let per_trajectory = if self.trajectories == 0 {
            0.0
        } else {
            self.trajectories_total / self.trajectories as f64
        };
        let mut summary = json!({
            "currency": "USD",
            "total": usd(self.sum.total),
            "input": usd(self.sum.input),
            "cached_input": usd(self.sum.cached_input),
            "cache_write": usd(self.sum.cache_write),
            "output": usd(self.sum.output),
            "records_priced": self.records,
            "per_trajectory": usd(per_trajectory),
        });
        if !self.sum.tiers.only_standard() {
            let tiers: serde_json::Map<String, Value> = PriceTier::ALL
                .iter()
                .map(|tier| (tier.as_str(), self.sum.tiers.get(*tier)))
                .filter(|(_, spent)| spent.calls > 0)
                .map(|(name, spent)| {
                    (
                        name.to_owned(),
                        json!({"calls": spent.calls, "total": usd(spent.total)}),
                    )
                })
                .collect();
            summary["tiers"] = Value::Object(tiers);
            summary["at_standard"] = usd(self.at_standard).into();
            summary["saved"] = usd(self.at_standard - self.sum.total).into();
        }
        Some(summary)
    }
}

/// USD to the cent's millionth (1e-8), where summing floating-point costs leaves its noise.
pub fn usd(amount: f64) -> f64 {
    (amount * 1e8).round() / 1e8
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(input: f64, output: f64) -> CostView {
        CostView {
            input,
            output,
            total: input + output,
            ..CostView::default()
        }
    }

    #[test]
    fn totals_add_up_by_kind_and_per_trajectory() {
        let mut first = Costs::default();
        first.add(&cost(0.1, 0.2), true);
        let mut second = Costs::default();
        second.add(&cost(0.01, 0.02), false);
        second.add(&cost(0.001, 0.002), true);
        first.absorb(second);
        let summary = first.summary().unwrap();
        assert_eq!(summary["total"], 0.333);
        assert_eq!(summary["input"], 0.111);
        assert_eq!(summary["records_priced"], 3);
        assert_eq!(summary["per_trajectory"], 0.1515);
        assert_eq!(Costs::default().summary(), None);
    }
}
