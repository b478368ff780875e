//! How the operator judges an error of the API server: retried, or the run's own fault.

/// True when the API server refused a request as wrong in itself (400 Bad Request, 422 Invalid, and
/// other 4xx), which sending it again cannot change. Not so for 401/403 (credentials and RBAC get
/// fixed without touching the run), 404 (a namespace or CRD on its way), 408, 409 (a stale copy)
/// and 429 (throttling).
pub fn is_refused(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status)
        if (400..500).contains(&status.code)
            && ![401, 403, 404, 408, 409, 429].contains(&status.code))
}
