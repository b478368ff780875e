//! Which URLs `web_extract` may fetch: http(s) only, and — unless the run allows private
//! addresses — only hosts on public addresses. The model is untrusted; without this it could read
//! the cloud metadata service, the cluster's services or the host's own ports through the worker.
//!
//! A literal address is checked before the request and at every redirect hop; a name is checked
//! by the client's resolver, which drops the non-public addresses a name resolves to, so a DNS
//! answer that changes between a check and the connection (rebinding) gains nothing.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use url::{Host, Url};

/// The reference's words for a refused address.
pub(crate) const BLOCKED: &str = "Blocked: URL targets a private or internal network address";

/// Why a URL may not be fetched, or `None`.
pub(crate) fn refusal(url: &Url, allow_private: bool) -> Option<String> {
    if !matches!(url.scheme(), "http" | "https") {
        return Some(format!(
            "only http:// and https:// URLs can be extracted, not {}:",
            url.scheme()
        ));
    }
    let ip = match url.host()? {
        Host::Ipv4(ip) => IpAddr::V4(ip),
        Host::Ipv6(ip) => IpAddr::V6(ip),
        Host::Domain(name) => {
            let lower = name.to_ascii_lowercase();
            if !allow_private && (lower == "localhost" || lower.ends_with(".localhost")) {
                return Some(BLOCKED.to_owned());
            }
            return None;
        }
    };
    (!allow_private && !is_public(ip)).then(|| BLOCKED.to_owned())
}

/// Whether an address is reachable on the public internet (what `IpAddr::is_global`, still
/// unstable, will say).
pub(crate) fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(ip) => is_public_v4(ip),
        IpAddr::V6(ip) => {
            if let Some(mapped) = ip.to_ipv4_mapped() {
                return is_public_v4(mapped);
            }
            let first = ip.segments()[0];
            !(ip.is_loopback()
                || ip.is_unspecified()
                || ip.is_multicast()
                || (first & 0xfe00) == 0xfc00 // unique local
                || (first & 0xffc0) == 0xfe80 // link-local
                || (first == 0x2001 && ip.segments()[1] == 0x0db8) // documentation
                || ip == Ipv6Addr::new(0x64, 0xff9b, 1, 0, 0, 0, 0, 0))
        }
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    !(ip.is_private()
        || ip.is_loopback()
        || ip.is_link_local()
        || ip.is_broadcast()
        || ip.is_documentation()
        || ip.is_unspecified()
        || ip.is_multicast()
        || a == 0
        || (a == 100 && (64..128).contains(&b)) // carrier-grade NAT
        || (a == 198 && (b == 18 || b == 19)) // benchmarking
        || a >= 240)
}

/// The system resolver, keeping only public addresses.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PublicOnly;

impl Resolve for PublicOnly {
    fn resolve(&self, name: Name) -> Resolving {
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|addr| is_public(addr.ip()))
                .collect();
            if addrs.is_empty() {
                return Err(format!("{host}: {BLOCKED}").into());
            }
            let addrs: Addrs = Box::new(addrs.into_iter());
            Ok(addrs)
        })
    }
}

/// A client builder that follows at most `max_redirects` redirects, refuses a redirect loop
/// and — unless `allow_private` — a redirect to a non-public address, resolves names to public
/// addresses only, and gives up on a request after `timeout`.
pub(crate) fn guarded_client(
    max_redirects: u32,
    allow_private: bool,
    timeout: std::time::Duration,
) -> reqwest::ClientBuilder {
    let max_redirects = max_redirects as usize;
    let policy = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().contains(attempt.url()) {
            let error = format!("redirect loop at {}", attempt.url());
            return attempt.error(error);
        }
        if attempt.previous().len() > max_redirects {
            let error = format!("more than {max_redirects} redirects");
            return attempt.error(error);
        }
        if let Some(refusal) = refusal(attempt.url(), allow_private) {
            let error = format!("redirect to {}: {refusal}", attempt.url());
            return attempt.error(error);
        }
        attempt.follow()
    });
    let builder = reqwest::Client::builder()
        .redirect(policy)
        .timeout(timeout)
        .connect_timeout(timeout.min(std::time::Duration::from_secs(10)))
        .user_agent(concat!("trajectory-worker/", env!("CARGO_PKG_VERSION")));
    if allow_private {
        builder
    } else {
        builder.dns_resolver(std::sync::Arc::new(PublicOnly))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(url: &str) -> Option<String> {
        refusal(&Url::parse(url).unwrap(), false)
    }

    #[test]
    fn internal_addresses_are_refused_and_public_ones_pass() {
        for url in [
            "http://127.0.0.1:8080/",
            "http://169.254.169.254/latest/meta-data/",
            "http://10.0.0.1/",
            "http://[::1]/",
            "http://[::ffff:192.168.1.1]/",
            "http://[fd00::1]/",
            "http://localhost/",
            "http://100.64.0.1/",
        ] {
            assert_eq!(refused(url).as_deref(), Some(BLOCKED), "{url}");
        }
        assert_eq!(refused("https://93.184.215.14/"), None);
        assert_eq!(refused("https://docs.python.org/3/"), None);
        assert!(
            refused("file:///etc/passwd")
                .unwrap()
                .starts_with("only http")
        );
        assert_eq!(
            refusal(&Url::parse("http://127.0.0.1/").unwrap(), true),
            None
        );
    }
}
