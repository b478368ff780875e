//! Leader election on a `coordination.k8s.io/v1` Lease, so that of several replicas only one
//! reconciles runs.
//!
//! The Lease protocol is `kube-lease-manager`'s (made for kube 5; server-side apply makes two
//! replicas taking a free Lease at once conflict instead of both winning): the holder renews the
//! Lease `grace` seconds before it expires, the others take it once it has expired or been
//! released. A replica that loses the Lease stops its controller and exits non-zero so that its
//! Deployment restarts it as a stand-by ([`crate::service`]).

use std::time::Duration;

use kube::Client;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Which Lease to hold and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    pub name: String,
    pub namespace: String,
    /// Unique among the replicas: the pod name.
    pub identity: String,
    /// How long the Lease holds without a renewal.
    pub duration: Duration,
    /// How long before expiry the holder renews; also the clock skew the replicas tolerate.
    pub grace: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error(
        "the Lease duration ({duration:?}) must be longer than its renewal grace ({grace:?}), \
         and both at least one second"
    )]
    Timing { duration: Duration, grace: Duration },
    #[error("Lease {namespace}/{name}: {source}")]
    Lease {
        namespace: String,
        name: String,
        #[source]
        source: LeaseManagerError,
    },
    #[error("the Lease manager of {0} stopped")]
    Stopped(String),
}

/// A running election: watches the Lease, takes it when it is free and renews it while it holds
/// it. Dropping it releases the Lease in the background; [`Election::step_down`] waits for that.
#[derive(Debug)]
pub struct Election {
    config: LeaseConfig,
    leading: watch::Receiver<bool>,
    task: JoinHandle<Result<LeaseManager, LeaseManagerError>>,
}

impl Election {
    /// Creates the Lease if it does not exist and starts competing for it.
    pub async fn start(client: Client, config: LeaseConfig) -> Result<Self, LeaderError> {
        let seconds = |d: Duration| d.as_secs();
        if seconds(config.grace) == 0 || seconds(config.duration) <= seconds(config.grace) {
            // kube-lease-manager panics on these; refuse them as configuration errors.
            return Err(LeaderError::Timing {
                duration: config.duration,
                grace: config.grace,
            });
        }
        let manager = LeaseManagerBuilder::new(client, &config.name)
            .with_namespace(&config.namespace)
            .with_identity(&config.identity)
            .with_duration(seconds(config.duration))
            .with_grace(seconds(config.grace))
            .with_field_manager(format!("trajectory-operator-{}", config.identity))
            .build()
            .await
            .map_err(|source| LeaderError::Lease {
                namespace: config.namespace.clone(),
                name: config.name.clone(),
                source,
            })?;
        let (leading, task) = manager.watch().await;
        Ok(Self {
            config,
            leading,
            task,
        })
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// True while this replica holds the Lease.
    pub fn is_leader(&self) -> bool {
        *self.leading.borrow()
    }

    /// Waits until this replica holds the Lease. Fails when the election has stopped (the
    /// Lease manager gave up), which a caller should treat like a lost Lease.
    pub async fn acquired(&mut self) -> Result<(), LeaderError> {
        self.leading
            .wait_for(|leading| *leading)
            .await
            .map(|_| ())
            .map_err(|_| LeaderError::Stopped(self.config.identity.clone()))
    }

    /// A future that resolves when this replica no longer holds the Lease (or the election
    /// stopped); call it once the Lease is held. Owns what it needs, so it can be handed to
    /// another task; it holds a receiver of the Lease state, so drop it before
    /// [`Election::step_down`], which waits until no receiver is left.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut leading = self.leading.clone();
        async move {
            let _ = leading.wait_for(|leading| !*leading).await;
        }
    }

    /// Stops competing and releases the Lease if this replica holds it, so that a stand-by takes
    /// over at once instead of after the Lease expires.
    pub async fn step_down(self) -> Result<(), LeaderError> {
        let Self {
            config,
            leading,
            task,
        } = self;
        // The manager releases the Lease and ends once every receiver of its state is gone.
        drop(leading);
        match task.await {
            Ok(Ok(_manager)) => Ok(()),
            Ok(Err(source)) => Err(LeaderError::Lease {
                namespace: config.namespace,
                name: config.name,
                source,
            }),
            Err(_) => Err(LeaderError::Stopped(config.identity)),
        }
    }
}
