//! What a completion cost: the run's prices (`spec.model.pricing`) applied to each completion's
//! usage, the way `LiteLLM`'s cost function applies its price table, so that a run's figures agree
//! with the tool most users check their bills against (`worker/tests/pricing_golden.rs` holds
//! `LiteLLM`'s own results).
//!
//! Each completion is priced on its own, not the conversation's summed usage: a price tier
//! (`input_cost_per_token_above_200k_tokens`) applies to one request's prompt. Its [`Tokens`]
//! come normalised (the model client's usage): `prompt` counts every input token, cache reads
//! (`cached`) and cache writes (`cache_write`) included, whichever convention the server used. A
//! cost the provider reports itself (`OpenRouter`'s `usage.cost`) is used as it is, unless the run
//! says otherwise.
//!
//! Like [`crate::spec`] it builds with serde alone: [`crate::validate`] refuses prices that
//! cannot be used before any pod starts, with these words.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::spec::{PricingSpec, TierPricingSpec};

/// Prices that cannot be used: which field of `spec.model.pricing`, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PricingError {
    pub field: &'static str,
    pub message: String,
}

impl std::fmt::Display for PricingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "spec.model.pricing.{}: {}", self.field, self.message)
    }
}

impl std::error::Error for PricingError {}

/// The token counts of one completion, in one convention: `prompt` counts every input token,
/// the cache's reads and writes included; `completion` every output token, reasoning included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tokens {
    pub prompt: u64,
    pub cached: u64,
    pub cache_write: u64,
    pub completion: u64,
    pub reasoning: u64,
}

/// USD per token of each kind, for prompts up to a tier's threshold.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rates {
    input: f64,
    output: f64,
    /// Absent: cache reads cost what other input costs.
    cache_read: Option<f64>,
    /// Absent: cache writes cost what other input costs.
    cache_write: Option<f64>,
}

/// The provider's service tier a call was billed at.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum PriceTier {
    /// The provider's default, synchronous tier.
    #[default]
    Standard,
    /// Synchronous, slower, refused when the provider has no capacity, at a lower price
    /// (`OpenAI`'s `service_tier: "flex"`).
    Flex,
    /// Synchronous, faster, at a higher price.
    Priority,
    /// A provider's Batch API: answers within hours, at about half the price.
    Batch,
}

impl PriceTier {
    pub const ALL: [Self; 4] = [Self::Standard, Self::Flex, Self::Priority, Self::Batch];

    /// The name records and statistics give the tier.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Standard => "standard",
            Self::Flex => "flex",
            Self::Priority => "priority",
            Self::Batch => "batch",
        }
    }

    /// The tier a response's `service_tier` names; `None` for one not known here.
    pub fn from_service_tier(name: &str) -> Option<Self> {
        match name {
            "default" | "auto" | "standard" | "scale" | "on_demand" => Some(Self::Standard),
            "flex" => Some(Self::Flex),
            "priority" => Some(Self::Priority),
            _ => None,
        }
    }

    /// The suffix of this tier's rates in `LiteLLM`'s price table.
    fn litellm_suffix(self) -> &'static str {
        match self {
            Self::Standard => "",
            Self::Flex => "_flex",
            Self::Priority => "_priority",
            Self::Batch => "_batches",
        }
    }
}

/// The run's prices, at each service tier.
#[derive(Debug, Clone, PartialEq)]
pub struct Prices {
    /// By [`PriceTier`]'s order.
    tables: [Table; 4],
    /// A cost the provider reports with the usage is taken as the completion's cost.
    prefer_reported: bool,
}

/// One tier's prices.
#[derive(Debug, Clone, PartialEq)]
struct Table {
    base: Rates,
    /// Rates for prompts of more than the threshold's tokens, by ascending threshold; each
    /// overrides what it names, over the tiers below it.
    tiers: Vec<(u64, TierRates)>,
    /// USD per reasoning token, when the model prices them apart from other output.
    reasoning: Option<f64>,
}

