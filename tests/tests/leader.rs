//! Leader election on the real control plane: of two replicas competing for one Lease exactly one
//! leads, and when it steps down the other takes over within the Lease's duration.
//! Needs a running cluster: `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test leader`.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use tokio::time::Instant;
use trajectory_operator::leader::{Election, LeaseConfig};
use trajectory_tests::{TestNamespace, client, wait_until};

const DURATION: Duration = Duration::from_secs(6);

fn lease(namespace: &str, identity: &str) -> LeaseConfig {
    LeaseConfig {
        name: "trajectory-operator".into(),
        namespace: namespace.into(),
        identity: identity.into(),
        duration: DURATION,
        grace: Duration::from_secs(2),
    }
}

async fn holder(leases: &Api<Lease>) -> Option<String> {
    leases
        .get_opt("trajectory-operator")
        .await
        .ok()
        .flatten()
        .and_then(|lease| lease.spec?.holder_identity)
}

#[tokio::test]
async fn one_of_two_replicas_leads_and_the_other_takes_over_when_it_stops() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "leader").await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace.name());

    let mut a = Election::start(client.clone(), lease(namespace.name(), "replica-a"))
        .await
        .expect("election a");
    let mut b = Election::start(client.clone(), lease(namespace.name(), "replica-b"))
        .await
        .expect("election b");
    tokio::select! {
        acquired = a.acquired() => acquired.expect("a's election runs"),
        acquired = b.acquired() => acquired.expect("b's election runs"),
        () = tokio::time::sleep(DURATION * 2) => panic!("nobody took the free Lease"),
    }
    // Give the other replica a few renewals' time to (wrongly) take the Lease too.
    tokio::time::sleep(DURATION).await;
    assert!(
        a.is_leader() ^ b.is_leader(),
        "exactly one leads: a {}, b {}",
        a.is_leader(),
        b.is_leader()
    );
    let (leader, mut standby, standby_name) = if a.is_leader() {
        (a, b, "replica-b")
    } else {
        (b, a, "replica-a")
    };
    assert_eq!(
        holder(&leases).await.as_deref(),
        Some(leader.config().identity.as_str()),
        "the Lease names the leader"
    );

    let stopped = Instant::now();
    leader.step_down().await.expect("the leader steps down");
    tokio::time::timeout(DURATION, standby.acquired())
        .await
        .unwrap_or_else(|_| panic!("{standby_name} did not take over within {DURATION:?}"))
        .expect("the stand-by's election runs");
    eprintln!("{standby_name} took over after {:?}", stopped.elapsed());
    wait_until(
        "the Lease to name the new leader",
        Duration::from_secs(5),
        || async { (holder(&leases).await.as_deref() == Some(standby_name)).then_some(()) },
    )
    .await;
    standby
        .step_down()
        .await
        .expect("the new leader steps down");
}
