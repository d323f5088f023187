"""Can this machine open a TCP connection to an initial peer, and if not, what to tell the volunteer: the one place
`collab join`'s start-up error and `collab doctor` get their words from. hivemind's p2pd says only "failed to connect
to bootstrap peers" (or "Daemon failed to start" with a timestamp); a plain TCP connect tells refused from timed out
from unresolvable, and each has its own fix."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

TCP_TIMEOUT = 5.0  # seconds for each initial peer's TCP connect


def tcp_target(maddr: str) -> Optional[tuple[str, int]]:
    """(host, port) of a /ip4|ip6|dns.../tcp/PORT multiaddr; None for other transports (relayed, quic)."""
    parts = maddr.split("/")
    if len(parts) >= 5 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") and parts[3] == "tcp" \
            and parts[4].isdigit():
        return parts[2], int(parts[4])
    return None


def tcp_reach(host: str, port: int, timeout: float = TCP_TIMEOUT) -> tuple[Optional[float], Optional[str]]:
    """(milliseconds, None) when a TCP connect succeeds, else (None, "refused" | "timed out" | ...)."""
    started = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except socket.timeout:
        return None, "timed out"
    except ConnectionRefusedError:
        return None, "refused"
    except socket.gaierror:
        return None, "name not resolved"
    except OSError as e:
        return None, f"unreachable ({e.strerror or e})"
    return round((time.monotonic() - started) * 1000, 1), None


def what_to_check(maddr: str, error: str) -> str:
    """The fix for an initial peer that a TCP connect did not reach with `error`."""
    target = tcp_target(maddr)
    where = f"{target[0]}:{target[1]}" if target else maddr
    if error == "refused":
        return (f"nothing listens on {where}: that peer is down or restarted on another port; ask the organizer for "
                "a current join line")
    if error == "timed out":
        return (f"no answer from {where} in {TCP_TIMEOUT:g} s: a firewall drops it or the address is not public; "
                f"check that the address is current and that TCP {where.rsplit(':', 1)[-1]} is open there "
                f"('nc -vz {where.replace(':', ' ')}'), and that your network allows outgoing TCP to it")
    if error == "name not resolved":
        return f"the host name in {maddr} does not resolve: check its spelling and your DNS"
    return f"check your network connection and the address {where}"


def reach_all(maddrs: list[str]) -> list[tuple[Optional[float], Optional[str]]]:
    """tcp_reach for each multiaddr at once; (None, None) for one that is not a TCP address (not checked)."""
    def one(maddr: str):
        target = tcp_target(maddr)
        return tcp_reach(*target) if target is not None else (None, None)

    if not maddrs:
        return []
    with ThreadPoolExecutor(min(8, len(maddrs))) as pool:
        return list(pool.map(one, maddrs))


def why_not_joined(maddrs: list[str], pinged: int = 0) -> str:
    """One line for a DHT node that could not join through `maddrs`: the first one TCP did not reach, with its fix;
    or, when TCP reached them all, that their DHT nodes did not answer this node's pings in time (`pinged`: in as many
    tries, the join failed so), or else that they answer but not as those libp2p peers."""
    for maddr, (_, error) in zip(maddrs, reach_all(maddrs)):
        if error is not None:
            target = tcp_target(maddr)
            return f"{maddr}: {error} ({target[0]}:{target[1]}); {what_to_check(maddr, error)}"
    if pinged:
        return (f"{', '.join(maddrs)} answers TCP, but no DHT node there answered a ping in time ({pinged} tries): "
                "that machine (or this one) is too busy, or the peer is still starting; try again in a minute")
    return (f"{', '.join(maddrs)} answers TCP but not as that libp2p peer: the peer restarted with a new identity, or "
            "another program holds its port; ask the organizer for a current join line (or start a new swarm "
            "without --initial-peers)")