impl Table {
    /// Every rate halved: a Batch API's price where the table gives none of its own, as
    /// `LiteLLM` prices it.
    fn halved(&self) -> Self {
        let half = |rate: f64| rate / 2.0;
        let half_tier = |tier: &TierRates| TierRates {
            input: tier.input.map(half),
            output: tier.output.map(half),
            cache_read: tier.cache_read.map(half),
            cache_write: tier.cache_write.map(half),
        };
        Self {
            base: Rates {
                input: half(self.base.input),
                output: half(self.base.output),
                cache_read: self.base.cache_read.map(half),
                cache_write: self.base.cache_write.map(half),
            },
            tiers: self
                .tiers
                .iter()
                .map(|(above, tier)| (*above, half_tier(tier)))
                .collect(),
            reasoning: self.reasoning.map(half),
        }
    }
}

/// What a tier changes; what it leaves out stays as below it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct TierRates {
    input: Option<f64>,
    output: Option<f64>,
    cache_read: Option<f64>,
    cache_write: Option<f64>,
}

/// Where a cost came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CostSource {
    /// The run's prices applied to the usage.
    Prices,
    /// The provider's own figure (`usage.cost`).
    Reported,
    /// Some completions of each.
    Mixed,
}

/// What one completion, or a whole conversation, cost in USD: the parts the prices give (zero
/// for a reported cost, which comes whole) and their total.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    /// Input tokens neither read from nor written to a cache.
    pub input: f64,
    pub cached_input: f64,
    pub cache_write: f64,
    /// Output tokens, reasoning included.
    pub output: f64,
    pub total: f64,
    pub source: CostSource,
    /// The calls and their cost at each service tier, when any was billed at another tier
    /// than the standard one.
    #[serde(default, skip_serializing_if = "ByTier::only_standard")]
    pub tiers: ByTier,
    /// What the same calls would have cost at the standard tier, when any was billed at
    /// another (what the tiers saved, or cost more).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_standard: Option<f64>,
}

/// Calls and their cost at one service tier.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TierSpent {
    pub calls: u32,
    pub total: f64,
}

impl TierSpent {
    fn is_none(&self) -> bool {
        self.calls == 0
    }

    fn add(&mut self, other: Self) {
        self.calls += other.calls;
        self.total += other.total;
    }
}

/// Calls and their cost by service tier.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ByTier {
    #[serde(default, skip_serializing_if = "TierSpent::is_none")]
    pub standard: TierSpent,
    #[serde(default, skip_serializing_if = "TierSpent::is_none")]
    pub flex: TierSpent,
    #[serde(default, skip_serializing_if = "TierSpent::is_none")]
    pub priority: TierSpent,
    #[serde(default, skip_serializing_if = "TierSpent::is_none")]
    pub batch: TierSpent,
}

impl ByTier {
    /// Every call counted was at the standard tier (or none was counted).
    pub fn only_standard(&self) -> bool {
        self.flex.is_none() && self.priority.is_none() && self.batch.is_none()
    }

    pub fn get(&self, tier: PriceTier) -> TierSpent {
        match tier {
            PriceTier::Standard => self.standard,
            PriceTier::Flex => self.flex,
            PriceTier::Priority => self.priority,
            PriceTier::Batch => self.batch,
        }
    }

    fn get_mut(&mut self, tier: PriceTier) -> &mut TierSpent {
        match tier {
            PriceTier::Standard => &mut self.standard,
            PriceTier::Flex => &mut self.flex,
            PriceTier::Priority => &mut self.priority,
            PriceTier::Batch => &mut self.batch,
        }
    }

    /// One call of `total` USD at `tier`.
    fn one(tier: PriceTier, total: f64) -> Self {
        let mut by_tier = Self::default();
        *by_tier.get_mut(tier) = TierSpent { calls: 1, total };
        by_tier
    }

    pub fn add(&mut self, other: Self) {
        for tier in PriceTier::ALL {
            self.get_mut(tier).add(other.get(tier));
        }
    }
}

