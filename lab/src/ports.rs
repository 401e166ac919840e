//! Choosing ports for the lab's listeners.
//!
//! A port the OS hands out for `bind(0)` comes from the ephemeral range, the same range
//! every Dynamo process draws its own event-plane and request-plane ports from while the
//! lab starts: a port chosen that way and bound a moment later by a mocker can already
//! be taken (seen here: `ZMQ PUB bind … Address already in use`). So the lab picks its
//! ports *below* the ephemeral range, where nothing is assigned automatically.
//!
//! A port counts as free when a bind to `0.0.0.0` *without* `SO_REUSEADDR` succeeds:
//! that fails on any socket bound to the port on any IPv4 address, listening or not,
//! and on a closed connection's `TIME_WAIT` remnant. (std's `TcpListener::bind` sets
//! `SO_REUSEADDR`, so a check made with it misses the last two.)
//!
//! Choosing a port and binding it are two moments, and a lab started alongside can
//! choose the same port in between (seen here: NIXL aborting with `Failed to bind
//! metadata listener socket`, its lab having chosen its ports 3 s before its agents
//! bound them). [`reserve_ports`] closes that gap: each port stays bound, not
//! listening, with `SO_REUSEADDR`, until the [`PortReservation`] is dropped. Every other
//! chooser's check then fails on it and the kernel never hands it out as an ephemeral
//! port, while the listener it is meant for can still bind it, as long as that listener
//! sets `SO_REUSEADDR` too (NIXL's, tokio's, ZMQ's and Go's do): Linux lets sockets that
//! all set it share a port as long as only one listens.

use std::net::{Ipv4Addr, SocketAddrV4};

use socket2::{Domain, SockAddr, Socket, Type};

const EPHEMERAL_RANGE: &str = "/proc/sys/net/ipv4/ip_local_port_range";

/// The first port of the OS's ephemeral range (32768 when it cannot be read).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string(EPHEMERAL_RANGE)
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// Ports held for listeners that bind them later; dropping it releases them.
#[derive(Debug)]
pub struct PortReservation {
    held: Vec<(u16, Socket)>,
}

impl PortReservation {
    /// The reserved ports, in the order they were chosen.
    pub fn ports(&self) -> Vec<u16> {
        self.held.iter().map(|(port, _)| *port).collect()
    }
}

/// Binds `port` on every IPv4 address if nothing at all is bound to it, and then marks
/// the socket `SO_REUSEADDR` so the listener meant for the port can join it.
fn hold(port: u16) -> Option<Socket> {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).ok()?;
    // No SO_REUSEADDR yet: the bind must fail on any other socket bound to the port.
    socket
        .bind(&SockAddr::from(SocketAddrV4::new(
            Ipv4Addr::UNSPECIFIED,
            port,
        )))
        .ok()?;
    // The kernel reads a bound socket's flag when a later bind checks for conflicts.
    socket.set_reuse_address(true).ok()?;
    Some(socket)
}

/// `n` distinct ports below the ephemeral range, free right now, and held until the
/// returned reservation is dropped (see the module docs for why holding matters).
pub fn reserve_ports(n: usize) -> std::io::Result<PortReservation> {
    let top = ephemeral_start().max(12_000);
    let bottom = top.saturating_sub(8_000).max(10_000);
    let span = u32::from(top - bottom);
    // Start somewhere different per process, so labs started side by side rarely even
    // try the same ports.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut offset = (std::process::id().wrapping_mul(7919) ^ nanos) % span;
    let mut held = Vec::with_capacity(n);
    for _ in 0..span {
        if held.len() == n {
            break;
        }
        let port = bottom + offset as u16;
        offset = (offset + 1) % span;
        // A port this reservation holds fails the check, so none is taken twice.
        if let Some(socket) = hold(port) {
            held.push((port, socket));
        }
    }
    if held.len() == n {
        return Ok(PortReservation { held });
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrNotAvailable,
        format!("fewer than {n} free ports between {bottom} and {top}"),
    ))
}

/// `n` distinct ports below the ephemeral range, free right now but not held: for a
/// listener that binds at once. Use [`reserve_ports`] when the bind comes later.
pub fn pick_ports(n: usize) -> std::io::Result<Vec<u16>> {
    Ok(reserve_ports(n)?.ports())
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};

    use super::*;

    fn is_free(port: u16) -> bool {
        hold(port).is_some()
    }

    /// The tests below bind and release ports they chose a moment earlier; run side by
    /// side, one can choose a port another is about to bind (the choice is free between
    /// `pick_ports` and the bind), so they take turns.
    static PORT_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        PORT_TESTS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[test]
    fn ports_are_distinct_free_and_below_the_ephemeral_range() {
        let _turn = one_at_a_time();
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

    #[test]
    fn a_reserved_port_is_busy_to_others_yet_its_listener_binds_it() {
        let _turn = one_at_a_time();
        let reservation = reserve_ports(3).unwrap();
        let ports = reservation.ports();
        for &port in &ports {
            assert!(!is_free(port), "port {port} is reserved, so not free");
        }
        // Listeners that set SO_REUSEADDR (std and tokio do) bind the reserved ports,
        // on the wildcard and on loopback, and take connections.
        let wildcard = TcpListener::bind(("0.0.0.0", ports[0])).unwrap();
        let loopback = TcpListener::bind(("127.0.0.1", ports[1])).unwrap();
        for (listener, port) in [(&wildcard, ports[0]), (&loopback, ports[1])] {
            let _client = TcpStream::connect(("127.0.0.1", port)).unwrap();
            listener.accept().unwrap();
        }
        // A second listener cannot join once one listens.
        assert!(TcpListener::bind(("127.0.0.1", ports[0])).is_err());
        drop((wildcard, loopback));
        drop(reservation);
        // The third was never listened on, so it has no TIME_WAIT remnant.
        assert!(is_free(ports[2]), "port {} released", ports[2]);
    }

    #[test]
    fn a_port_left_in_time_wait_is_not_free() {
        let _turn = one_at_a_time();
        let port = pick_ports(1).unwrap()[0];
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap();
        // The listener's side closes first, so it is the side left in TIME_WAIT.
        drop(listener.accept().unwrap().0);
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).unwrap();
        drop(client);
        drop(listener);
        assert!(
            time_waits_on(port),
            "a connection on port {port} is in TIME_WAIT"
        );
        if let Err(e) = TcpListener::bind(("127.0.0.1", port)) {
            panic!("std's check alone would call port {port} free, yet its bind failed: {e}");
        }
        assert!(!is_free(port), "port {port} has a TIME_WAIT remnant");
    }

    /// Whether `/proc/net/tcp` shows a TIME_WAIT connection with local port `port`.
    fn time_waits_on(port: u16) -> bool {
        const TIME_WAIT: &str = "06";
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        table.lines().skip(1).any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields[1].rsplit(':').next().unwrap();
            u16::from_str_radix(local_port, 16).ok() == Some(port) && fields[3] == TIME_WAIT
        })
    }
}
