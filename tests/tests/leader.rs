//! Leader election on the real control plane: of two replicas competing for one Lease exactly one
//! leads, and when it steps down the other takes over within the Lease's duration; the whole
//! operator process stops its controller when it loses the Lease, and releases it when told to stop.
//! Needs a running cluster: `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test leader`.

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::time::Instant;
use trajectory_operator::leader::{Election, LeaseConfig};
use trajectory_operator::service::{self, Exit};
use trajectory_operator::settings::Settings;
use trajectory_tests::{TestNamespace, client, install_crds, wait_until};

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

/// The body of `GET path`, or `None` when the listener does not answer.
async fn get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    Some(response)
}

/// Starts the operator process (HTTP, election, controller) in-process; returns its HTTP address,
/// the sender that stops it like SIGTERM, and its task.
async fn start_operator(
    client: &kube::Client,
    namespace: &str,
) -> (
    SocketAddr,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<Exit, service::ServiceError>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local address");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(service::run(
        client.clone(),
        Settings::default(),
        listener,
        Some(lease(namespace, "operator-0")),
        async {
            let _ = stopped.await;
        },
    ));
    wait_until(
        "the operator to run its controller",
        Duration::from_secs(20),
        || async {
            get(addr, "/readyz").await.filter(|response| {
                response.starts_with("HTTP/1.1 200") && response.ends_with("running\n")
            })
        },
    )
    .await;
    (addr, stop, task)
}

#[tokio::test]
async fn an_operator_that_loses_its_lease_stops_its_controller_and_says_so() {
    let client = client().await;
    install_crds(&client).await;
    let namespace = TestNamespace::create(&client, "lease-lost").await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace.name());
    let (addr, _stop, task) = start_operator(&client, namespace.name()).await;
    let metrics = get(addr, "/metrics").await.expect("/metrics answers");
    assert!(
        metrics.contains("trajectory_operator_leader 1"),
        "{metrics}"
    );

    // Another holder takes the Lease over (as after a long pause of this replica).
    let intruder = json!({"spec": {
        "holderIdentity": "intruder",
        "renewTime": MicroTime(Timestamp::now()),
        "leaseDurationSeconds": 60,
    }});
    leases
        .patch(
            "trajectory-operator",
            &PatchParams::default(),
            &Patch::Merge(&intruder),
        )
        .await
        .expect("patch the Lease");

    let exit = tokio::time::timeout(DURATION * 3, task)
        .await
        .expect("the operator stops after losing the Lease")
        .expect("operator task")
        .expect("operator");
    assert_eq!(exit, Exit::LostLease);
    assert_eq!(
        holder(&leases).await.as_deref(),
        Some("intruder"),
        "the Lease is left to its holder"
    );
}

#[tokio::test]
async fn an_operator_told_to_stop_releases_its_lease() {
    let client = client().await;
    install_crds(&client).await;
    let namespace = TestNamespace::create(&client, "lease-stop").await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace.name());
    let (addr, stop, task) = start_operator(&client, namespace.name()).await;
    assert_eq!(holder(&leases).await.as_deref(), Some("operator-0"));

    stop.send(()).expect("the operator runs");
    let exit = tokio::time::timeout(Duration::from_secs(15), task)
        .await
        .expect("the operator stops")
        .expect("operator task")
        .expect("operator");
    assert_eq!(exit, Exit::Stopped);
    assert_eq!(
        holder(&leases).await,
        None,
        "the Lease is released for a stand-by"
    );
    assert!(
        get(addr, "/healthz").await.is_none(),
        "the HTTP listener has stopped"
    );
}