impl Cost {
    /// A cost the provider reported whole.
    pub fn reported(total: f64) -> Self {
        Self {
            input: 0.0,
            cached_input: 0.0,
            cache_write: 0.0,
            output: 0.0,
            total,
            source: CostSource::Reported,
            tiers: ByTier::default(),
            at_standard: None,
        }
    }

    /// The same cost, counted as one call billed at `tier`, whose tokens would have cost
    /// `at_standard` at the standard tier.
    #[must_use]
    pub fn billed_at(mut self, tier: PriceTier, at_standard: f64) -> Self {
        self.tiers = ByTier::one(tier, self.total);
        self.at_standard = (tier != PriceTier::Standard).then_some(at_standard);
        self
    }

    /// What these calls would have cost at the standard tier.
    pub fn standard_total(&self) -> f64 {
        self.at_standard.unwrap_or(self.total)
    }

    /// This cost and `other`, one after the other.
    pub fn add(&mut self, other: Self) {
        let at_standard = (self.at_standard.is_some() || other.at_standard.is_some())
            .then(|| self.standard_total() + other.standard_total());
        self.input += other.input;
        self.cached_input += other.cached_input;
        self.cache_write += other.cache_write;
        self.output += other.output;
        self.total += other.total;
        if self.source != other.source {
            self.source = CostSource::Mixed;
        }
        self.tiers.add(other.tiers);
        self.at_standard = at_standard;
    }

    /// `total` of a conversation that may have cost nothing priced yet.
    pub fn add_to(total: &mut Option<Self>, other: Self) {
        match total {
            Some(total) => total.add(other),
            None => *total = Some(other),
        }
    }
}

/// Per million tokens, as people quote prices, to per token.
const PER_MILLION: f64 = 1_000_000.0;

impl Prices {
    /// The run's prices: USD per million tokens given inline, or one model's entry of `LiteLLM`'s
    /// price table (`model_prices_and_context_window.json`), never both.
    pub fn from_spec(spec: &PricingSpec) -> Result<Self, PricingError> {
        let inline = [
            spec.input,
            spec.cached_input,
            spec.cache_write,
            spec.output,
            spec.reasoning,
        ]
        .iter()
        .any(Option::is_some)
            || spec.flex.is_some()
            || spec.priority.is_some()
            || spec.batch.is_some();
        let mut prices = match (&spec.litellm, inline) {
            (Some(_), true) => {
                return Err(PricingError {
                    field: "litellm",
                    message: "give LiteLLM's entry or inline prices (input, output, …), not both"
                        .into(),
                });
            }
            (Some(Value::Object(entry)), false) => Self::from_litellm(entry)?,
            (Some(_), false) => {
                return Err(PricingError {
                    field: "litellm",
                    message: "must be an object: one model's entry of LiteLLM's price table".into(),
                });
            }
            (None, _) => Self::inline(spec)?,
        };
        prices.prefer_reported = spec.prefer_reported_cost;
        Ok(prices)
    }

