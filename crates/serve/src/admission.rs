//! How many connections are open, in all and per peer, and whether one more may be: a bound on
//! what a flood of connections can take (memory, file descriptors the store and the broker
//! need), and on how much of it one peer can.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex, PoisonError};

use agent_metrics::global;

/// Why a connection was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// As many connections are open as the server takes.
    Full,
    /// As many are open from the connection's peer as one peer may have.
    PeerFull,
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::Full => "full",
            Refusal::PeerFull => "peer_full",
        }
    }
}

#[derive(Default)]
struct Open {
    all: usize,
    by_peer: HashMap<IpAddr, usize>,
}

/// The connections open from other hosts, and how many may be.
pub struct Admission {
    /// The server's name, in metrics.
    server: &'static str,
    most: usize,
    /// 0: no bound per peer.
    most_per_peer: usize,
    open: Mutex<Open>,
}

/// One open connection, counted until it is dropped (a connection from this machine is not).
pub struct Admitted {
    admission: Arc<Admission>,
    counted: Counted,
}

enum Counted {
    /// From this machine.
    Not,
    /// In all only (no bound per peer).
    InAll,
    /// In all and against its peer.
    Peer(IpAddr),
}

impl Admission {
    pub fn new(server: &'static str, most: usize, most_per_peer: usize) -> Arc<Admission> {
        Arc::new(Admission {
            server,
            most,
            most_per_peer,
            open: Mutex::new(Open::default()),
        })
    }

    /// Counts a connection from `peer` in, or says why not.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<Admitted, Refusal> {
        let Some(peer) = peer_of(peer) else {
            return Ok(Admitted {
                admission: self.clone(),
                counted: Counted::Not,
            });
        };
        // Nothing a connection does is under this lock, so a poisoned one still counts right.
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if open.all >= self.most {
            return Err(Refusal::Full);
        }
        let counted = if self.most_per_peer > 0 {
            let from_peer = open.by_peer.entry(peer).or_default();
            if *from_peer >= self.most_per_peer {
                return Err(Refusal::PeerFull);
            }
            *from_peer += 1;
            Counted::Peer(peer)
        } else {
            Counted::InAll
        };
        open.all += 1;
        self.report(open.all);
        Ok(Admitted {
            admission: self.clone(),
            counted,
        })
    }

    /// Connections open now from other hosts.
    pub fn open(&self) -> usize {
        self.open.lock().unwrap_or_else(PoisonError::into_inner).all
    }

    fn report(&self, open: usize) {
        global().set(
            crate::CONNECTIONS_OPEN,
            &[("server", self.server)],
            open as f64,
        );
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if matches!(self.counted, Counted::Not) {
            return;
        }
        let admission = &self.admission;
        let mut open = admission
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        open.all = open.all.saturating_sub(1);
        if let Counted::Peer(peer) = self.counted {
            if let Some(from_peer) = open.by_peer.get_mut(&peer) {
                *from_peer = from_peer.saturating_sub(1);
                if *from_peer == 0 {
                    open.by_peer.remove(&peer);
                }
            }
        }
        admission.report(open.all);
    }
}

/// Who a connection counts against: its address, an IPv6 one by its /64 (one host is commonly
/// given a whole /64, and could otherwise open each connection from an address of its own).
/// `None` for this machine: the services of one host (and `agentctl up`'s, all in one process)
/// reach each other over loopback, and whoever runs there can stop the process anyway.
fn peer_of(address: IpAddr) -> Option<IpAddr> {
    let address = address.to_canonical();
    if address.is_loopback() {
        return None;
    }
    Some(match address {
        IpAddr::V4(_) => address,
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(prefix))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse()
            .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED))
    }

    #[test]
    fn connections_are_bounded_in_all_and_counted_back_when_closed() {
        let admission = Admission::new("test", 3, 0);
        let held: Vec<_> = ["10.0.0.1", "10.0.0.2", "10.0.0.1"]
            .iter()
            .map(|a| admission.admit(ip(a)))
            .collect();
        assert!(held.iter().all(Result::is_ok));
        assert!(matches!(
            admission.admit(ip("10.0.0.3")),
            Err(Refusal::Full)
        ));
        // This machine's own connections are neither bounded nor counted.
        let local: Vec<_> = (0..10).map(|_| admission.admit(ip("::1"))).collect();
        assert!(local.iter().all(Result::is_ok));
        assert_eq!(admission.open(), 3);
        drop(local);
        assert_eq!(admission.open(), 3);
        drop(held);
        assert_eq!(admission.open(), 0);
        assert!(admission.admit(ip("10.0.0.3")).is_ok());
    }

    #[test]
    fn one_peer_takes_no_more_than_its_share_and_this_machine_is_not_counted() {
        let admission = Admission::new("test", 100, 2);
        let first = admission.admit(ip("192.0.2.7"));
        let second = admission.admit(ip("::ffff:192.0.2.7"));
        assert!(first.is_ok() && second.is_ok());
        assert!(matches!(
            admission.admit(ip("192.0.2.7")),
            Err(Refusal::PeerFull)
        ));
        // Another address of the same IPv6 /64 is the same peer; another /64 is not.
        let v6: Vec<_> = ["2001:db8::1", "2001:db8::2:3"]
            .iter()
            .map(|a| admission.admit(ip(a)))
            .collect();
        assert!(v6.iter().all(Result::is_ok));
        assert!(matches!(
            admission.admit(ip("2001:db8::ffff:1")),
            Err(Refusal::PeerFull)
        ));
        assert!(admission.admit(ip("2001:db8:0:1::1")).is_ok());
        assert!(admission.admit(ip("192.0.2.8")).is_ok());
        let local: Vec<_> = (0..10).map(|_| admission.admit(ip("127.0.0.1"))).collect();
        assert!(local.iter().all(Result::is_ok));
        // A closed connection gives its peer's place back.
        drop(first);
        assert!(admission.admit(ip("192.0.2.7")).is_ok());
    }
}
