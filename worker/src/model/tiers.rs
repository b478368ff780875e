//! Service tiers (`spec.model.serviceTier`): every call asks the provider for one, such as the
//! flex tier's Batch-API price for slower answers, and is billed at the tier it was served at.
//! A provider without capacity at the tier refuses with a 429, which slows the run's calls down
//! as any "slow down" does; a call refused for longer than the run allows goes at the standard
//! tier instead, so that a run is not held up by a tier's capacity.

use std::time::{Duration, Instant};

use serde_json::Value;
use tracing::info;

use crate::pricing::PriceTier;
use crate::spec::{ServiceTier, ServiceTierSpec};

/// The request field naming the tier.
pub(super) const SERVICE_TIER: &str = "service_tier";

/// The service tier every call asks for, and when a refused call gives up on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceTierSettings {
    pub tier: ServiceTier,
    /// How long a call refused at the tier keeps asking it before it goes at the standard one.
    pub fallback_after: Option<Duration>,
}

impl ServiceTierSettings {
    pub fn from_spec(spec: &ServiceTierSpec) -> Self {
        Self {
            tier: spec.tier,
            fallback_after: spec.fallback_after_seconds.map(Duration::from_secs),
        }
    }

    /// The price the tier is billed at.
    pub fn price_tier(self) -> PriceTier {
        match self.tier {
            ServiceTier::Flex => PriceTier::Flex,
            ServiceTier::Priority => PriceTier::Priority,
        }
    }
}

/// One call's way through its tier: asked until the provider has refused it for the run's
/// `fallbackAfterSeconds`, then the standard tier.
#[derive(Debug)]
pub(super) struct CallTier {
    asked: Option<ServiceTierSettings>,
    /// When the provider first refused the call at its tier.
    refused_since: Option<Instant>,
}

impl CallTier {
    pub(super) fn new(settings: Option<ServiceTierSettings>) -> Self {
        Self {
            asked: settings,
            refused_since: None,
        }
    }

    /// The tier the call is billed at unless its response names another.
    pub(super) fn billed(&self) -> PriceTier {
        self.asked
            .map_or(PriceTier::Standard, ServiceTierSettings::price_tier)
    }

    /// The provider refused the call (said to slow down) and it would wait `delay` to ask again:
    /// how long to wait instead before it goes at the standard tier, if its refusals have lasted
    /// (or will have, after `delay`) the run's `fallbackAfterSeconds`.
    pub(super) fn refused(&mut self, delay: Duration) -> Option<Duration> {
        let fallback_after = self.asked?.fallback_after?;
        let since = *self.refused_since.get_or_insert_with(Instant::now);
        let left = fallback_after.saturating_sub(since.elapsed());
        if left > delay {
            return None;
        }
        info!(
            wait_ms = left.as_millis(),
            "the provider keeps refusing the call at its service tier; it goes at the standard tier"
        );
        Some(left)
    }

    /// The call goes at the standard tier from now on: `body` without its `service_tier`.
    pub(super) fn fall_back(&mut self, body: &Value) -> Vec<u8> {
        self.asked = None;
        let mut standard = body.clone();
        if let Some(fields) = standard.as_object_mut() {
            fields.remove(SERVICE_TIER);
        }
        serde_json::to_vec(&standard).expect("a JSON value serialises")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn flex(fallback_after: Option<u64>) -> ServiceTierSettings {
        ServiceTierSettings {
            tier: ServiceTier::Flex,
            fallback_after: fallback_after.map(Duration::from_secs),
        }
    }

    #[test]
    fn a_refused_call_keeps_its_tier_until_the_wait_is_spent() {
        let mut kept = CallTier::new(Some(flex(None)));
        assert_eq!(kept.refused(Duration::from_secs(3600)), None);
        assert_eq!(kept.billed(), PriceTier::Flex);

        let mut call = CallTier::new(Some(flex(Some(60))));
        assert_eq!(call.refused(Duration::from_secs(1)), None, "59 s to go");
        let wait = call.refused(Duration::from_secs(120)).unwrap();
        assert!(wait <= Duration::from_secs(60) && wait > Duration::from_secs(58));
        let body = json!({"model": "m", "service_tier": "flex", "messages": []});
        let standard: Value = serde_json::from_slice(&call.fall_back(&body)).unwrap();
        assert_eq!(standard, json!({"model": "m", "messages": []}));
        assert_eq!(call.billed(), PriceTier::Standard);
        assert_eq!(call.refused(Duration::ZERO), None, "no tier left to leave");

        let mut at_once = CallTier::new(Some(flex(Some(0))));
        assert_eq!(
            at_once.refused(Duration::from_secs(5)),
            Some(Duration::ZERO)
        );
        assert_eq!(CallTier::new(None).billed(), PriceTier::Standard);
    }
}