    /// Prices given inline, USD per million tokens; a tier's rates fall back to the standard
    /// ones it leaves out, and a Batch API without rates of its own costs half.
    fn inline(spec: &PricingSpec) -> Result<Self, PricingError> {
        let per_token = |value: Option<f64>, field: &'static str| {
            value
                .map(|value| checked(value, field).map(|value| value / PER_MILLION))
                .transpose()
        };
        let required = |value: Option<f64>, field: &'static str| {
            per_token(value, field)?.ok_or_else(|| PricingError {
                field,
                message: "is required (USD per million tokens)".into(),
            })
        };
        let standard = Table {
            base: Rates {
                input: required(spec.input, "input")?,
                output: required(spec.output, "output")?,
                cache_read: per_token(spec.cached_input, "cachedInput")?,
                cache_write: per_token(spec.cache_write, "cacheWrite")?,
            },
            tiers: Vec::new(),
            reasoning: per_token(spec.reasoning, "reasoning")?,
        };
        let tier = |tier: Option<&TierPricingSpec>, fields: [&'static str; 5]| {
            let Some(tier) = tier else {
                return Ok(None);
            };
            let base = &standard.base;
            Ok::<_, PricingError>(Some(Table {
                base: Rates {
                    input: per_token(tier.input, fields[0])?.unwrap_or(base.input),
                    output: per_token(tier.output, fields[1])?.unwrap_or(base.output),
                    cache_read: per_token(tier.cached_input, fields[2])?.or(base.cache_read),
                    cache_write: per_token(tier.cache_write, fields[3])?.or(base.cache_write),
                },
                tiers: Vec::new(),
                reasoning: per_token(tier.reasoning, fields[4])?.or(standard.reasoning),
            }))
        };
        let flex = tier(spec.flex.as_ref(), TIER_FIELDS.map(|(flex, _, _)| flex))?
            .unwrap_or_else(|| standard.clone());
        let priority = tier(
            spec.priority.as_ref(),
            TIER_FIELDS.map(|(_, priority, _)| priority),
        )?
        .unwrap_or_else(|| standard.clone());
        let batch = tier(spec.batch.as_ref(), TIER_FIELDS.map(|(_, _, batch)| batch))?
            .unwrap_or_else(|| standard.halved());
        Ok(Self {
            tables: [standard, flex, priority, batch],
            prefer_reported: true,
        })
    }

    /// Prices from one entry of `LiteLLM`'s table: `input_cost_per_token`,
    /// `output_cost_per_token`, `cache_read_input_token_cost`,
    /// `cache_creation_input_token_cost`, `output_cost_per_reasoning_token` and the tiers
    /// `<rate>_above_<N>[k]_tokens`; the service tiers' own rates as the same keys ending
    /// `_flex`, `_priority` and `_batches` (a rate a tier lacks is the standard one, and a
    /// model without batch rates costs half in a batch, as `LiteLLM` prices them). Other
    /// fields (audio, image rates) are not what a chat completion of a run is billed at, and
    /// are ignored.
    pub fn from_litellm(entry: &Map<String, Value>) -> Result<Self, PricingError> {
        let standard = litellm_table(entry, PriceTier::Standard)?;
        let flex = litellm_table(entry, PriceTier::Flex)?;
        let priority = litellm_table(entry, PriceTier::Priority)?;
        let has_batch_rates = [
            "input_cost_per_token_batches",
            "output_cost_per_token_batches",
        ]
        .iter()
        .any(|key| entry.get(*key).is_some_and(|value| !value.is_null()));
        let batch = if has_batch_rates {
            litellm_table(entry, PriceTier::Batch)?
        } else {
            standard.halved()
        };
        Ok(Self {
            tables: [standard, flex, priority, batch],
            prefer_reported: true,
        })
    }

    /// What one completion with `usage` (and the provider's own figure, if it sent one) cost,
    /// billed at `tier`.
    pub fn cost(&self, usage: Tokens, reported: Option<f64>, tier: PriceTier) -> Cost {
        if let Some(total) = reported.filter(|_| self.prefer_reported) {
            return Cost::reported(total).billed_at(tier, total);
        }
        let cost = self.tables[tier as usize].cost(usage);
        let at_standard = if tier == PriceTier::Standard {
            cost.total
        } else {
            self.tables[PriceTier::Standard as usize].cost(usage).total
        };
        cost.billed_at(tier, at_standard)
    }
}

/// Per service tier, the fields of `spec.model.pricing` naming its inline rates (input,
/// output, cached input, cache write, reasoning).
const TIER_FIELDS: [(&str, &str, &str); 5] = [
    ("flex.input", "priority.input", "batch.input"),
    ("flex.output", "priority.output", "batch.output"),
    (
        "flex.cachedInput",
        "priority.cachedInput",
        "batch.cachedInput",
    ),
    ("flex.cacheWrite", "priority.cacheWrite", "batch.cacheWrite"),
    ("flex.reasoning", "priority.reasoning", "batch.reasoning"),
];

