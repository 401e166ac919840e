//! Choosing ports for the lab's listeners.
//!
//! A port the OS hands out for `bind(0)` comes from the ephemeral range, the same range
//! every Dynamo process draws its own event-plane and request-plane ports from while the
//! lab starts: a port chosen that way and bound a moment later by a mocker can already
//! be taken (seen here: `ZMQ PUB bind … Address already in use`). So the lab picks its
//! ports *below* the ephemeral range, where nothing is assigned automatically, and checks
//! each is free on every interface (the mockers bind 0.0.0.0).

use std::net::TcpListener;

const EPHEMERAL_RANGE: &str = "/proc/sys/net/ipv4/ip_local_port_range";

/// The first port of the OS's ephemeral range (32768 when it cannot be read).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string(EPHEMERAL_RANGE)
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// `n` distinct ports, free right now on 0.0.0.0 and 127.0.0.1, below the ephemeral range.
pub fn pick_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let top = ephemeral_start().max(12_000);
    let bottom = top.saturating_sub(8_000).max(10_000);
    let span = u32::from(top - bottom);
    // Start somewhere different per process, so labs started side by side don't collide.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut offset = (std::process::id().wrapping_mul(7919) ^ nanos) % span;
    let mut ports = Vec::with_capacity(n);
    for _ in 0..span {
        let port = bottom + offset as u16;
        offset = (offset + 1) % span;
        let free = TcpListener::bind(("0.0.0.0", port)).is_ok()
            && TcpListener::bind(("127.0.0.1", port)).is_ok();
        if free && !ports.contains(&port) {
            ports.push(port);
            if ports.len() == n {
                return Ok(ports);
            }
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrNotAvailable,
        format!("fewer than {n} free ports between {bottom} and {top}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_free_and_below_the_ephemeral_range() {
        let ports = pick_ports(5).unwrap();
        assert_eq!(ports.len(), 5);
        let mut sorted = ports.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 5);
        assert!(ports.iter().all(|p| *p < ephemeral_start()));
        for p in ports {
            TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
    }
}
