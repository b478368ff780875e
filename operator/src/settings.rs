//! Operator-wide settings: what shapes the children of every run, which runs to act on, and the
//! pace of status writes and retries. Built once by `main` from its flags and passed in.

use std::time::Duration;

/// Operator-wide settings: what shapes the children, which runs to act on, and the pace of writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Worker image used when `spec.podTemplate.image` is unset.
    pub worker_image: String,
    /// `TRAJ_LOG_FORMAT` of the worker pods (`json` or `pretty`).
    pub worker_log_format: String,
    /// The only namespace whose runs the operator acts on (the Helm chart's `scope: Namespace`,
    /// where RBAC grants nothing elsewhere); `None`: every namespace.
    pub watch_namespace: Option<String>,
    /// How often the controller writes status and retries after errors (no effect on children).
    pub pacing: Pacing,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            // The image `scripts/images/build.sh` tags for this workspace version (it tags no
            // `latest`), so an operator started without the chart runs workers of its own release.
            worker_image: concat!(
                "ghcr.io/trajectory-operator/trajectory-worker:",
                env!("CARGO_PKG_VERSION")
            )
            .to_owned(),
            worker_log_format: "json".to_owned(),
            watch_namespace: None,
            pacing: Pacing::default(),
        }
    }
}

/// How often the controller writes and retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    /// The least time between two status writes of one run that change only its progress.
    pub status_interval: Duration,
    /// Requeues after transient errors.
    pub retry: Backoff,
}

impl Default for Pacing {
    fn default() -> Self {
        Self {
            status_interval: Duration::from_secs(3),
            retry: Backoff::default(),
        }
    }
}

/// Exponential backoff of the requeues after transient errors of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The delay after the first failure.
    pub first: Duration,
    /// The longest delay.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            first: Duration::from_millis(500),
            max: Duration::from_secs(300),
        }
    }
}

impl Backoff {
    /// The requeue delay after `failures` consecutive failures (the first is 1): `first`, doubled at
    /// every further failure, at most `max`.
    pub fn delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.first
            .checked_mul(1 << doublings)
            .map_or(self.max, |delay| delay.min(self.max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_the_first_delay_up_to_the_cap() {
        let backoff = Backoff {
            first: Duration::from_millis(500),
            max: Duration::from_secs(60),
        };
        let delays: Vec<u64> = (1..=10)
            .map(|failures| u64::try_from(backoff.delay(failures).as_millis()).unwrap())
            .collect();
        assert_eq!(
            delays,
            [
                500, 1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 60_000, 60_000, 60_000
            ]
        );
        // No failure yet counts as the first; absurd counts neither overflow nor exceed the cap.
        assert_eq!(backoff.delay(0), Duration::from_millis(500));
        assert_eq!(backoff.delay(u32::MAX), Duration::from_secs(60));
        let huge = Backoff {
            first: Duration::from_secs(u64::MAX / 2),
            max: Duration::MAX,
        };
        assert_eq!(huge.delay(40), Duration::MAX);
    }
}