/// One service tier's prices of a `LiteLLM` entry: each rate's key with the tier's suffix,
/// else the standard key; thresholds of either kind, the tier's own winning at the same one
/// (a batch's: its own only).
fn litellm_table(entry: &Map<String, Value>, tier: PriceTier) -> Result<Table, PricingError> {
    let suffix = tier.litellm_suffix();
    let value = |key: &str| -> Result<Option<f64>, PricingError> {
        match entry.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => value
                .as_f64()
                .ok_or_else(|| PricingError {
                    field: "litellm",
                    message: format!("{key} is not a number: {value}"),
                })
                .and_then(|value| checked(value, "litellm").map(Some)),
        }
    };
    let rate = |key: &str| -> Result<Option<f64>, PricingError> {
        match value(&format!("{key}{suffix}"))? {
            Some(rate) => Ok(Some(rate)),
            None => value(key),
        }
    };
    let required = |key: &str| {
        rate(key)?.ok_or_else(|| PricingError {
            field: "litellm",
            message: format!("the entry has no {key}"),
        })
    };
    let mut tiers: Vec<(u64, TierRates)> = Vec::new();
    // The standard thresholds first, so that the tier's own override them.
    let mut keys: Vec<(&str, RateKind, u64, bool)> = entry
        .keys()
        .filter_map(|key| {
            let (kind, threshold, key_suffix) = tier_key(key)?;
            let own = !key_suffix.is_empty();
            // A batch's thresholds are its own only, as LiteLLM prices batches.
            let counts = if own {
                key_suffix == suffix
            } else {
                tier != PriceTier::Batch
            };
            counts.then_some((key.as_str(), kind, threshold, own))
        })
        .collect();
    keys.sort_by_key(|(_, _, _, own)| *own);
    for (key, kind, threshold, _) in keys {
        let Some(value) = value(key)? else { continue };
        let at = match tiers.binary_search_by_key(&threshold, |(above, _)| *above) {
            Ok(at) => at,
            Err(at) => {
                tiers.insert(at, (threshold, TierRates::default()));
                at
            }
        };
        let rates = &mut tiers[at].1;
        match kind {
            RateKind::Input => rates.input = Some(value),
            RateKind::Output => rates.output = Some(value),
            RateKind::CacheRead => rates.cache_read = Some(value),
            RateKind::CacheWrite => rates.cache_write = Some(value),
        }
    }
    Ok(Table {
        base: Rates {
            input: required("input_cost_per_token")?,
            output: required("output_cost_per_token")?,
            cache_read: rate("cache_read_input_token_cost")?,
            cache_write: rate("cache_creation_input_token_cost")?,
        },
        tiers,
        reasoning: rate("output_cost_per_reasoning_token")?,
    })
}

impl Table {
    /// What one completion with `usage` costs at these rates.
    fn cost(&self, usage: Tokens) -> Cost {
        let rates = self.rates_for(usage.prompt);
        let uncached = usage
            .prompt
            .saturating_sub(usage.cached + usage.cache_write);
        let input = tokens(uncached) * rates.input;
        let cached_input = tokens(usage.cached) * rates.cache_read.unwrap_or(rates.input);
        let cache_write = tokens(usage.cache_write) * rates.cache_write.unwrap_or(rates.input);
        // Reasoning tokens are part of the completion's; priced apart only where the model
        // has a rate of its own for them.
        let reasoning = usage.reasoning.min(usage.completion);
        let output = match self.reasoning {
            Some(reasoning_rate) if reasoning > 0 => {
                tokens(usage.completion - reasoning) * rates.output
                    + tokens(reasoning) * reasoning_rate
            }
            _ => tokens(usage.completion) * rates.output,
        };
        Cost {
            input,
            cached_input,
            cache_write,
            output,
            // As LiteLLM sums them: the prompt's parts, then the completion.
            total: input + cached_input + cache_write + output,
            source: CostSource::Prices,
            tiers: ByTier::default(),
            at_standard: None,
        }
    }

    /// The rates of a prompt of `prompt_tokens` tokens: each tier it exceeds, in turn.
    fn rates_for(&self, prompt_tokens: u64) -> Rates {
        let mut rates = self.base;
        for (above, tier) in &self.tiers {
            if prompt_tokens <= *above {
                break;
            }
            rates.input = tier.input.unwrap_or(rates.input);
            rates.output = tier.output.unwrap_or(rates.output);
            rates.cache_read = tier.cache_read.or(rates.cache_read);
            rates.cache_write = tier.cache_write.or(rates.cache_write);
        }
        rates
    }
}

