//! The bearer token every writing endpoint requires (the actuator's API, a data
//! plane's directive endpoint): read from a file, compared in constant time.

use std::path::Path;

/// The body of a refusal, beside `401` and `WWW-Authenticate: Bearer`.
pub const REFUSAL_BODY: &str = "a valid bearer token is required\n";

/// Whether an `Authorization` header value is `Bearer <token>` (compared in constant
/// time); an empty `token` refuses everything. The scheme is case-insensitive, as HTTP
/// auth schemes are (RFC 9110 §11.1): clients send `bearer` too. Used by the daemons'
/// HTTP servers only (the `daemon` feature).
#[cfg_attr(not(feature = "daemon"), allow(dead_code))]
pub(crate) fn bearer_matches(authorization: Option<&str>, token: &str) -> bool {
    let Some((scheme, given)) = authorization.and_then(|v| v.trim_start().split_once(' ')) else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer")
        && !token.is_empty()
        && constant_time_eq(given.trim().as_bytes(), token.as_bytes())
}

/// Whether `headers` carry `Authorization: Bearer <token>`.
#[cfg(feature = "daemon")]
pub fn authorized(headers: &hyper::HeaderMap, token: &str) -> bool {
    bearer_matches(
        headers
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
        token,
    )
}

#[cfg_attr(not(feature = "daemon"), allow(dead_code))]
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A token file's first line, trimmed.
pub fn read_token(path: &Path) -> std::io::Result<String> {
    let text = std::fs::read_to_string(path)?;
    Ok(text.lines().next().unwrap_or("").trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_must_match_exactly() {
        assert!(bearer_matches(
            Some("Bearer secret-token-123"),
            "secret-token-123"
        ));
        assert!(!bearer_matches(
            Some("Bearer secret-token-124"),
            "secret-token-123"
        ));
        assert!(!bearer_matches(
            Some("secret-token-123"),
            "secret-token-123"
        ));
        assert!(!bearer_matches(None, "secret-token-123"));
        for scheme in ["bearer", "BEARER", "BeArEr"] {
            assert!(
                bearer_matches(
                    Some(&format!("{scheme} secret-token-123")),
                    "secret-token-123"
                ),
                "the scheme is case-insensitive: {scheme}"
            );
        }
        assert!(!bearer_matches(
            Some("Bearers secret-token-123"),
            "secret-token-123"
        ));
        assert!(!bearer_matches(
            Some("Basic secret-token-123"),
            "secret-token-123"
        ));
        assert!(
            !bearer_matches(Some("Bearer "), ""),
            "an empty token refuses everything"
        );
    }

    #[cfg(feature = "daemon")]
    #[test]
    fn headers_must_carry_the_bearer_scheme_and_token() {
        use hyper::header::AUTHORIZATION;
        let mut h = hyper::HeaderMap::new();
        assert!(!authorized(&h, "secret-token-123"));
        h.insert(AUTHORIZATION, "Bearer secret-token-123".parse().unwrap());
        assert!(authorized(&h, "secret-token-123"));
        assert!(!authorized(&h, "secret-token-124"));
        assert!(!authorized(&h, ""), "an empty token refuses everything");
        h.insert(AUTHORIZATION, "Basic secret-token-123".parse().unwrap());
        assert!(!authorized(&h, "secret-token-123"));
    }
}