#[allow(clippy::cast_precision_loss)] // token counts stay far below 2^52
fn tokens(count: u64) -> f64 {
    count as f64
}

fn checked(value: f64, field: &'static str) -> Result<f64, PricingError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(PricingError {
            field,
            message: format!("{value} is not a price (a number of at least 0)"),
        })
    }
}

enum RateKind {
    Input,
    Output,
    CacheRead,
    CacheWrite,
}

/// A threshold's key, `<rate>_above_<N>[k]_tokens[<service tier suffix>]`: which rate, above
/// how many prompt tokens, and the service tier's suffix (empty for the standard tier's).
fn tier_key(key: &str) -> Option<(RateKind, u64, &str)> {
    let (rate, rest) = key.split_once("_above_")?;
    let kind = match rate {
        "input_cost_per_token" => RateKind::Input,
        "output_cost_per_token" => RateKind::Output,
        "cache_read_input_token_cost" => RateKind::CacheRead,
        "cache_creation_input_token_cost" => RateKind::CacheWrite,
        _ => return None,
    };
    let (count, suffix) = rest.split_once("_tokens")?;
    if !(suffix.is_empty()
        || PriceTier::ALL
            .iter()
            .any(|tier| tier.litellm_suffix() == suffix))
    {
        return None;
    }
    let threshold = match count.strip_suffix('k') {
        Some(thousands) => thousands.parse::<u64>().ok()?.checked_mul(1000)?,
        None => count.parse().ok()?,
    };
    Some((kind, threshold, suffix))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn usage(prompt: u64, cached: u64, written: u64, completion: u64, reasoning: u64) -> Tokens {
        Tokens {
            prompt,
            cached,
            cache_write: written,
            completion,
            reasoning,
        }
    }

    fn inline(input: f64, output: f64) -> PricingSpec {
        PricingSpec {
            input: Some(input),
            output: Some(output),
            ..PricingSpec::default()
        }
    }

    #[test]
    fn inline_prices_are_per_million_tokens_and_cache_reads_default_to_input() {
        let prices = Prices::from_spec(&inline(2.0, 8.0)).unwrap();
        let cost = prices.cost(
            usage(1_000_000, 250_000, 0, 500_000, 0),
            None,
            PriceTier::Standard,
        );
        assert!((cost.input - 1.5).abs() < 1e-12, "{cost:?}");
        assert!((cost.cached_input - 0.5).abs() < 1e-12);
        assert!((cost.output - 4.0).abs() < 1e-12);
        assert!((cost.total - 6.0).abs() < 1e-12);
        assert_eq!(cost.source, CostSource::Prices);
    }

    #[test]
    fn a_reported_cost_is_taken_whole_unless_the_run_says_otherwise() {
        let mut spec = inline(2.0, 8.0);
        let reported = Prices::from_spec(&spec).unwrap().cost(
            usage(1000, 0, 0, 10, 0),
            Some(0.0123),
            PriceTier::Standard,
        );
        assert_eq!(
            (reported.total, reported.source),
            (0.0123, CostSource::Reported)
        );
        spec.prefer_reported_cost = false;
        let from_prices = Prices::from_spec(&spec).unwrap().cost(
            usage(1000, 0, 0, 10, 0),
            Some(0.0123),
            PriceTier::Standard,
        );
        assert_eq!(from_prices.source, CostSource::Prices);
        let mut total = reported;
        total.add(from_prices);
        assert_eq!(total.source, CostSource::Mixed);
    }

    #[test]
    fn each_tier_has_its_inline_prices_and_the_totals_keep_what_standard_would_cost() {
        let spec = PricingSpec {
            flex: Some(TierPricingSpec {
                input: Some(1.0),
                output: Some(4.0),
                ..TierPricingSpec::default()
            }),
            priority: Some(TierPricingSpec {
                output: Some(16.0),
                ..TierPricingSpec::default()
            }),
            ..inline(2.0, 8.0)
        };
        let prices = Prices::from_spec(&spec).unwrap();
        let call = usage(1_000_000, 0, 0, 1_000_000, 0);
        let total = |tier| prices.cost(call, None, tier).total;
        assert!((total(PriceTier::Standard) - 10.0).abs() < 1e-9);
        assert!((total(PriceTier::Flex) - 5.0).abs() < 1e-9);
        assert!(
            (total(PriceTier::Priority) - 18.0).abs() < 1e-9,
            "input left out: the standard price"
        );
        assert!(
            (total(PriceTier::Batch) - 5.0).abs() < 1e-9,
            "no batch prices: half"
        );

        let mut spent = prices.cost(call, None, PriceTier::Standard);
        assert_eq!(
            (spent.at_standard, spent.tiers.only_standard()),
            (None, true)
        );
        spent.add(prices.cost(call, None, PriceTier::Flex));
        spent.add(prices.cost(call, None, PriceTier::Flex));
        assert!((spent.total - 20.0).abs() < 1e-9);
        assert!((spent.standard_total() - 30.0).abs() < 1e-9);
        assert_eq!((spent.tiers.standard.calls, spent.tiers.flex.calls), (1, 2));
        assert!((spent.tiers.flex.total - 10.0).abs() < 1e-9);
        let recorded: Cost = serde_json::from_value(serde_json::to_value(spent).unwrap()).unwrap();
        assert_eq!(recorded, spent, "a turn log keeps the tiers");
    }

    #[test]
    fn bad_prices_name_their_field() {
        let both = PricingSpec {
            litellm: Some(json!({"input_cost_per_token": 1e-6, "output_cost_per_token": 1e-6})),
            ..inline(1.0, 1.0)
        };
        let errors = [
            both,
            PricingSpec {
                input: Some(1.0),
                ..PricingSpec::default()
            },
            inline(-1.0, 1.0),
            PricingSpec {
                litellm: Some(json!({"input_cost_per_token": 1e-6})),
                ..PricingSpec::default()
            },
            PricingSpec {
                litellm: Some(json!({"input_cost_per_token": "cheap", "output_cost_per_token": 1})),
                ..PricingSpec::default()
            },
            PricingSpec {
                batch: Some(TierPricingSpec {
                    cached_input: Some(f64::NAN),
                    ..TierPricingSpec::default()
                }),
                ..inline(1.0, 1.0)
            },
        ]
        .map(|spec| Prices::from_spec(&spec).unwrap_err().to_string());
        assert_eq!(
            errors,
            [
                "spec.model.pricing.litellm: give LiteLLM's entry or inline prices (input, output, …), not both",
                "spec.model.pricing.output: is required (USD per million tokens)",
                "spec.model.pricing.input: -1 is not a price (a number of at least 0)",
                "spec.model.pricing.litellm: the entry has no output_cost_per_token",
                "spec.model.pricing.litellm: input_cost_per_token is not a number: \"cheap\"",
                "spec.model.pricing.batch.cachedInput: NaN is not a price (a number of at least 0)",
            ]
        );
    }

    #[test]
    fn tier_keys_name_their_rate_and_threshold() {
        let parsed = |key| tier_key(key).map(|(_, above, suffix)| (above, suffix));
        assert_eq!(
            parsed("input_cost_per_token_above_200k_tokens"),
            Some((200_000, ""))
        );
        assert_eq!(
            parsed("output_cost_per_token_above_128_tokens"),
            Some((128, ""))
        );
        assert_eq!(
            parsed("input_cost_per_token_above_200k_tokens_priority"),
            Some((200_000, "_priority"))
        );
        assert_eq!(
            parsed("input_cost_per_token_above_200k_tokens_regional"),
            None
        );
        assert_eq!(parsed("cache_creation_input_token_cost_above_1hr"), None);
        assert_eq!(parsed("input_cost_per_token_batches"), None);
    }
}
